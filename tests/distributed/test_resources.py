"""Threads per policy rank on a CPU-only cluster (issue 50): the cores the run has, shared by
the ranks that compute at once and the separate engines; and the in-process cluster giving a
rank the thread count its caller asked for, as Ray does through the actor's environment."""

from __future__ import annotations

import pytest

from nrl_core.algorithms.session.components import (
    engine_thread_env,
    engines_overlap_policy,
    policy_thread_env,
)
from nrl_core.distributed.inprocess import InProcessWorkerGroup
from nrl_core.distributed.resources import cpu_count, cpu_thread_plan, cpu_threads_per_rank
from nrl_core.interfaces import ClusterResources


@pytest.mark.parametrize(
    ("cpus", "ranks", "busy", "threads"),
    [
        (2, 1, 0.0, 2),  # one rank alone on two cores: both (it had 1, one core idle)
        (2, 2, 0.0, 1),
        (8, 2, 0.0, 4),
        (8, 3, 0.0, 2),  # floor: never more threads than cores
        (2, 1, 0.5, 1),  # a separate engine computes meanwhile
        (4, 1, 1.0, 3),
        (1, 4, 0.0, 1),  # at least one
        (2, 1, 4.0, 1),
    ],
)
def test_threads_per_rank_share_the_cores(cpus, ranks, busy, threads):
    assert cpu_threads_per_rank(cpus, ranks, busy) == threads


@pytest.mark.parametrize(
    ("cpus", "ranks", "load", "threads"),
    [
        (2, 1, 0.2, 2),  # an idle machine: the driver's own start-up is no reason to drop one
        (2, 1, 0.6, 1),  # other processes keep most of a core busy
        (2, 1, 10.0, 1),
        (8, 2, 3.0, 3),
        (8, 3, 0.0, 2),  # the load only ever lowers the count from the cores
    ],
)
def test_threads_per_rank_leave_the_cores_other_processes_keep_busy(cpus, ranks, load, threads):
    assert cpu_threads_per_rank(cpus, ranks, 0.0, load) == threads


@pytest.mark.parametrize(
    ("cpus", "ranks", "engines", "overlap", "load", "plan"),
    [
        # Synchronous: the engine generates while the ranks wait, so each side gets the cores.
        (2, 2, 1, False, 0.0, (1, 2)),
        (2, 1, 1, False, 0.0, (2, 2)),  # a lone rank: 2 (counting the engine gave it 1)
        (8, 2, 2, False, 0.0, (4, 4)),
        (2, 2, 1, False, 5.0, (1, 1)),  # a loaded machine: one thread each
        # Asynchronous: ranks and engines compute at once and share the cores evenly.
        (2, 2, 1, True, 0.0, (1, 1)),
        (16, 2, 1, True, 0.0, (5, 5)),
        (8, 2, 2, True, 0.0, (2, 2)),
        (16, 2, 2, True, 4.0, (3, 3)),  # the load lowers both (4 each on an idle machine)
        # No engines: the ranks' own rule.
        (2, 1, 0, False, 0.0, (2, 0)),
        (2, 1, 0, True, 0.0, (2, 0)),
    ],
)
def test_thread_plan_shares_the_cores_between_ranks_and_engines(
    cpus, ranks, engines, overlap, load, plan
):
    assert cpu_thread_plan(cpus, ranks, engines, overlap, load) == plan
    rank_threads, engine_threads = plan
    if overlap:  # computing at once, they never ask for more threads than free cores
        assert rank_threads * ranks + engine_threads * engines <= max(cpus - load, ranks + engines)


def test_engine_thread_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two_cpus = ClusterResources(num_nodes=1, cpus_per_node=[2.0], gpus_per_node=[0.0])
    assert engine_thread_env(two_cpus, 1, 2, False, 0.0) == {"OMP_NUM_THREADS": "2"}
    assert engine_thread_env(two_cpus, 1, 2, True, 0.0) == {"OMP_NUM_THREADS": "1"}
    assert engine_thread_env(two_cpus, 1, 2, False, 5.0) == {"OMP_NUM_THREADS": "1"}
    assert engine_thread_env(two_cpus, 0, 2, False, 0.0) == {}
    assert engine_thread_env(two_cpus, 1, 2, False)["OMP_NUM_THREADS"] in ("1", "2")
    gpus = ClusterResources(num_nodes=1, cpus_per_node=[2.0], gpus_per_node=[1.0])
    assert engine_thread_env(gpus, 1, 2, False, 0.0) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    assert engine_thread_env(two_cpus, 1, 2, False, 0.0) == {}


def test_engines_overlap_policy_only_in_async_grpo():
    from nrl_core.config.schema import GRPOConfig, RunConfig

    sync = GRPOConfig()
    assert not engines_overlap_policy(sync)
    sync.grpo.async_.enabled = True
    assert engines_overlap_policy(sync)
    assert not engines_overlap_policy(RunConfig())


def test_cpu_count_is_this_process_affinity():
    import os

    assert cpu_count() == len(os.sched_getaffinity(0))


def test_policy_thread_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two_cpus = ClusterResources(num_nodes=1, cpus_per_node=[2.0], gpus_per_node=[0.0])
    assert policy_thread_env(two_cpus, 1, 0.0, 0.0) == {"OMP_NUM_THREADS": "2"}
    assert policy_thread_env(two_cpus, 2, 0.0, 0.0) == {"OMP_NUM_THREADS": "1"}
    assert policy_thread_env(two_cpus, 1, 0.5, 0.0) == {"OMP_NUM_THREADS": "1"}
    assert policy_thread_env(two_cpus, 1, 0.0, 5.0) == {"OMP_NUM_THREADS": "1"}
    # By default the machine's load average counts (whatever it is now: 1 or 2 threads).
    assert policy_thread_env(two_cpus, 1, 0.0)["OMP_NUM_THREADS"] in ("1", "2")
    gpus = ClusterResources(num_nodes=1, cpus_per_node=[2.0], gpus_per_node=[1.0])
    assert policy_thread_env(gpus, 1, 0.0) == {}
    # The user's own setting wins: nothing is passed, every worker inherits theirs.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert policy_thread_env(two_cpus, 1, 0.0) == {}


class _Threads:
    def threads(self) -> int:
        import torch

        return torch.get_num_threads()


def test_in_process_rank_gets_the_threads_its_caller_asks_for(monkeypatch):
    """Ray gives an actor the OMP_NUM_THREADS of its environment; the in-process cluster did
    not (a lone policy rank ran on one thread of two cores)."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    outside = torch.get_num_threads()
    for env_vars, expected in ((None, 1), ({"OMP_NUM_THREADS": "2"}, 2)):
        group = InProcessWorkerGroup.start(
            _Threads, 1, name="threads-test", env_vars=env_vars, num_cpus_per_worker=1.0
        )
        try:
            assert group.run_one(0, "threads") == expected
        finally:
            group.shutdown()
        assert torch.get_num_threads() == outside  # the driver's count is restored
