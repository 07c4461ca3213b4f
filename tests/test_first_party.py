"""nrl_core.first_party's table of which plugin provides a component, against what this
repository's plugins register (all installed in the development venv)."""

from __future__ import annotations

from typing import get_args

from nrl_core.first_party import PROVIDED_BY, install_hint
from nrl_core.plugins import PluginHost
from nrl_core.registry import ComponentKind

COMPONENT_KINDS = get_args(ComponentKind)


def test_the_table_is_what_the_repositorys_plugins_register():
    registry = PluginHost.discover().registry()
    registered = {
        (kind, name): registry.get(kind, name).distribution
        for kind in COMPONENT_KINDS
        for name in registry.names(kind)
        if registry.get(kind, name).distribution not in (None, "nrl-core")
    }
    ours = {k: v for k, v in registered.items() if v.startswith("nrl-")}
    assert ours == PROVIDED_BY


def test_the_hint_names_the_plugin_and_how_to_install_it():
    assert "nrl-math-env plugin: install it (uv pip install nrl-math-env)" in install_hint(
        "dataset", "arithmetic"
    )
    assert install_hint("dataset", "my_own") == ""
