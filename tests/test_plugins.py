"""Plugin discovery and loading rules (nrl_core.plugins)."""

from __future__ import annotations

import pytest

from nrl_core import hookimpl
from nrl_core.errors import PluginError, UnknownComponentError
from nrl_core.plugins import CORE_PLUGIN, PluginHost, parse_selection

WORKSPACE_PLUGINS = {"dtensor", "megatron", "vllm", "sglang", "math"}

GOOD_PLUGIN = """
from nrl_core import hookimpl

@hookimpl
def nrl_register_environments(register):
    register("{name}", "{module}:Env", description="a test environment")
"""


class EchoEnvironment:
    """Stand-in target object; registration never imports or calls it."""


class InTestPlugin:
    """A plugin object registered for one test and removed after it."""

    @hookimpl
    def nrl_register_environments(self, register):
        register("echo", EchoEnvironment, description="echoes")

    @hookimpl
    def nrl_register_losses(self, register):
        register("zero", "tests.nowhere:ZeroLoss")


def test_plugin_object_registered_for_one_test_and_removed():
    host = PluginHost.discover(selection=[])
    info = host.add(InTestPlugin(), "in-test")
    assert info.status == "ok"
    registry = host.registry()
    assert registry.get("environment", "echo").load() is EchoEnvironment
    assert registry.get("loss", "zero").target == "tests.nowhere:ZeroLoss"
    assert registry.get("environment", "echo").plugin == "in-test"

    host.remove("in-test")
    assert ("environment", "echo") not in host.registry()
    assert [p.name for p in host.plugins] == [CORE_PLUGIN]


def test_workspace_plugins_are_discovered_through_their_entry_points():
    host = PluginHost.discover()
    by_name = {p.name: p for p in host.plugins}
    assert WORKSPACE_PLUGINS | {CORE_PLUGIN} <= set(by_name)
    for name in WORKSPACE_PLUGINS:
        assert by_name[name].status == "ok", by_name[name].error
        assert by_name[name].distribution.startswith("nrl-")
    registry = host.registry()
    assert registry.get("generation", "vllm").extras == ("engine",)
    assert registry.get("policy", "dtensor").distribution == "nrl-dtensor"


def test_discovery_does_not_import_engines():
    import subprocess
    import sys

    code = (
        "import sys; from nrl_core.plugins import PluginHost; PluginHost.discover().registry();"
        "heavy = [m for m in ('torch', 'ray', 'transformers', 'vllm', 'sglang', 'megatron')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_broken_plugin_is_reported_and_others_still_load(installed_plugin):
    installed_plugin("nrl-broken", "broken", "nrl_broken_plugin", "import nonexistent_module_xyz\n")
    installed_plugin(
        "nrl-fine",
        "fine",
        "nrl_fine_plugin",
        GOOD_PLUGIN.format(name="fine_env", module="nrl_fine_plugin"),
    )
    host = PluginHost.discover()
    by_name = {p.name: p for p in host.plugins}
    assert by_name["broken"].status == "error"
    assert "nonexistent_module_xyz" in by_name["broken"].error
    assert by_name["broken"].distribution == "nrl-broken"
    assert by_name["fine"].status == "ok"
    assert host.registry().get("environment", "fine_env").plugin == "fine"
    assert all(by_name[name].status == "ok" for name in WORKSPACE_PLUGINS)


def test_plugin_whose_hook_raises_is_an_error_without_partial_registrations(installed_plugin):
    installed_plugin(
        "nrl-raiser",
        "raiser",
        "nrl_raiser_plugin",
        """
        from nrl_core import hookimpl

        @hookimpl
        def nrl_register_environments(register):
            register("half", "nrl_raiser_plugin:Half")
            raise RuntimeError("config file missing")
    """,
    )
    host = PluginHost.discover()
    info = next(p for p in host.plugins if p.name == "raiser")
    assert info.status == "error"
    assert "RuntimeError: config file missing" in info.error
    assert ("environment", "half") not in host.registry()


def test_misspelled_hook_implementation_fails_loudly():
    class Misspelled:
        @hookimpl
        def nrl_register_polices(self, register):  # sic
            register("p", "x:y")

    host = PluginHost.discover(selection=[])
    info = host.add(Misspelled(), "typo")
    assert info.status == "error"
    assert "nrl_register_polices" in info.error
    assert "matches no nrl hook" in info.error
    host.pm.check_pending()  # nothing left behind that pluggy would complain about


def test_invalid_registration_is_a_plugin_error():
    class BadName:
        @hookimpl
        def nrl_register_losses(self, register):
            register("Has Spaces", "x:y")

    host = PluginHost.discover(selection=[])
    info = host.add(BadName(), "bad")
    assert info.status == "error"
    assert "'Has Spaces' is invalid" in info.error


def test_duplicate_component_names_are_an_error_naming_both_distributions(installed_plugin):
    for dist, entry, module in [
        ("nrl-one", "one", "nrl_one_plugin"),
        ("nrl-two", "two", "nrl_two_plugin"),
    ]:
        installed_plugin(dist, entry, module, GOOD_PLUGIN.format(name="shared", module=module))
    host = PluginHost.discover()
    with pytest.raises(PluginError) as excinfo:
        host.registry()
    message = str(excinfo.value)
    assert "environment 'shared'" in message
    assert "nrl-one" in message and "nrl-two" in message
    assert "--plugin" in message
    # Choosing one of them resolves the conflict.
    chosen = PluginHost.discover(selection=["one"]).registry()
    assert chosen.get("environment", "shared").distribution == "nrl-one"


def test_same_distribution_seen_twice_is_loaded_once(installed_plugin, tmp_path, monkeypatch):
    import shutil

    info = installed_plugin(
        "nrl-twice",
        "twice",
        "nrl_twice_plugin",
        GOOD_PLUGIN.format(name="twice_env", module="nrl_twice_plugin"),
    )
    # The same distribution visible from a second sys.path entry (editable + regular install).
    other = tmp_path / "other_site"
    other.mkdir()
    shutil.copytree(info, other / info.name)
    monkeypatch.syspath_prepend(str(other))
    host = PluginHost.discover()
    assert [p.name for p in host.plugins].count("twice") == 1
    assert host.registry().get("environment", "twice_env").distribution == "nrl-twice"


def test_selection_restricts_loading():
    host = PluginHost.discover(selection=["math", "dtensor"])
    assert {p.name for p in host.plugins} == {CORE_PLUGIN, "math", "dtensor"}
    with pytest.raises(UnknownComponentError, match="registered: dtensor"):
        host.registry().get("policy", "megatron")


def test_empty_selection_loads_only_builtins():
    host = PluginHost.discover(selection=parse_selection([], {"NRL_PLUGINS": ""}))
    assert [p.name for p in host.plugins] == [CORE_PLUGIN]


def test_unknown_selected_plugin_is_a_clear_error():
    with pytest.raises(PluginError, match=r"unknown plugin 'nope'.*installed plugins: .*dtensor"):
        PluginHost.discover(selection=["nope"])


@pytest.mark.parametrize(
    ("cli", "env", "expected"),
    [
        ([], {}, None),
        ([], {"NRL_PLUGINS": ""}, frozenset()),
        ([], {"NRL_PLUGINS": "math, vllm"}, frozenset({"math", "vllm"})),
        (
            ["math", "vllm,dtensor"],
            {"NRL_PLUGINS": "sglang"},
            frozenset({"math", "vllm", "dtensor"}),
        ),
    ],
)
def test_parse_selection(cli, env, expected):
    assert parse_selection(cli, env) == expected


def test_unknown_component_error_lists_registered_names_and_a_close_match():
    registry = PluginHost.discover().registry()
    with pytest.raises(UnknownComponentError) as excinfo:
        registry.get("generation", "vlm", key="generation.backend")
    message = str(excinfo.value)
    assert "generation.backend=vlm" in message
    assert "sglang" in message and "torch" in message
    assert "did you mean 'vllm'" in message
