"""Human-readable output of the CLI (rich tables)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from nrl_core.plugins import PluginInfo


def plugins_table(
    plugins: Sequence[PluginInfo], *, verbose: bool = False, console: Console | None = None
) -> None:
    """One row per registered component, plugins in load order; broken plugins in red."""
    console = console or Console()
    table = Table(title="nrl plugins", show_lines=False)
    table.add_column("plugin", style="bold", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("kind")
    table.add_column("name", style="cyan")
    table.add_column("target" if verbose else "description", overflow="fold")
    for info in plugins:
        dist = f"{info.distribution or 'in-process'} {info.version or ''}".strip()
        label = f"{info.name}\n[dim]{dist}[/dim]"
        if info.status == "error":
            table.add_row(label, "[red]error[/red]", "", "", f"[red]{info.error}[/red]")
            continue
        if not info.components:
            table.add_row(label, "[green]ok[/green]", "", "", "(registers nothing)")
        for i, spec in enumerate(info.components):
            detail = spec.target_str if verbose else spec.description
            if spec.extras:
                detail += f" [dim](extras: {', '.join(spec.extras)})[/dim]"
            first = i == 0
            table.add_row(
                label if first else "",
                "[green]ok[/green]" if first else "",
                spec.kind,
                spec.name,
                detail,
            )
    console.print(table)
