"""The cluster components against real Ray processes started by the tests themselves."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from .conftest import HERE, alive, descendants, processes_matching, stop_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_gone(pids, temp_dir: str, timeout_s: float = 30) -> tuple[list[int], list[int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left, named = alive(pids), processes_matching(temp_dir)
        if not left and not named:
            break
        time.sleep(0.5)
    return alive(pids), processes_matching(temp_dir)


def test_ray_backend_joins_and_leaves_a_running_head(tmp_path):
    temp_dir = f"/tmp/nrl-h-{uuid.uuid4().hex[:6]}"
    port = _free_port()
    subprocess.run(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--disable-usage-stats",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    head = processes_matching(temp_dir)
    try:
        assert head, "ray start left no process naming its temp dir"
        script = tmp_path / "driver.py"
        script.write_text(
            textwrap.dedent(f"""
            import json, os, sys, ray  # Ray first, as a user's script may
            from nrl_core.config.schema import ClusterConfig, RunConfig
            from nrl_core.distributed.cluster import RayCluster
            from nrl_core.interfaces import ComponentContext
            config = RunConfig(cluster=ClusterConfig(backend="ray", address="127.0.0.1:{port}"))
            cluster = RayCluster(None, ComponentContext(config=config))
            resources = cluster.start()
            task = ray.remote(lambda: (41 + 1, sys.executable, os.getcwd()))
            answer, python, cwd = ray.get(task.remote(), timeout=120)
            cluster.shutdown()
            print("RESULT", json.dumps([resources.total_cpus, resources.num_nodes, answer]))
            # The driver's interpreter and folder, not `uv run` in a copy of the folder (Ray's
            # hook, when pytest runs under `uv run`).
            print("WORKER", json.dumps([python == sys.executable, cwd == os.getcwd()]))
        """)
        )
        out = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=180,
            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        )
        result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
        assert result, out.stderr[-3000:]
        assert json.loads(result[0].split(" ", 1)[1]) == [1.0, 1, 42]
        worker = [ln for ln in out.stdout.splitlines() if ln.startswith("WORKER")]
        assert json.loads(worker[0].split(" ", 1)[1]) == [True, True], out.stderr[-3000:]
        # The driver left: the head it joined still runs.
        assert alive(head) == sorted(alive(head)) and set(alive(head)) == set(head)
    finally:
        everything = set(processes_matching(temp_dir))
        for pid in list(everything):
            everything |= descendants(pid)
        stop_processes(everything)
    assert _wait_gone(everything, temp_dir) == ([], [])


def test_ray_backend_without_address_is_a_clear_error(monkeypatch):
    from nrl_core.distributed.cluster import RayCluster
    from nrl_core.distributed.errors import ClusterError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ClusterError, match=r"needs cluster\.address or RAY_ADDRESS"):
        RayCluster().start()


def test_ctrl_c_leaves_no_ray_process_behind(tmp_path):
    temp_dir = f"/tmp/nrl-c-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from nrl_core.config.schema import ClusterConfig, RunConfig
        from nrl_core.distributed.cluster import LocalCluster
        from nrl_core.distributed.worker_group import WorkerGroup
        from nrl_core.interfaces import ComponentContext
        config = RunConfig(cluster=ClusterConfig(num_cpus=1))
        cluster = LocalCluster(None, ComponentContext(config=config), temp_dir={temp_dir!r},
                               log_dir={str(tmp_path / "run")!r})
        cluster.start()
        group = WorkerGroup.start("nrl_test_workers:EchoWorker", 1, name="echo",
                                  env_vars={{"PYTHONPATH": {str(HERE)!r}}},
                                  num_cpus_per_worker=0.5, timeout_s=120)
        print("READY", group.run_one(0, "echo", 1)["rank"], flush=True)
        time.sleep(300)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    started: set[int] = set()
    try:
        line = proc.stdout.readline()  # blocks until READY (or the script dies)
        assert line.startswith("READY 0"), line if line else proc.stderr.read()[-3000:]
        started = descendants(proc.pid) | set(processes_matching(temp_dir))
        assert len(started) >= 3  # at least gcs, raylet and the worker
        proc.send_signal(__import__("signal").SIGINT)
        proc.wait(timeout=90)
        assert _wait_gone(started, temp_dir) == ([], [])
        # Ray's temp folder went with it, and so did the run folder's link to it.
        assert not Path(temp_dir).exists() and not (tmp_path / "run" / "ray").is_symlink()
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_processes(set(alive(started)) | set(processes_matching(temp_dir)))
