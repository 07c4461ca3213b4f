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


@pytest.fixture(scope="module")
def warm_groups(ray_cluster):
    """The module's 2-rank groups, kept between its tests (``nrl_core.testing.groups``) and
    shut down after them: the session's Ray head (``ray_cluster``) serves other modules'
    tests too, which need its CPUs and memory."""
    from nrl_core.testing.groups import WarmGroups

    groups = WarmGroups()
    yield groups
    groups.close()


@pytest.fixture
def start_group(warm_groups):
    """``start_group(target, args)`` -> a 2-rank worker group of the core (real Ray actors,
    torch.distributed over gloo), its workers closed after the test. Its actors are those of
    an earlier test's group of the same name where one is kept (``WarmGroups``): starting
    two actors costs more CPU than most of these tests compute."""
    from nrl_core.policy import policy_layout

    # The pytest process itself is the single-process reference: no torch.distributed here.
    assert "WORLD_SIZE" not in os.environ

    def start(target: str, args: tuple, name: str = "policy"):
        return warm_groups.start(
            target,
            2,
            args=args,
            name=name,
            layout=policy_layout(args[0]),  # tensor-parallel peers share a shard, as in a run
            # Tests hold up to 3 groups at once, and up to 3 more are kept idle, on 2 CPUs.
            num_cpus_per_worker=0.1,
            timeout_s=300,
            env_vars={
                "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
            },
        )

    yield start
    warm_groups.release()
