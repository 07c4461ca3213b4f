"""``nrl doctor``: versions, GPU visibility, and whether each plugin's engine is importable here."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from packaging.requirements import Requirement
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nrl_core.plugins import PluginHost


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


def doctor(host: PluginHost, *, verbose: bool = False, console: Console | None = None) -> int:
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

    plugins = Table(title="plugins")
    for column in ("plugin", "status", "component", "needs extras", "importable here"):
        plugins.add_column(column)
    for info in host.plugins:
        if info.status == "error":
            plugins.add_row(info.name, "[red]error[/red]", "", "", f"[red]{info.error}[/red]")
            continue
        for spec in info.components:
            if not spec.extras or spec.distribution is None:
                plugins.add_row(info.name, "ok", f"{spec.kind} {spec.name}", "-", "yes")
                continue
            missing = [
                m
                for extra in spec.extras
                for m in missing_requirements(extra_requirements(spec.distribution, extra))
            ]
            extras = escape(f"{spec.distribution}[{','.join(spec.extras)}]")
            status = (
                "yes"
                if not missing
                else f"[yellow]no[/yellow]: missing {escape(', '.join(missing))} — runs in its actor "
                f"venv (`nrl venvs build {info.name}`)"
            )
            plugins.add_row(info.name, "ok", f"{spec.kind} {spec.name}", extras, status)
    console.print(plugins)
    return 1 if host.broken() else 0
