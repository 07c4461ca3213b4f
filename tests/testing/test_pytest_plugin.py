"""The fixtures nrl's pytest plugin gives every test (including plugin authors')."""

from __future__ import annotations

from nrl_core import hookimpl
from nrl_core.config.schema import GRPOConfig


class _TestPlugin:
    @hookimpl
    def nrl_register_environments(self, register):
        register("fixture_probe", "nrl_core.environments:ExactMatchEnvironment")


def test_nrl_context(nrl_context):
    assert isinstance(nrl_context.config, GRPOConfig)
    assert (nrl_context.seed, nrl_context.rank, nrl_context.world_size) == (0, 0, 1)


def test_nrl_registry_has_core_and_installed_plugins(nrl_registry):
    assert "clipped_pg" in nrl_registry.names("loss")
    assert "arithmetic" in nrl_registry.names("environment")  # nrl-math-env, via entry point


def test_plugin_host_adds_a_test_plugin(plugin_host):
    info = plugin_host.add(_TestPlugin(), "probe")
    assert info.status == "ok"
    spec = plugin_host.registry().get("environment", "fixture_probe")
    assert spec.plugin == "probe"


def test_plugin_host_is_fresh_for_each_test(plugin_host):
    # The previous test's plugin was removed (and this host is a new one anyway).
    assert plugin_host.registry().find("environment", "fixture_probe") is None
