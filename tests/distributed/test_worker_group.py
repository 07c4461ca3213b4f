"""WorkerGroup on a real local Ray session: torch.distributed over gloo, sharding, failures."""

from __future__ import annotations

import time

import pytest

from nrl_core.distributed.cluster import ResourceNeed, check_resources
from nrl_core.distributed.errors import (
    InsufficientResourcesError,
    WorkerError,
    WorkerTimeoutError,
)
from nrl_core.errors import NrlError
from nrl_core.interfaces import ClusterResources, ComponentContext

pytestmark = pytest.mark.timeout(180)


def test_allreduce_over_gloo_and_rank_env(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import WorkerGroup

    context = ComponentContext(config=None, seed=3)
    group = WorkerGroup.start(
        "nrl_test_workers:AllReduceWorker",
        2,
        args=(None, context),
        name="policy",
        env_vars=worker_env,
        num_cpus_per_worker=0.5,
        timeout_s=120,
    )
    try:
        # (10 + 0) + (10 + 1) on every rank.
        assert group.run_all("all_reduce", 10) == [21.0, 21.0]
        envs = group.run_all("env")
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]  # one node
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert [e["context_rank"] for e in envs] == [0, 1]  # the context carries the rank
        assert group.run_one(1, "env")["RANK"] == "1"
    finally:
        group.shutdown()


def test_rebuild_builds_the_next_workers_in_the_same_processes(ray_cluster, worker_env):
    """WorkerGroup.rebuild closes the workers (their gloo group too: the next one joins a new
    one) and builds the new target in the same actors, with the layout it is given."""
    from nrl_core.distributed.worker_group import ParallelLayout, WorkerGroup

    args = (None, ComponentContext(config=None, seed=3))
    group = WorkerGroup.start(
        "nrl_test_workers:AllReduceWorker",
        2,
        args=args,
        name="policy",
        env_vars=worker_env,
        num_cpus_per_worker=0.5,
        timeout_s=120,
    )
    try:
        pids = [info.pid for info in group.infos]
        assert group.run_all("all_reduce", 10) == [21.0, 21.0]
        group.rebuild("nrl_test_workers:EchoWorker", ("new",), layout=ParallelLayout(tp=2))
        assert [info.pid for info in group.infos] == pids
        assert group.dp_size == 1  # the new layout: both ranks share one shard
        assert group.run_sharded("echo", ["x"]) == [{"rank": 0, "item": "x", "scale": 1}]
        # init_process_group again in each actor: the old default group was destroyed.
        group.rebuild("nrl_test_workers:AllReduceWorker", args)
        assert group.dp_size == 2
        assert group.run_all("all_reduce", 1) == [3.0, 3.0]
        assert [info.pid for info in group.infos] == pids
    finally:
        group.shutdown()


def test_the_local_heads_workers_run_at_the_drivers_priority(ray_cluster):
    """Ray starts workers at niceness 15: beside any busy process of normal priority a local
    run's actors got a few percent of a core (``RAYLET_ENV``)."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    class Probe:  # an actor, as nrl starts (a task would leave an idle worker behind)
        def niceness(self) -> int:
            return os.nice(0)

    probe = Probe.remote()
    try:
        assert ray.get(probe.niceness.remote(), timeout=120) == os.nice(0)
    finally:
        ray.kill(probe)


def test_the_local_head_prestarts_no_idle_python_workers(ray_cluster):
    """nrl starts actors only, each with its own runtime environment: the raylet's idle
    default workers (one per CPU, titled ``ray::IDLE``) would never run anything
    (``RAYLET_ENV``)."""
    from pathlib import Path

    import ray

    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid

    def idle_children() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except (OSError, ValueError):
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == raylet and title == b"ray::IDLE":
                found.append(int(entry.name))
        return found

    deadline = time.monotonic() + 8  # the raylet prestarts within seconds of its start
    while time.monotonic() < deadline:
        assert idle_children() == []
        time.sleep(2)


def test_an_environment_group_without_rendezvous_never_imports_torch(
    ray_cluster, worker_env, monkeypatch
):
    """Environments and agents form no torch.distributed group: started with
    ``rendezvous=False`` (as a run starts them), their actors host no store, get no
    ``MASTER_*`` variables and never import torch (1.2-1.8 CPU-s per actor per run)."""
    monkeypatch.syspath_prepend(worker_env["PYTHONPATH"])  # the function goes by reference
    from nrl_test_workers import loaded

    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.environments import ENV_ACTOR_TARGET

    def start(rendezvous: bool):
        return WorkerGroup.start(
            ENV_ACTOR_TARGET,
            1,
            args=("nrl_math_env.arithmetic:ArithmeticEnvironment", None, ComponentContext(None)),
            name="env-arithmetic",
            env_vars=worker_env,
            num_cpus_per_worker=0.25,
            timeout_s=120,
            rendezvous=rendezvous,
        )

    plain, rendezvoused = start(False), start(True)
    try:
        assert plain.run_all(loaded, "torch") == [{"torch": False, "MASTER_ADDR": None}]
        # The default still hosts the store (and so imports torch) for groups that need it.
        assert rendezvoused.run_all(loaded, "torch") == [
            {"torch": True, "MASTER_ADDR": "127.0.0.1"}
        ]
    finally:
        plain.shutdown()
        rendezvoused.shutdown()


@pytest.fixture(scope="module")
def tp2_group(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import ParallelLayout, WorkerGroup

    group = WorkerGroup.start(
        "nrl_test_workers:EchoWorker",
        4,
        name="echo",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        layout=ParallelLayout(tp=2),
        timeout_s=60,
    )
    yield group
    group.shutdown()


def test_run_sharded_with_tp2(tp2_group):
    assert tp2_group.num_workers == 4 and tp2_group.dp_size == 2
    results = tp2_group.run_sharded("echo", [["a"], ["b", "c"]], scale=3)
    assert results == [
        {"rank": 0, "item": ["a"], "scale": 3},
        {"rank": 2, "item": ["b", "c"], "scale": 3},
    ]
    # Every rank of a DP shard got that shard's item: rank 1 and 3 answer run_one too.
    assert tp2_group.run_one(3, "echo", "x")["rank"] == 3
    with pytest.raises(NrlError, match="dp_size=2"):
        tp2_group.run_sharded("echo", [1, 2, 3])


def test_run_sharded_with_pp2_returns_the_last_stages_results(ray_cluster, worker_env):
    """The last pipeline stage of each shard (where the logits are) answers for it: stages are
    blocks of consecutive ranks (pp slowest, as Megatron-Core orders them)."""
    from nrl_core.distributed.worker_group import ParallelLayout, WorkerGroup

    group = WorkerGroup.start(
        "nrl_test_workers:EchoWorker",
        4,
        name="echo-pp",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        layout=ParallelLayout(pp=2),
        timeout_s=60,
    )
    try:
        assert group.dp_size == 2
        assert group.run_sharded("echo", [["a"], ["b"]]) == [
            {"rank": 2, "item": ["a"], "scale": 1},
            {"rank": 3, "item": ["b"], "scale": 1},
        ]
    finally:
        group.shutdown()


def test_run_sharded_with_dp2(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import Sharded, WorkerGroup

    group = WorkerGroup.start(
        "nrl_test_workers:EchoWorker",
        2,
        name="dp",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=60,
    )
    try:
        big = ["x" * 1000] * 100  # put once in the object store, read by both ranks
        assert group.dp_size == 2
        assert group.run_sharded("sum_length", [big, big[:10]]) == [(0, 100_000), (1, 10_000)]
        # A Sharded argument is split like the data; a plain one goes to every rank.
        assert group.run_sharded("echo", ["a", "b"], scale=Sharded([1, 2])) == [
            {"rank": 0, "item": "a", "scale": 1},
            {"rank": 1, "item": "b", "scale": 2},
        ]
        with pytest.raises(NrlError, match="got 3 shards"):
            group.run_sharded("echo", ["a", "b"], scale=Sharded([1, 2, 3]))
    finally:
        group.shutdown()


def test_raising_worker_is_named(tp2_group):
    with pytest.raises(WorkerError) as info:
        tp2_group.run_all("fail", 2)
    err = info.value
    assert err.rank == 2 and err.group == "echo"
    assert "echo rank 2 failed in fail: ValueError: boom from rank 2" in str(err)
    assert err.node


def test_slow_worker_times_out(tp2_group):
    tp2_group.timeout_s = 2
    try:
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="did not finish sleep within 2s"):
            tp2_group.run_one(1, "sleep", 5)
        assert time.monotonic() - started < 4.5
    finally:
        tp2_group.timeout_s = 60
    time.sleep(3.5)  # let rank 1 finish its sleep before the next test reuses it


@pytest.mark.slow
def test_dying_worker_is_named_without_hanging(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import WorkerGroup

    group = WorkerGroup.start(
        "nrl_test_workers:EchoWorker",
        2,
        name="gen",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=30,
    )
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            group.run_all("die", 1)  # rank 0 sleeps 60 s: only rank 1's death ends the call
        assert time.monotonic() - started < 25
        assert info.value.rank == 1 and "gen rank 1" in str(info.value)
        assert "died" in str(info.value)
        assert "rank 1 is about to exit" in info.value.log_tail
    finally:
        group.shutdown(timeout_s=2)


def test_impossible_request_fails_before_any_actor(ray_cluster):
    import ray

    from nrl_core.distributed.worker_group import WorkerGroup

    before = len(ray.util.state.list_actors()) if hasattr(ray.util, "state") else None
    from nrl_core.testing.pytest_plugin import FAKE_GPUS

    with pytest.raises(
        InsufficientResourcesError,
        match=f"policy needs 8 GPUs; the cluster has {FAKE_GPUS} GPUs and 2 CPUs",
    ):
        WorkerGroup.start(
            "nrl_test_workers:EchoWorker", 8, name="policy", num_gpus_per_worker=1, timeout_s=10
        )
    if before is not None:
        assert len(ray.util.state.list_actors()) == before


def test_bad_target_is_a_worker_error(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import WorkerGroup

    with pytest.raises(WorkerError, match="cannot import worker class 'no_such_module:X'"):
        WorkerGroup.start(
            "no_such_module:X",
            1,
            name="env",
            env_vars=worker_env,
            num_cpus_per_worker=0.25,
            timeout_s=60,
        )


def test_check_resources_messages():
    two_cpus = ClusterResources(num_nodes=1, cpus_per_node=[2.0], gpus_per_node=[0.0])
    check_resources([ResourceNeed("policy", 4, 0.5)], two_cpus)
    with pytest.raises(
        InsufficientResourcesError, match="policy needs 3 CPUs; the cluster has 0 GPUs and 2 CPUs"
    ):
        check_resources([ResourceNeed("policy", 3, 1)], two_cpus)
    nodes = ClusterResources(num_nodes=2, cpus_per_node=[8, 8], gpus_per_node=[4, 4])
    with pytest.raises(InsufficientResourcesError, match="on a single node"):
        check_resources([ResourceNeed("policy", 1, 1, 6)], nodes)
    with pytest.raises(
        InsufficientResourcesError, match="policy \\+ generation together need 10 GPUs"
    ):
        check_resources(
            [ResourceNeed("policy", 6, 1, 1), ResourceNeed("generation", 4, 1, 1)], nodes
        )


@pytest.mark.gpu_sim
def test_actors_of_a_venv_run_as_if_it_were_activated(ray_cluster, worker_env, tmp_path):
    """An actor venv's executables come first on PATH (GPU kernels' JIT builds run `ninja`
    from PATH) and VIRTUAL_ENV names it; the rest of PATH is kept."""
    import os
    import site
    import subprocess
    import sys

    from nrl_core.distributed.worker_group import WorkerGroup

    venv = tmp_path / "actor-venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The actor imports ray, torch and nrl from the dev environment, as a plugin venv would
    # have its own copies of them.
    (next(venv.glob("lib/python*/site-packages")) / "dev.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    tool = venv / "bin" / "ninja"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)

    group = WorkerGroup.start(
        "nrl_probe_workers:ProbeWorker",
        1,
        name="venv-env",
        python=str(venv / "bin" / "python"),
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=60,
    )
    try:
        env = group.run_one(0, "environ", ["VIRTUAL_ENV", "PATH"])
        assert env["VIRTUAL_ENV"] == str(venv)
        path = env["PATH"].split(os.pathsep)
        assert path[0] == str(venv / "bin")
        assert "${PATH}" not in env["PATH"] and len(path) > 1  # Ray expanded the old PATH
        assert group.run_one(0, "which", "ninja") == str(tool)
    finally:
        group.shutdown()
