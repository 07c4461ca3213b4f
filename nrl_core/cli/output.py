"""Human-readable output of the CLI (rich tables)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from nrl_core.plugins import PluginInfo
from nrl_core.registry import KINDS

# The order users meet the kinds in a config: what trains, what generates, what rewards, ...
_FIRST = ("policy", "generation", "environment", "loss", "dataset", "agent", "cluster")
KIND_ORDER = _FIRST + tuple(k for k in KINDS if k not in _FIRST)


def _plugins_section(plugins: Sequence[PluginInfo]) -> Table:
    table = Table(box=None, title=None, show_header=True, header_style="bold", pad_edge=False)
    table.add_column("plugin", no_wrap=True, style="bold")
    table.add_column("distribution", no_wrap=True)
    # The status column is the only one that may wrap: a broken plugin's error is long.
    table.add_column("status")
    for info in plugins:
        dist = f"{info.distribution or 'in-process'} {info.version or ''}".strip()
        if info.status == "error":
            status = f"[red]error: {escape(info.error or '')}[/red]"
        elif not info.components:
            status = "[green]ok[/green] (registers nothing)"
        else:
            count = len(info.components)
            status = f"[green]ok[/green] ({count} component{'s' if count > 1 else ''})"
        table.add_row(info.name, dist, status)
    return table


def plugins_table(
    plugins: Sequence[PluginInfo], *, verbose: bool = False, console: Console | None = None
) -> None:
    """The loaded plugins (broken ones in red with their error), then their components grouped
    by kind, one line each: ``name  plugin  description``.

    Names are never shortened or wrapped (users type them into configs); at narrow widths the
    description is cut with an ellipsis. ``verbose`` shows each description in full, then the
    import target and the extras its actors need on lines of their own.
    """
    console = console or Console()
    console.print(_plugins_section(plugins))

    components = [spec for info in plugins if info.status == "ok" for spec in info.components]
    if not components:
        return
    indent = "  "
    name_width = max(len(indent) + len(s.name) for s in components)
    plugin_width = max(len("plugin"), *(len(s.plugin) for s in components))
    for kind in KIND_ORDER:
        specs = [s for s in components if s.kind == kind]
        if not specs:
            continue
        # One table per kind with the same fixed widths, so the columns line up from one
        # heading to the next.
        table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2, 0, 0))
        table.add_column("name", no_wrap=True, width=name_width, style="cyan")
        table.add_column("plugin", no_wrap=True, width=plugin_width)
        # Wrappable as a column, so rich narrows it first and never the name; each cell
        # decides itself whether it wraps (verbose) or is cut to one line.
        table.add_column("description")
        table.add_row(Text(kind, style="bold"), Text("plugin", style="dim"), "")
        for spec in specs:
            if verbose:
                detail = Text(spec.description or "-")
                extra = f"\n{spec.target_str}"
                if spec.extras:
                    extra += f"\nextras: {', '.join(spec.extras)}"
                detail.append(extra, style="dim")
            else:
                detail = Text(spec.description, no_wrap=True, overflow="ellipsis")
            table.add_row(indent + spec.name, spec.plugin, detail)
        console.print()
        console.print(table)
