"""nrl's pytest plugin (entry point ``pytest11``): fixtures for testing nrl and its plugins.

Installed with nrl-core, so a plugin author's tests get them without any conftest:

- ``ray_cluster``: one local Ray head for the whole test session (starting Ray takes seconds,
  and a process can hold only one), yielding ``(cluster, resources)``.
- ``tiny_model_path``: the locally built tiny model + tokenizer folder (no hub needed).

This module is imported by pytest at start-up in every environment that has nrl-core, so it
imports nothing heavy at module level.
"""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray head with 2 logical CPUs, shared by every test of the session."""
    from nrl_core.config.schema import ClusterConfig, RunConfig
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.interfaces import ComponentContext

    config = RunConfig(cluster=ClusterConfig(num_cpus=2))
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
