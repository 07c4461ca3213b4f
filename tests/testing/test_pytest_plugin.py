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


def test_a_test_module_importing_ray_first_gets_nrl_s_ray_settings(tmp_path):
    """A plugin's test that imports Ray before anything of nrl's, then starts actors itself
    (``ray.remote``), must get Ray configured as a run configures it: with Ray's ``uv run``
    hook on, ``uv run --no-sync pytest plugins/nrl-math-env`` started those workers through
    ``uv run`` in a copy of the folder, where no Ray was installed (issue 53)."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_first.py").write_text(
        "import ray\n"
        "from ray._private import ray_constants\n\n"
        "def test_settings():\n"
        "    assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is False\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "RAY_ENABLE_AUTO_CONNECT")
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
