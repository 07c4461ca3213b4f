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

This module is imported by pytest at start-up in every environment that has nrl-core, so it
imports nothing heavy at module level.
"""

from __future__ import annotations

import uuid

import pytest

# Ray's settings as nrl makes them (its `uv run` hook off, no auto-connect), before any test
# module imports Ray, which reads them then: a test that starts actors itself (`ray.remote`)
# must start them as a run does. Otherwise, under `uv run --no-sync pytest`, Ray launched
# those workers through `uv run` in a copy of the working folder, without Ray in their venv.
import nrl_core.distributed  # noqa: F401  (cheap: sets two environment variables)

# Before any test module imports it, so its asserts show the compared values.
pytest.register_assert_rewrite("nrl_core.testing.conformance")


FAKE_GPUS = 4
"""Logical GPUs of the test session's Ray head (see ``ray_cluster``)."""


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray head with 2 logical CPUs and :data:`FAKE_GPUS` logical GPUs, shared by every
    test of the session."""
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
