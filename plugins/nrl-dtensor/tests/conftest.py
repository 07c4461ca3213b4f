"""Fixtures of the dtensor plugin tests: the tiny model and a 2-rank gloo world."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# --import-mode=importlib keeps test folders off sys.path; the helpers must also be importable
# by the spawned ranks (which inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from _group import SpawnPool

# The 2-rank tests run through SpawnPool (torch.multiprocessing spawn + a free port). To run them
# through the core's Ray worker groups instead, make `start_group` return
# `WorkerGroup.start(target=..., num_workers=..., args=..., name=...)` — nothing else changes.


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A freshly built tiny Llama model + tokenizer folder (built once per session)."""
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(tmp_path_factory.mktemp("nrl-cache"))


@pytest.fixture(scope="session")
def pool():
    """Two spawned ranks forming a gloo world, reused by every 2-rank test."""
    # The pytest process itself is the single-process reference: no torch.distributed here.
    assert "WORLD_SIZE" not in os.environ
    spawned = SpawnPool(2)
    yield spawned
    spawned.close()


@pytest.fixture
def start_group(pool):
    """``start_group(target, args)`` -> a group with run_all/run_sharded/shutdown."""
    groups = []

    def start(target: str, args: tuple, name: str = "policy"):
        group = pool.start(target=target, num_workers=2, args=args, name=name)
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.shutdown()
