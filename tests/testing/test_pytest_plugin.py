"""The fixtures nrl's pytest plugin gives every test (including plugin authors')."""

from __future__ import annotations

import os

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


def _pytest_in(folder, *args: str, env=None):
    """pytest on ``folder`` in a subprocess (its own ini file: not this repository's)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


TIERED = """
import time

import pytest


@pytest.fixture
def starts_a_run():
    return None


def test_on_ray(ray_cluster):
    pass


def test_with_a_slow_fixture(starts_a_run):
    pass


@pytest.mark.slow
def test_marked():
    pass


def test_quick():
    pass


def test_quick_but_long():
    time.sleep(0.5)
"""


def test_tests_using_slow_fixtures_are_in_the_slow_tier(tmp_path):
    """``ray_cluster`` and the fixtures named by ``nrl_slow_fixtures`` put their tests in the
    slow tier by rule (collection only: no Ray is started)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nnrl_slow_fixtures = starts_a_run\n")
    (tmp_path / "test_tiered.py").write_text(TIERED)
    tiers = {}
    for expression in ("slow", "not slow"):
        done = _pytest_in(tmp_path, "--collect-only", "-q", "--strict-markers", "-m", expression)
        assert done.returncode == 0, done.stdout + done.stderr
        tiers[expression] = sorted(
            line.split("::")[1] for line in done.stdout.splitlines() if "::" in line
        )
    assert tiers == {
        "slow": ["test_marked", "test_on_ray", "test_with_a_slow_fixture"],
        "not slow": ["test_quick", "test_quick_but_long"],
    }


def test_record_and_quick_limit(tmp_path):
    """``--nrl-record`` lists the tests run (deselected ones not); a quick test over
    ``nrl_quick_limit_s`` is named at the end; a limit that is no positive number is refused."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nnrl_slow_fixtures = starts_a_run\nnrl_quick_limit_s = 0.3\n"
    )
    (tmp_path / "test_tiered.py").write_text(TIERED)
    record = tmp_path / "ran.txt"
    done = _pytest_in(tmp_path, "-m", "not slow", f"--nrl-record={record}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert record.read_text().split() == [
        "test_tiered.py::test_quick",
        "test_tiered.py::test_quick_but_long",
    ]
    summary = done.stdout.split("nrl: quick-tier tests over the limit", 1)[1]
    assert "1 test(s) not marked slow took over 0.3 s" in summary
    assert "test_tiered.py::test_quick_but_long" in summary
    assert "test_tiered.py::test_quick\n" not in summary

    (tmp_path / "pytest.ini").write_text("[pytest]\nnrl_quick_limit_s = soon\n")
    done = _pytest_in(tmp_path, "-m", "not slow")
    assert done.returncode == 4  # pytest's usage error
    assert "nrl_quick_limit_s = 'soon': give seconds > 0" in done.stderr


THREADS = """
import os

import torch


def test_threads():
    assert torch.get_num_threads() == {expected}
    # The runs a test starts keep nrl's own thread plan: nothing is set for them.
    assert "OMP_NUM_THREADS" not in os.environ
"""


def test_xdist_workers_share_the_cores(tmp_path):
    """Under ``-n 2`` each worker's torch gets cores // 2 threads (at least 1), torch loaded
    by a conftest before any test: two workers on 2 threads each spend the cores spinning
    (:func:`nrl_core.testing.pytest_plugin.pytest_runtest_setup`)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    (tmp_path / "conftest.py").write_text("import torch  # loaded before the first test\n")
    (tmp_path / "test_threads.py").write_text(THREADS.format(expected=expected))
    done = _pytest_in(tmp_path, "-n", "2", "-q", env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_thread_count_the_user_set_wins(monkeypatch):
    """And more workers than cores get 1 thread each."""
    from nrl_core.testing.pytest_plugin import worker_threads

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "64")
    assert worker_threads() == 1
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")  # not an xdist worker
    assert worker_threads() is None
