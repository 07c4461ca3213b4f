"""``nrl plugins`` stays readable in an 80-column terminal or a pipe: whole names, short rows."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from nrl_core import hookimpl
from nrl_core.cli import main
from nrl_core.cli.output import plugins_table
from nrl_core.plugins import PluginHost


def _components():
    host = PluginHost.discover()
    return host, [spec for info in host.plugins for spec in info.components]


def _row(name: str, plugin: str) -> re.Pattern[str]:
    # The name whole, then the plugin: a name cut with an ellipsis or folded onto the next
    # line does not match.
    return re.compile(rf"^\s+{re.escape(name)}\s+{re.escape(plugin)}(\s|$)", re.MULTILINE)


@pytest.mark.parametrize("columns", ["80", "120"])
def test_every_name_whole_and_one_line_per_component(columns, monkeypatch, capsys):
    # capsys is not a terminal: rich sizes the output like a pipe, from COLUMNS (80 unset).
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    host, components = _components()
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= int(columns)
    for spec in components:
        assert _row(spec.name, spec.plugin).search(out), f"{spec.kind} {spec.name!r} not whole"
    # One line per plugin and per component, a heading and a blank line per kind, a header.
    kinds = {spec.kind for spec in components}
    assert len(lines) <= 1 + len(host.plugins) + len(components) + 2 * len(kinds)


def test_piped_output_defaults_to_80_columns(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "openmathinstruct2" in out


def test_grouped_by_kind_in_config_order(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plugins"]) == 0
    headings = [
        line.split()[0]
        for line in capsys.readouterr().out.splitlines()
        if line and not line.startswith(" ") and line.rstrip().endswith("plugin")
    ]
    assert headings == [
        "policy",
        "generation",
        "environment",
        "loss",
        "dataset",
        "agent",
        "cluster",
        "tool_parser",
    ]


def test_verbose_shows_targets_and_extras_with_whole_names():
    host, components = _components()
    console = Console(width=80, record=True, file=io.StringIO())
    plugins_table(host.plugins, verbose=True, console=console)
    out = console.export_text()
    for spec in components:
        assert _row(spec.name, spec.plugin).search(out)
    # Import paths may fold at 80 columns; compare without the line breaks and padding.
    joined = re.sub(r"\s+", "", out)
    for spec in components:
        assert spec.target_str.replace(" ", "") in joined
    assert "extras: engine" in out


def test_a_broken_plugin_shows_its_error(capsys):
    class Broken:
        @hookimpl
        def nrl_register_environments(self, register):
            raise RuntimeError("the registration hook blew up")

    host = PluginHost.discover(selection=[])
    host.add(Broken(), "broken")
    console = Console(width=80, record=True, file=io.StringIO())
    plugins_table(host.plugins, console=console)
    out = console.export_text()
    assert re.search(r"^broken\s+in-process\s+error: nrl_register_environments", out, re.M)
    assert "the registration hook blew up" in re.sub(r"\s+", " ", out)
