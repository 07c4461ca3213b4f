"""Fixtures of the dtensor plugin tests: the tiny model and a 2-rank gloo world."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# --import-mode=importlib keeps test folders off sys.path; `_helpers` must be importable here
# and in the Ray actors (through PYTHONPATH, below).
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A freshly built tiny Llama model + tokenizer folder (built once per session)."""
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(tmp_path_factory.mktemp("nrl-cache"))


@pytest.fixture
def start_group(ray_cluster):
    """``start_group(target, args)`` -> a 2-rank worker group of the core (real Ray actors,
    torch.distributed over gloo), shut down after the test."""
    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.policy import policy_layout

    # The pytest process itself is the single-process reference: no torch.distributed here.
    assert "WORLD_SIZE" not in os.environ
    groups = []

    def start(target: str, args: tuple, name: str = "policy"):
        group = WorkerGroup.start(
            target,
            2,
            args=args,
            name=name,
            layout=policy_layout(args[0]),  # tensor-parallel peers share a shard, as in a run
            num_cpus_per_worker=0.25,  # tests hold up to 3 groups at once on 2 CPUs
            timeout_s=300,
            env_vars={
                "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
            },
        )
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.shutdown()
