"""nrl's pytest plugin (entry point ``pytest11``): fixtures for testing nrl and its plugins.

Installed with nrl-core, so a plugin author's tests get them without any conftest:

- ``ray_cluster``: one local Ray head for the whole test session (starting Ray takes seconds,
  and a process can hold only one), yielding ``(cluster, resources)``. It has 2 logical CPUs
  and :data:`FAKE_GPUS` logical GPUs with no hardware behind them: Ray schedules and narrows
  ``CUDA_VISIBLE_DEVICES`` for actors that ask for GPUs exactly as on a GPU node, so placement
  and device choice can be tested on CPU (``gpu_sim`` tests); torch in those actors still sees
  no CUDA. Workers that ask for no GPU are unaffected.
- ``tiny_model_path``: the locally built tiny model + tokenizer folder (no hub needed).
- ``nrl_context``: a :class:`~nrl_core.interfaces.ComponentContext` around the default GRPO
  config (seed 0) for building components by hand.
- ``nrl_registry``: the registry of every installed plugin, failing when a plugin is broken.
- ``plugin_host``: a discovered :class:`~nrl_core.plugins.PluginHost` for the test; plugins
  added with ``plugin_host.add(obj, name)`` are removed afterwards.

The conformance suites (:mod:`nrl_core.testing.conformance`) get pytest's assertion rewriting.

Test tiers (docs/testing.md): a test is in the slow tier when it carries the ``slow`` marker.
This plugin registers the marker, and marks ``slow`` by rule every test that uses a fixture
which starts Ray or a run (``ray_cluster``, plus the ini option ``nrl_slow_fixtures``), so a
new test lands in the right tier without anyone remembering. At the end of a run it lists the
tests outside the slow tier that took longer than ``nrl_quick_limit_s`` seconds.
``--nrl-record=FILE`` writes the node ids of the tests a run ran (``.ci/tiers.py`` checks
with them that the tiers drop none).

Under pytest-xdist, each worker's torch gets its share of the cores (:func:`worker_threads`).

This module is imported by pytest at start-up in every environment that has nrl-core, so it
imports nothing heavy at module level.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

# Ray's settings as nrl makes them (its `uv run` hook off, no auto-connect), before any test
# module imports Ray, which reads them then: a test that starts actors itself (`ray.remote`)
# must start them as a run does. Otherwise, under `uv run --no-sync pytest`, Ray launched
# those workers through `uv run` in a copy of the working folder, without Ray in their venv.
import nrl_core.distributed  # noqa: F401  (cheap: sets two environment variables)

# Before any test module imports it, so its asserts show the compared values.
pytest.register_assert_rewrite("nrl_core.testing.conformance")


SLOW_FIXTURES = ("ray_cluster",)
"""Fixtures whose tests are in the slow tier (marked ``slow`` at collection): they start a Ray
head. A project adds its own with the ini option ``nrl_slow_fixtures`` (one name a line)."""

QUICK_LIMIT_S = 20.0
"""Default of the ini option ``nrl_quick_limit_s``: a test outside the slow tier whose call
took longer (seconds, > 0) is listed at the end of the run as one to mark ``slow``."""

_LIMIT_S = [QUICK_LIMIT_S]  # this run's nrl_quick_limit_s
_TOO_SLOW: list[tuple[str, float]] = []  # (node id, seconds) of quick tests over the limit
_RAN: list[str] = []  # node ids of the tests run, for --nrl-record
_THREADS: list[int | None] = [None]  # this xdist worker's torch threads (worker_threads)


def pytest_addoption(parser):
    parser.addoption(
        "--nrl-record",
        metavar="FILE",
        help="write the node ids of the tests this run ran (skipped included) to FILE, one a "
        "line (.ci/run checks with them that its tiers drop no test)",
    )
    parser.addini(
        "nrl_slow_fixtures",
        type="linelist",
        default=[],
        help="fixtures whose tests are marked slow (besides nrl's own: ray_cluster)",
    )
    parser.addini(
        "nrl_quick_limit_s",
        default=str(QUICK_LIMIT_S),
        help="seconds (> 0): tests not marked slow that take longer are listed at the end",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: the slow tier: starts Ray, an engine or a run (docs/testing.md)"
    )
    value = config.getini("nrl_quick_limit_s")
    try:
        _LIMIT_S[0] = float(value)
    except ValueError:
        _LIMIT_S[0] = -1.0
    if not _LIMIT_S[0] > 0:
        raise pytest.UsageError(f"nrl_quick_limit_s = {value!r}: give seconds > 0, e.g. 20")
    _THREADS[0] = worker_threads()


def worker_threads() -> int | None:
    """The torch threads of this pytest-xdist worker: cores // workers, at least 1; ``None``
    outside xdist's workers or when the user set ``OMP_NUM_THREADS`` (theirs wins)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set by xdist in its workers only
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, int(workers)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test, give this xdist worker's torch its share of the cores
    (:func:`worker_threads`), once torch is loaded (at collection, or by an earlier test).

    Why: torch's OpenMP threads spin after each parallel region, waiting for the next. With
    two workers each computing on 2 threads on 2 cores, the spinning takes the core the other
    worker computes on, and the tests' tiny models gain nothing from a second thread. Two
    processes training a tiny MLP at once (8 x Linear(64, 64), 3000 steps) on 2 cores: 7.4 s
    each with 2 threads, 0.9 s with 1 (docs/testing.md). Only this process: the runs a test
    starts (``nrl run``, actors, spawned ranks) get their threads from nrl's own plan, which
    follows the machine's load."""
    torch = sys.modules.get("torch")
    threads = _THREADS[0]
    if torch is not None and threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` the tests using a slow fixture, before ``-m`` selects (tryfirst)."""
    slow = set(SLOW_FIXTURES) | set(config.getini("nrl_slow_fixtures"))
    for item in items:
        if item.get_closest_marker("slow") is None and slow & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report):
    if report.when == "setup":
        _RAN.append(report.nodeid)
    # On the xdist controller too: reports carry the test's marker names in `keywords`.
    if report.when == "call" and report.duration > _LIMIT_S[0] and "slow" not in report.keywords:
        _TOO_SLOW.append((report.nodeid, report.duration))


def pytest_sessionfinish(session):
    record = session.config.getoption("nrl_record")
    # The xdist controller sees every worker's reports; a worker writes nothing.
    if record and not hasattr(session.config, "workerinput"):
        with open(record, "w") as f:
            f.writelines(f"{nodeid}\n" for nodeid in _RAN)


def pytest_terminal_summary(terminalreporter):
    if not _TOO_SLOW:
        return
    too_slow = sorted(_TOO_SLOW, key=lambda x: -x[1])
    _TOO_SLOW.clear()
    terminalreporter.section("nrl: quick-tier tests over the limit")
    terminalreporter.write_line(
        f"{len(too_slow)} test(s) not marked slow took over {_LIMIT_S[0]:g} s "
        "(nrl_quick_limit_s): mark them `slow` (docs/testing.md) if they start Ray, an engine "
        "or a run"
    )
    for nodeid, seconds in too_slow:
        terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


FAKE_GPUS = 4
"""Logical GPUs of the test session's Ray head (see ``ray_cluster``)."""


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray head with 2 logical CPUs and :data:`FAKE_GPUS` logical GPUs, shared by every
    test of the session."""
    yield from local_ray_head(tmp_path_factory)


def local_ray_head(tmp_path_factory):
    """The body of :func:`ray_cluster`, for a plugin's conftest that wants the same head at
    another scope: yields ``(cluster, resources)``, shuts it down after."""
    from nrl_core.config.schema import ClusterConfig, RunConfig
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.interfaces import ComponentContext

    config = RunConfig(cluster=ClusterConfig(num_cpus=2, gpus_per_node=FAKE_GPUS))
    cluster = LocalCluster(
        None,
        ComponentContext(config=config),
        log_dir=tmp_path_factory.mktemp("ray-run"),
        temp_dir=f"/tmp/nrl-t-{uuid.uuid4().hex[:6]}",
    )
    resources = cluster.start()
    yield cluster, resources
    cluster.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A freshly built tiny Llama model and tokenizer, loadable with ``from_pretrained``."""
    from nrl_core.testing.tiny import tiny_model_path as build

    return build(tmp_path_factory.mktemp("nrl-tiny"))


@pytest.fixture
def nrl_context():
    """A ``ComponentContext`` around the default GRPO config, seed 0, rank 0 of 1."""
    from nrl_core.config.schema import GRPOConfig
    from nrl_core.interfaces import ComponentContext

    return ComponentContext(config=GRPOConfig(seed=0), seed=0)


@pytest.fixture
def plugin_host():
    """A ``PluginHost`` with the built-ins and every installed plugin; what the test ``add``s
    is removed when it ends."""
    from nrl_core.plugins import PluginHost

    host = PluginHost.discover()
    before = {info.name for info in host.plugins}
    yield host
    for info in host.plugins:
        if info.name not in before:
            host.remove(info.name)


@pytest.fixture(scope="session")
def nrl_registry():
    """The registry of every installed plugin; fails the test when a plugin did not load."""
    from nrl_core.plugins import PluginHost

    host = PluginHost.discover()
    broken = {info.name: info.error for info in host.broken()}
    if broken:
        pytest.fail(f"plugins failed to load: {broken}")
    return host.registry()
