"""What an actor venv is: the names and settings of the venvs (environment variables, file
names), the helpers that find the workspace and ``uv``, and :class:`VenvRequest`, the key of a
venv (distribution, extras, Python, lock hash or installed version) with how it is built, plus
reading a built venv's marker. The bottom of :mod:`nrl_core.distributed.actor_env`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import site
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import attrs

from nrl_core.distributed.errors import ActorEnvError

Mode = Literal["workspace", "installed"]

MARKER = "nrl-venv.json"
ACTOR_ENV_VAR = "NRL_ACTOR_ENV"
VENV_DIR_VAR = "NRL_VENV_DIR"
FORCE_VAR = "NRL_FORCE_REBUILD_VENVS"
LAYER_VAR = "NRL_ACTOR_VENV_LAYER"
CONTAINER_VAR = "NRL_CONTAINER"
MANIFEST_VAR = "NRL_IMAGE_MANIFEST"
IGNORE_MISMATCH_VAR = "NRL_IGNORE_VERSION_MISMATCH"
DEFAULT_MANIFEST = "/opt/nrl/image-manifest.json"
MANIFEST_FILES = ("pyproject.toml", "uv.lock")
CORE_DISTRIBUTION = "nrl-core"
CONSTRAINTS_FILE = "nrl-constraints.txt"
"""Written inside an installed-mode venv built beside a checkout (the lock's versions of
nrl-core's dependencies) or a CPU variant (those of the extras it replaces): the versions
``uv pip install`` was held to."""
OVERRIDES_FILE = "nrl-overrides.txt"
"""Written inside a CPU-variant venv: the ``uv pip install --override`` lines it was built with."""
CPU_INSTALL_KEY = "cpu_install"
"""The registration metadata key of a component's :class:`CpuInstall` (``register(...,
cpu_install={...})``)."""
BUILD_TIMEOUT_S = 3600.0
CUDA_SOURCE_BUILDS = frozenset({"transformer-engine-torch"})
"""Locked packages published as source only whose build compiles CUDA code, so needs nvcc
(Transformer Engine's torch extension, nrl-megatron[te]); :func:`check_source_builds`."""
CUDA_HEADERS = ("cuda_runtime_api.h", "cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")
"""The toolkit headers every torch CUDA extension compiles against (torch 2.14's
``ATen/cuda/CUDAContextLight.h`` includes them)."""
ACTOR_KINDS = frozenset({"policy", "generation", "environment", "agent"})
"""The component kinds whose actors run with their plugin's venv (:func:`actor_python`), built
with the extras they register. The others run in the driver (datasets, clusters) or inside
the policy's actors (losses): their extras must be installed there, not in a venv of theirs."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def find_workspace_root(start: Path | None = None) -> Path | None:
    """The nearest folder above ``nrl_core`` (or ``start``) holding ``uv.lock``; None if none."""
    here = (start or Path(__file__)).resolve()
    for folder in [here, *here.parents]:
        if (folder / "uv.lock").is_file() and (folder / "pyproject.toml").is_file():
            return folder
    return None


def file_hash(path: Path) -> str:
    """sha256 of a file's bytes, hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def canonical_name(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): ``Nrl_Foo`` -> ``nrl-foo``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def workspace_members(root: Path) -> frozenset[str]:
    """The canonical names of the distributions ``uv sync --package`` can build in ``root``:
    the ``members`` of ``uv.lock``'s ``[manifest]`` (a lock without one, of a single project:
    that project)."""
    import tomllib

    text = (Path(root) / "uv.lock").read_text()
    # The manifest comes before the packages; parsing only the head keeps this cheap (the
    # packages are most of a megabyte).
    head = text.split("\n[[package]]", 1)[0]
    try:
        members = tomllib.loads(head).get("manifest", {}).get("members")
        if members is None:
            members = [
                tomllib.loads((Path(root) / "pyproject.toml").read_text())["project"]["name"]
            ]
    except (tomllib.TOMLDecodeError, KeyError, OSError):
        return frozenset()
    return frozenset(canonical_name(m) for m in members)


def local_source(dist: metadata.Distribution) -> tuple[Path, bool] | None:
    """Where an installed distribution came from when it was installed from a local folder
    (PEP 610 ``direct_url.json``): ``(folder, editable)``; None for an index install."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    url = str(info.get("url", ""))
    if not url.startswith("file://"):
        return None
    from urllib.parse import unquote, urlparse

    folder = Path(unquote(urlparse(url).path))
    return folder, bool(info.get("dir_info", {}).get("editable"))


def uv_binary() -> str:
    """The uv executable: the one shipped by the ``uv`` package, else the one on PATH."""
    try:
        import uv

        return uv.find_uv_bin()
    except Exception:
        found = shutil.which("uv")
        if found is None:
            raise ActorEnvError(
                "uv is not installed; install it with `pip install uv` (it is "
                "a dependency of nrl-core) or set NRL_ACTOR_ENV=system"
            ) from None
        return found


def default_venv_root(workspace: Path | None, environ: Mapping[str, str] | None = None) -> Path:
    """``$NRL_VENV_DIR``, else ``<workspace>/venvs``, else ``~/.cache/nrl/venvs``."""
    environ = os.environ if environ is None else environ
    if environ.get(VENV_DIR_VAR):
        return Path(environ[VENV_DIR_VAR]).expanduser().resolve()
    if workspace is not None:
        return workspace / "venvs"
    return Path.home() / ".cache" / "nrl" / "venvs"


# ---------------------------------------------------------------------------------------------
# What to build


@attrs.frozen
class VenvRequest:
    """One actor venv: what goes in it and the fingerprint that keys it."""

    distribution: str
    extras: tuple[str, ...] = attrs.field(converter=lambda e: tuple(sorted(set(e))), default=())
    plugin: str = ""
    mode: Mode = "workspace"
    fingerprint: str = ""
    """The lockfile hash (workspace mode) or the installed version/requirement (installed)."""
    workspace: str | None = None
    requirement: str | None = None
    """What ``uv pip install`` gets (installed mode): ``DIST[E]==version``, ``DIST[E] @ url``,
    or a source folder with its extras (``/path/to/plugin[E]``)."""
    layer: tuple[str, ...] = ()
    """Site-packages folders visible below the venv's own (see ``docs/runtime.md``)."""
    python_version: str = attrs.field(factory=_python_version)
    editable: bool = False
    """Install ``requirement`` (a source folder) editable: the actors then run the plugin's
    current code, as the driver does (installed mode beside a checkout)."""
    variant: str = ""
    """``cpu`` for the venv a :class:`CpuInstall` describes; empty otherwise."""
    post_install: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """Requirements ``uv pip install`` adds after the locked install (a CPU variant's)."""
    overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """``uv pip install --override`` lines of the post-install."""
    constraint_extras: tuple[str, ...] = attrs.field(converter=tuple, default=())
    """Extras left out of the locked install whose locked versions constrain the post-install
    (workspace mode: ``uv export --extra``)."""

    @property
    def key(self) -> str:
        parts: list[Any] = [
            self.distribution,
            self.extras,
            self.mode,
            self.fingerprint,
            self.python_version,
            self.requirement,
            self.layer,
        ]
        if self.editable:  # only then: the venvs built before this field keep their keys
            parts.append("editable")
        if self.variant:  # likewise: GPU venvs keep the keys they had
            parts += [self.variant, self.post_install, self.overrides, self.constraint_extras]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]

    @property
    def dirname(self) -> str:
        extras = "+" + "+".join(self.extras) if self.extras else ""
        variant = f"-{self.variant}" if self.variant else ""
        return f"{self.distribution}{extras}{variant}-py{self.python_version}-{self.key}"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"key": self.key}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VenvRequest:
        fields = {f.name for f in attrs.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        for name in ("layer", "post_install", "overrides", "constraint_extras"):
            values[name] = tuple(values.get(name) or ())
        return cls(**values)


@attrs.frozen
class VenvInfo:
    """A ready venv."""

    path: Path
    python: Path
    built: bool
    """True when this call built it; False when an existing venv was reused."""
    request: VenvRequest


def request_for(
    distribution: str,
    extras: Sequence[str] = (),
    plugin: str = "",
    *,
    workspace: Path | Literal["auto"] | None = "auto",
    layer: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> VenvRequest:
    """Build the :class:`VenvRequest` of ``distribution[extras]`` for this checkout/install.

    ``layer`` (default ``$NRL_ACTOR_VENV_LAYER``) makes the driver's site-packages visible
    below the venv's own, for development and tests (see ``docs/runtime.md``).
    """
    environ = os.environ if environ is None else environ
    root = find_workspace_root() if workspace == "auto" else workspace
    layer = _truthy(environ.get(LAYER_VAR)) if layer is None else layer
    layer_dirs = tuple(site.getsitepackages()) if layer else ()
    if root is not None and canonical_name(distribution) not in workspace_members(Path(root)):
        # Installed beside the checkout (`uv pip install -e /somewhere/plugin`): `uv sync
        # --package` cannot build it, so it is installed like a user's plugin, against this
        # checkout's nrl-core and lockfile.
        return _beside_workspace_request(distribution, extras, plugin, Path(root), layer_dirs)
    if root is not None:
        return VenvRequest(
            distribution,
            tuple(extras),
            plugin,
            "workspace",
            file_hash(Path(root) / "uv.lock")[:16],
            str(root),
            None,
            layer_dirs,
        )
    dist = _installed(distribution)
    extra = f"[{','.join(sorted(extras))}]" if extras else ""
    requirement = f"{distribution}{extra}=={dist.version}"
    direct = dist.read_text("direct_url.json")
    if direct:
        url = json.loads(direct).get("url", "")
        if url.startswith("file://"):
            requirement = f"{distribution}{extra} @ {url}"
    return VenvRequest(
        distribution,
        tuple(extras),
        plugin,
        "installed",
        dist.version,
        None,
        requirement,
        layer_dirs,
    )


def _installed(distribution: str) -> metadata.Distribution:
    try:
        return metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise ActorEnvError(
            f"plugin distribution {distribution!r} is not installed; install "
            f"it (pip install {distribution}) or set NRL_ACTOR_ENV=system"
        ) from None


def _beside_workspace_request(
    distribution: str,
    extras: Sequence[str],
    plugin: str,
    root: Path,
    layer_dirs: tuple[str, ...],
) -> VenvRequest:
    """The installed-mode request of a plugin installed in a checkout's environment without
    being a member of its workspace."""
    dist = _installed(distribution)
    extra = f"[{','.join(sorted(extras))}]" if extras else ""
    source = local_source(dist)
    if source is not None and source[0].is_dir():
        requirement, editable = f"{source[0]}{extra}", source[1]
    else:
        requirement, editable = f"{distribution}{extra}=={dist.version}", False
    return VenvRequest(
        distribution,
        tuple(extras),
        plugin,
        "installed",
        _beside_workspace_fingerprint(dist, root),
        str(root),
        requirement,
        layer_dirs,
        editable=editable,
    )


def _beside_workspace_fingerprint(dist: metadata.Distribution, root: Path) -> str:
    """The plugin's version, the lockfile's hash and the hash of the plugin's own
    ``pyproject.toml`` (when installed from a folder): a changed dependency on either side
    means a new venv, an edited source file does not (editable)."""
    parts = [dist.version, file_hash(root / "uv.lock")[:8]]
    source = local_source(dist)
    if source is not None and (source[0] / "pyproject.toml").is_file():
        parts.append(file_hash(source[0] / "pyproject.toml")[:8])
    return "+".join(parts)


def _site_packages(venv: Path, python_version: str) -> Path:
    return venv / "lib" / f"python{python_version}" / "site-packages"


def read_marker(venv: Path) -> dict[str, Any] | None:
    """The venv's ``nrl-venv.json``, or None when missing or unreadable."""
    try:
        return json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None


def venv_is_ready(venv: Path, request: VenvRequest) -> bool:
    """True when ``venv`` holds a finished build of ``request`` with a working interpreter."""
    marker = read_marker(venv)
    python = venv / "bin" / "python"
    return bool(
        marker
        and marker.get("key") == request.key
        and python.exists()
        and os.access(python, os.X_OK)
    )
