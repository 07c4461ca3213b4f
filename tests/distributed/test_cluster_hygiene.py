"""What a run leaves on the machine: Ray's temp folder, listening sockets, processes.

Every test drives real Ray processes from a driver subprocess (a process holds one Ray head)
and inspects them from outside, through ``/proc``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from .conftest import HERE, alive, descendants, processes_matching, stop_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = HERE.parents[1]

_DRIVER = """
import json, sys, time
from nrl_core.config.schema import ClusterConfig, RunConfig
from nrl_core.distributed.cluster import LocalCluster
from nrl_core.distributed.worker_group import WorkerGroup
from nrl_core.interfaces import ComponentContext
config = RunConfig(cluster=ClusterConfig(num_cpus=2))
cluster = LocalCluster(None, ComponentContext(config=config), temp_dir={temp_dir!r},
                       log_dir={log_dir!r})
cluster.keep_temp_on_failure = {keep!r}
cluster.start()
group = WorkerGroup.start({target!r}, 2, name="hygiene", env_vars={{"PYTHONPATH": {here!r}}},
                          num_cpus_per_worker=0.5, timeout_s=120)
ready = {{"pids": [info.pid for info in group.infos],
          "env": group.run_all("env") if {target!r}.endswith("AllReduceWorker") else None,
          "sum": group.run_all("all_reduce", 1) if {target!r}.endswith("AllReduceWorker") else None}}
print("READY", json.dumps(ready), flush=True)
{then}
"""


def _driver(tmp_path: Path, *, target="nrl_test_workers:EchoWorker", keep=False, then="") -> tuple:
    temp_dir = f"/tmp/nrl-y-{uuid.uuid4().hex[:6]}"
    log_dir = tmp_path / "run"
    script = tmp_path / "driver.py"
    script.write_text(
        _DRIVER.format(
            temp_dir=temp_dir,
            log_dir=str(log_dir),
            keep=keep,
            target=target,
            here=str(HERE),
            then=textwrap.dedent(then),
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # blocks until READY (or the driver dies)
    if not line.startswith("READY"):
        proc.kill()
        pytest.fail(f"the driver did not start: {line}{proc.stderr.read()[-3000:]}")
    return proc, json.loads(line.split(" ", 1)[1]), temp_dir, log_dir / "ray"


def _wait_gone(pids, temp_dir: str, timeout_s: float) -> tuple[list[int], list[int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left, named = alive(pids), processes_matching(temp_dir)
        if not left and not named:
            break
        time.sleep(0.2)
    return alive(pids), processes_matching(temp_dir)


def _cleanup(proc, pids, temp_dir: str) -> None:
    if proc.poll() is None:
        proc.kill()
    stop_processes(set(alive(pids)) | set(processes_matching(temp_dir)))
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept-with-v-after-failure"])
def test_shutdown_removes_rays_temp_folder_and_the_run_link(tmp_path, keep):
    """A normal shutdown leaves no temp folder and no dangling ``<run dir>/ray`` link; a failed
    run with ``keep_temp_on_failure`` (``nrl run -v``) keeps both and says where, in one line."""
    then = f"""
    assert (cluster.log_dir / "ray").resolve() == cluster.temp_dir.resolve()
    cluster.failed = {keep!r}
    cluster.shutdown()
    print("DONE", flush=True)
    """
    proc, _, temp_dir, link = _driver(tmp_path, keep=keep, then=then)
    started = descendants(proc.pid)
    try:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "DONE" in out, err[-3000:]
        # The watcher process is gone too, with every Ray process.
        assert _wait_gone(started, temp_dir, 10) == ([], [])
        message = f"Ray's logs of this run are kept in {temp_dir}"
        if keep:
            assert Path(temp_dir, "session_latest", "logs").is_dir()
            assert link.resolve() == Path(temp_dir).resolve()
            assert [ln for ln in err.splitlines() if "kept in" in ln] == [message]
        else:
            assert not os.path.lexists(temp_dir), os.listdir(temp_dir)
            assert not os.path.lexists(link)
            assert "kept in" not in err
    finally:
        _cleanup(proc, started, temp_dir)


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept-with-v"])
def test_kill_9_of_the_driver_leaves_no_ray_process_within_seconds(tmp_path, keep):
    """Without nrl's watcher, Ray's dashboard and runtime-env agents outlive a SIGKILLed
    driver by 60 s (they try to report the raylet's death to the GCS that died with it), and
    the temp folder stays forever."""
    proc, _, temp_dir, link = _driver(tmp_path, keep=keep, then="time.sleep(600)")
    time.sleep(1.5)  # the watcher's list of Ray processes is refreshed every second
    started = descendants(proc.pid) | set(processes_matching(temp_dir))
    watcher = [pid for pid in started if "reaper.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    ray_processes = set(started) - set(watcher)
    try:
        assert len(ray_processes) >= 5, "expected gcs, raylet, agents and 2 workers"
        proc.kill()
        proc.wait(timeout=30)
        killed_at = time.monotonic()
        assert _wait_gone(started, temp_dir, 15) == ([], [])
        gone_after = time.monotonic() - killed_at
        assert gone_after < 15
        if keep:
            assert Path(temp_dir, "session_latest", "logs").is_dir()
        else:
            deadline = time.monotonic() + 10
            while os.path.lexists(temp_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not os.path.lexists(temp_dir)
            assert not os.path.lexists(link)
    finally:
        _cleanup(proc, started, temp_dir)


# -- shared memory -------------------------------------------------------------------------

_HOLD_SEGMENTS = """
import os
before = set(os.listdir("/dev/shm"))
rank0 = group.actors[0]
queues = [name for names in group.run_all("queue_and_lock") for name in names]
rank0.call.remote("attach", ({theirs!r},), {{}})
refit = rank0.call.remote("refit_forever", (), {{}})
deadline = time.monotonic() + 60
# Named for this run in the worker (Ray's processes inherit the driver's prefix): the clean-up
# finds a bucket that lived too briefly for the watcher to see it mapped. Only this run's
# count: tests on the other pytest worker make segments of their own meanwhile.
prefix = cluster.segment_prefix
while not (bucket := [n for n in set(os.listdir("/dev/shm")) - before if n.startswith(prefix)]):
    new = sorted(set(os.listdir("/dev/shm")) - before)
    assert time.monotonic() < deadline, f"no refit segment named {{prefix}}*; new: {{new}}"
    time.sleep(0.05)
print("BUSY", json.dumps({{"queues": queues, "bucket": bucket, "prefix": prefix}}), flush=True)
"""


def _segment(name: str | None = None, size: int = 4096):
    """A segment of this test process's (not the run's), left to the test to unlink."""
    from multiprocessing import shared_memory

    return shared_memory.SharedMemory(create=True, size=size, name=name)


@pytest.mark.parametrize("how", ["sigterm", "kill-9", "shutdown"])
def test_a_stopped_run_leaves_no_shared_memory_of_its_own(tmp_path, how):
    """Issue 55: a run stopped while a refit was in flight left its bucket segment in
    ``/dev/shm`` (Ray kills the policy rank before the ``finally`` that unlinks it), and every
    stopped vLLM engine its message queues (``psm_*``) and a lock (``sem.mp-*``). However the
    run ends (SIGTERM while
    the driver waits inside Ray, ``kill -9`` of the driver, a shutdown while a worker is still
    busy), the segments its processes made are unlinked; a segment that existed before, even
    one a worker mapped, and one made meanwhile by another program, stay."""
    theirs = _segment(f"nrl-test-{uuid.uuid4().hex[:8]}")  # existed before; a worker maps it
    late = None
    then = (
        _HOLD_SEGMENTS.format(theirs=theirs.name)
        + {
            "sigterm": "time.sleep(600)",  # (a signal inside ray.get: the CLI's exit code, below)
            "kill-9": "time.sleep(600)",
            "shutdown": "cluster.shutdown(); print('DONE', flush=True)",
        }[how]
    )
    proc, _, temp_dir, _ = _driver(
        tmp_path, target="nrl_test_workers:SegmentWorker", then="import ray\n" + then
    )
    started = descendants(proc.pid)
    try:
        line = proc.stdout.readline()
        assert line.startswith("BUSY"), line + proc.stderr.read()[-3000:]
        made = json.loads(line.split(" ", 1)[1])
        ours = [*made["queues"], *made["bucket"]]
        assert len(made["queues"]) == 4 and len(made["bucket"]) == 1, made
        assert all(os.path.exists(f"/dev/shm/{name}") for name in ours)
        late = _segment()  # another program's, made while the run runs: not the run's
        time.sleep(1.5)  # the watcher has looked at the run's processes at least once
        started |= descendants(proc.pid)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "kill-9":
            proc.kill()
        proc.wait(timeout=120)
        code = {"sigterm": 143, "kill-9": -9, "shutdown": 0}[how]
        assert proc.returncode == code, proc.stderr.read()[-3000:]
        assert _wait_gone(started, temp_dir, 30) == ([], [])
        deadline = time.monotonic() + 10
        while [n for n in ours if os.path.exists(f"/dev/shm/{n}")] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [n for n in ours if os.path.exists(f"/dev/shm/{n}")] == []
        assert os.path.exists(f"/dev/shm/{theirs.name}") and os.path.exists(f"/dev/shm/{late.name}")
    finally:
        _cleanup(proc, started, temp_dir)
        for shm in (theirs, late):
            if shm is not None:
                shm.close()
                shm.unlink()


# -- listening sockets ---------------------------------------------------------------------


def _address(hexaddr: str, v6: bool) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if v6:  # /proc/net/tcp6 holds four host-order 32-bit words
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listening_sockets(pids) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in LISTEN state that ``pids`` hold."""
    owner = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN
                found.append((owner[fields[9]], *_address(fields[1], v6)))
    return found


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


def _ray_worker_port(temp_dir: str, pid: int) -> int | None:
    """The port of the Ray core worker's own gRPC server in process ``pid`` (from its log)."""
    for log in Path(temp_dir, "session_latest", "logs").glob(f"python-core-worker-*_{pid}.log"):
        found = re.search(r"worker server started, listening on port (\d+)", log.read_text())
        if found:
            return int(found.group(1))
    return None


def test_a_single_node_group_listens_on_loopback_only(tmp_path):
    """Rank 0's rendezvous store (torch's own would listen on every interface, without
    authentication) and gloo's sockets listen on 127.0.0.1; what still listens on other
    addresses in the workers is Ray's own core-worker server, which Ray binds to every
    interface whatever ``ray.init`` is given."""
    proc, ready, temp_dir, _ = _driver(
        tmp_path, target="nrl_test_workers:AllReduceWorker", then="sys.stdin.readline()"
    )
    started = descendants(proc.pid)
    try:
        assert ready["sum"] == [3.0, 3.0]  # 1+0 + 1+1 over two ranks: the group works
        assert {e["MASTER_ADDR"] for e in ready["env"]} == {"127.0.0.1"}
        master_port = int(ready["env"][0]["MASTER_PORT"])
        sockets = listening_sockets(ready["pids"])
        store = [(addr, port) for _, addr, port in sockets if port == master_port]
        assert store == [("127.0.0.1", master_port)], sockets
        ray_ports = {pid: _ray_worker_port(temp_dir, pid) for pid in ready["pids"]}
        assert all(ray_ports.values()), ray_ports
        ours = [(pid, a, p) for pid, a, p in sockets if p != ray_ports[pid]]
        assert len(ours) >= 3, sockets  # the store and each rank's gloo listener
        assert [s for s in ours if not _is_loopback(s[1])] == [], sockets
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.communicate(timeout=120)
    finally:
        _cleanup(proc, started, temp_dir)


# -- Ctrl-C and SIGTERM through the CLI ----------------------------------------------------

TINY = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "grpo.sft_warmup_steps=0",
    "grpo.val_period=0",
    "grpo.max_num_steps=50",
    "checkpointing.enabled=false",
    "cluster.num_cpus=2",
]


@pytest.mark.parametrize(
    ("signum", "code", "verbose"),
    [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)],
    ids=["ctrl-c", "sigterm-with-v"],
)
def test_a_signal_stops_the_run_once_and_leaves_no_process(tmp_path, signum, code, verbose):
    """The signal stops Ray at once; the tear-down that follows makes no Ray call (each used to
    start a second local Ray instance, with a dashboard, for a few seconds). With ``-v`` the
    interrupted run keeps Ray's logs and says where."""
    # A private, short temp root: every Ray temp folder of this run appears in it.
    tmp_root = Path(tempfile.mkdtemp(prefix="nrl-s-", dir="/tmp"))
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-v" if verbose else "-q",
        f"logger.log_dir={tmp_path}", "logger.run_name=run", *TINY,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "NRL_ACTOR_ENV": "system", "TMPDIR": str(tmp_root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    gcs_servers: set[int] = set()
    seen: set[int] = set()

    def watch() -> None:
        for pid in descendants(proc.pid):
            seen.add(pid)
            if pid in gcs_servers:
                continue
            # Read again at every look: a process first seen between its fork and its exec
            # still shows its parent's command line.
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if b"gcs_server" in cmdline.read():
                        gcs_servers.add(pid)
            except OSError:  # gone meanwhile
                continue

    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().strip():
                break  # the workers run: the loop is in its first step
            watch()
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        temp_dirs = [p.name for p in tmp_root.iterdir() if p.name.startswith("nrl-ray-")]
        assert len(temp_dirs) == 1, temp_dirs
        before = descendants(proc.pid)
        proc.send_signal(signum)
        sent = time.monotonic()
        while proc.poll() is None and time.monotonic() - sent < 60:
            watch()
            time.sleep(0.1)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
        assert proc.returncode == code, err[-3000:]
        assert took < 30, took
        assert len(gcs_servers) == 1, "a second Ray instance was started"
        # Nothing of the run survives: not its processes, not a process naming its temp root.
        left = set(before) | seen
        deadline = time.monotonic() + 10
        while (alive(left) or processes_matching(str(tmp_root))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(left) == [] and processes_matching(str(tmp_root)) == []
        leftovers = sorted(p.name for p in tmp_root.iterdir() if "ray" in p.name)
        if verbose:
            assert leftovers == temp_dirs  # kept, and said where
            assert f"Ray's logs of this run are kept in {tmp_root / temp_dirs[0]}" in err
            assert (tmp_path / "run" / "ray").resolve() == (tmp_root / temp_dirs[0]).resolve()
        else:
            assert leftovers == []
            assert not os.path.lexists(tmp_path / "run" / "ray")
        print(f"exit {proc.returncode} {took:.1f}s after the signal")
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_processes(set(alive(seen)) | set(processes_matching(str(tmp_root))))
        shutil.rmtree(tmp_root, ignore_errors=True)


def test_sigterm_while_the_local_ray_head_starts_exits_143_with_one_line(tmp_path):
    """Issue 40: a SIGTERM while ``ray.init`` ran exited 15 with no message (Ray's own handler
    there calls ``sys.exit(15)``). Now: exit 143, one line saying what was stopped, and
    nothing left (no Ray process, no temp folder)."""
    tmp_root = Path(tempfile.mkdtemp(prefix="nrl-s-", dir="/tmp"))
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q",
        f"logger.log_dir={tmp_path}", "logger.run_name=run", *TINY,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "NRL_ACTOR_ENV": "system", "TMPDIR": str(tmp_root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[int] = set()
    try:
        # The GCS is Ray's first process: ray.init has begun and waits for the raylet.
        deadline = time.monotonic() + 300
        gcs = False
        while proc.poll() is None and time.monotonic() < deadline and not gcs:
            for pid in descendants(proc.pid):
                seen.add(pid)
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        gcs = gcs or b"gcs_server" in cmdline.read()
                except OSError:
                    continue
            time.sleep(0.05)
        assert gcs and proc.poll() is None, proc.stderr.read()[-3000:]
        metrics = tmp_path / "run" / "metrics.jsonl"
        assert not (metrics.is_file() and metrics.read_text().strip()), "training had begun"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "SIGTERM" in lines[0] and "Traceback" not in err, err[-3000:]
        deadline = time.monotonic() + 10
        while (alive(seen) or processes_matching(str(tmp_root))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(seen) == [] and processes_matching(str(tmp_root)) == []
        assert sorted(p.name for p in tmp_root.iterdir() if "ray" in p.name) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_processes(set(alive(seen)) | set(processes_matching(str(tmp_root))))
        shutil.rmtree(tmp_root, ignore_errors=True)


def test_a_run_that_fails_under_v_keeps_rays_logs_and_says_where(tmp_path):
    """An error after Ray started (here an environment whose constructor raises, from a
    third-party plugin) fails the run; with ``-v`` Ray's temp folder stays for the post-mortem,
    named in one line, and the Ray processes are gone all the same."""
    site = tmp_path / "site"
    (site / "nrl_broken_env-1.0.dist-info").mkdir(parents=True)
    (site / "nrl_broken_env-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nrl-broken-env\nVersion: 1.0\n"
    )
    (site / "nrl_broken_env-1.0.dist-info" / "entry_points.txt").write_text(
        "[nrl.plugins]\nbroken = nrl_broken_env\n"
    )
    (site / "nrl_broken_env.py").write_text(
        textwrap.dedent("""
        from nrl_core import hookimpl

        class BrokenEnvironment:
            def __init__(self, options=None, context=None):
                raise RuntimeError("this environment never starts")

        @hookimpl
        def nrl_register_environments(register):
            register("broken", "nrl_broken_env:BrokenEnvironment")
        """)
    )
    tmp_root = Path(tempfile.mkdtemp(prefix="nrl-f-", dir="/tmp"))
    env = {
        **os.environ,
        "NRL_ACTOR_ENV": "system",
        "TMPDIR": str(tmp_root),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-v", "env.name=broken",
        f"logger.log_dir={tmp_path}", "logger.run_name=run", *TINY,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 1, done.stderr[-3000:]
        assert "this environment never starts" in done.stderr
        kept = [p for p in tmp_root.iterdir() if p.name.startswith("nrl-ray-")]
        assert len(kept) == 1 and (kept[0] / "session_latest" / "logs").is_dir()
        assert f"Ray's logs of this run are kept in {kept[0]}" in done.stderr.splitlines()
        assert (tmp_path / "run" / "ray").resolve() == kept[0].resolve()
        deadline = time.monotonic() + 10
        while processes_matching(str(tmp_root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_matching(str(tmp_root)) == []
    finally:
        stop_processes(processes_matching(str(tmp_root)))
        shutil.rmtree(tmp_root, ignore_errors=True)


def test_sigterm_while_the_driver_waits_inside_ray_exits_143(tmp_path):
    """Ray runs the cluster's SIGTERM handler inside its own wait (``check_signals``) and
    turns the handler's ``SystemExit(143)`` into ``SystemExit(1)``: the CLI still exits 143
    (this exited 1 when a vLLM run was stopped while waiting on its engines)."""
    then = """
    import argparse
    from nrl_core import cli

    parser = argparse.ArgumentParser()
    parser.set_defaults(handler=lambda args: group.run_all("sleep", 120))
    cli.build_parser = lambda: parser  # a command whose whole run is one wait on the workers
    print("WAITING", flush=True)
    sys.exit(cli.main([]))
    """
    proc, ready, temp_dir, _ = _driver(tmp_path, then=then)
    started = descendants(proc.pid)
    try:
        assert proc.stdout.readline().strip() == "WAITING"
        time.sleep(3)  # the driver is in ray.wait now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err[-3000:]
        assert _wait_gone([*started, *ready["pids"]], temp_dir, 30) == ([], [])
    finally:
        _cleanup(proc, started, temp_dir)


_START_THEN_WAIT = """
import argparse, os, sys, time
import ray
from ray._private import node, services, worker
from nrl_core import cli
from nrl_core.config.schema import ClusterConfig, RunConfig
from nrl_core.distributed.cluster import LocalCluster
from nrl_core.interfaces import ComponentContext

# When each phase of the start began (time.monotonic, one clock for the whole machine): the
# test aims its Ctrl-C at each phase. Only a line written before the call: nothing changes.
PHASES = open(os.environ["NRL_TEST_PHASES"], "a", buffering=1)

def mark(phase):
    PHASES.write(f"{phase} {time.monotonic()}\\n")

def traced(owner, name, phase, after=None):
    original = getattr(owner, name)
    def call(*args, **kwargs):
        mark(phase)
        result = original(*args, **kwargs)
        if after:
            mark(after)
        return result
    setattr(owner, name, call)

traced(node.Node, "start_head_processes", "gcs")  # the GCS server, its client, the API server
traced(node.Node, "start_ray_processes", "raylet")  # the raylet and its agents
traced(services, "get_node", "wait")  # the raylet registering (its agents start meanwhile)
traced(worker, "connect", "connect")  # the driver's core worker (issue 47's SIGSEGV)
traced(ray, "init", "init", after="handlers")  # then nrl installs its own handlers

def run(args):
    config = RunConfig(cluster=ClusterConfig(num_cpus=2))
    cluster = LocalCluster(None, ComponentContext(config=config))
    cluster.start()
    try:
        mark("started")
        print("STARTED", flush=True)
        time.sleep(120)
    finally:
        cluster.shutdown()

parser = argparse.ArgumentParser()
parser.set_defaults(handler=run)
cli.build_parser = lambda: parser  # the CLI's own exit codes, with a run that only starts Ray
sys.exit(cli.main([]))
"""

_START_PHASES = ("temp", "init", "gcs", "raylet", "wait", "connect", "handlers", "started")
"""The phases of a local head's start, in order: ``temp`` from the temp folder's appearance
(nrl's set-up before ``ray.init``), then each one from the driver's mark (``init``: Ray's own
set-up before it starts the GCS)."""


def _phase_times(path: Path, temp_seen: float) -> dict[str, float]:
    """Each phase's first mark (a retried start marks again); ``temp`` when the test saw the
    folder, or at the first mark if the driver was quicker than the test's look."""
    times = {"temp": temp_seen}
    for line in path.read_text().splitlines() if path.exists() else []:
        phase, at = line.split()
        times.setdefault(phase, float(at))
    times["temp"] = min(times.values())
    return times


def _ctrl_c_during(script: Path, phases: Path, aim: str, delay: float) -> tuple:
    """Start a local head in a driver, send a Ctrl-C as a terminal does (to the whole process
    group) ``delay`` s after phase ``aim`` began; (exit code, nrl-ray files left, the last
    lines of stderr, the phase the Ctrl-C landed in, the phases' times)."""
    tmp_root = Path(tempfile.mkdtemp(prefix="nrl-c-", dir="/tmp"))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_root), "NRL_TEST_PHASES": str(phases)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    seen: set[int] = set()
    try:
        # Polled every 2 ms, and /proc scanned for the driver's processes only every 50 ms
        # (a scan takes tens of ms on a loaded machine): the core worker's connecting took
        # 36 ms here (nrl's set-up and Ray's ~30 ms each, the GCS 4 s, the registering 5 s);
        # a slower loop sent its Ctrl-C after that phase.
        deadline = time.monotonic() + 120
        temp_seen, scanned = None, 0.0
        while proc.poll() is None and time.monotonic() < deadline:
            if temp_seen is None and any(p.name.startswith("nrl-ray-") for p in tmp_root.iterdir()):
                temp_seen = time.monotonic()
            if temp_seen is not None and aim in _phase_times(phases, temp_seen):
                break
            if time.monotonic() - scanned > 0.05:
                seen |= descendants(proc.pid)
                scanned = time.monotonic()
            time.sleep(0.002)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        until = _phase_times(phases, temp_seen)[aim] + delay
        while time.monotonic() < until - 0.06:
            seen |= descendants(proc.pid)
            time.sleep(0.01)
        time.sleep(max(0.0, until - time.monotonic()))
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        deadline = time.monotonic() + 10
        while (alive(seen) or processes_matching(str(tmp_root))) and time.monotonic() < deadline:
            time.sleep(0.2)
        # What is left of Ray's temp folder, file by file (what wrote it after the clean-up).
        left = sorted(
            str(p.relative_to(tmp_root))
            for d in tmp_root.glob("nrl-ray*")
            for p in [d, *d.rglob("*")]
        )[:20]
        times = _phase_times(phases, temp_seen)
        landed = max((t, _START_PHASES.index(p), p) for p, t in times.items() if t <= sent)[2]
        return proc.returncode, left, err.strip().splitlines()[-2:], landed, times
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_processes(set(alive(seen)) | set(processes_matching(str(tmp_root))))
        shutil.rmtree(tmp_root, ignore_errors=True)


def test_ctrl_c_at_any_moment_of_the_ray_start_exits_130_and_leaves_nothing(tmp_path):
    """Issue 47: a Ctrl-C while the local head started killed the driver with SIGSEGV (in
    ``_raylet.so``) and left ``/tmp/nrl-ray-*``: the handler raised wherever Python was,
    once half-way through connecting Ray's core worker. A Ctrl-C, sent as a terminal does (to
    the whole process group), in each phase of the start (``_START_PHASES``: nrl's set-up,
    Ray's, the GCS, the raylet and its agents, the raylet registering, the core worker
    connecting, nrl's handlers, the started head): exit 130 every time, nothing left.

    Each Ctrl-C is aimed at a phase's middle (the GCS's also at a quarter and three
    quarters), by the phases' lengths in a first start (the one Ctrl-C'd after it started),
    and sent once that phase began: ten starts. It used to be fourteen at fixed delays (every
    0.3 s over 3 s from the temp folder, then three later), each with its own Ray start (this
    test's cost); the start takes 3-10 s here and its phases shift with the load, so fixed
    delays hit the long phases (the GCS's, the registering) many times and the short ones
    (nrl's and Ray's set-up, the core worker's connecting: tens of ms) by chance. The phases
    the Ctrl-C's landed in are printed (nrl's handlers' phase, ~1 ms, is usually over before
    the signal arrives)."""
    script = tmp_path / "driver.py"
    script.write_text(_START_THEN_WAIT)
    first = _ctrl_c_during(script, tmp_path / "phases-first", "started", 0.5)
    results = [("started", *first[:4])]
    times = first[4]
    assert list(times) == list(_START_PHASES), times  # every phase marked, in order
    lengths = {p: round(times[q] - times[p], 3) for p, q in itertools.pairwise(_START_PHASES)}
    print("phases (s):", lengths)
    # The middle of each phase before it started, and a quarter and three quarters into the
    # GCS's (4 s of a 9 s start here): under load, a Ctrl-C there has left files in the temp
    # folder after the clean-up (written by a process of that phase).
    aims = [(p, length / 2) for p, length in lengths.items()]
    aims += [("gcs", lengths["gcs"] / 4), ("gcs", lengths["gcs"] * 3 / 4)]
    for k, (phase, delay) in enumerate(aims):
        got = _ctrl_c_during(script, tmp_path / f"phases-{k}", phase, delay)
        results.append((phase, *got[:4]))
    print("aimed at -> landed in:", [(r[0], r[4]) for r in results])
    bad = [r for r in results if r[1] != 130 or r[2]]
    print(f"{len(results) - len(bad)} of {len(results)} clean")
    assert bad == [], "\n".join(map(repr, bad))  # whole: which files were left


_ORPHAN_WRITER = """
import os, sys, time
folder = sys.argv[1]
end = time.monotonic() + 30  # never outlives the test by much
while time.monotonic() < end:
    os.makedirs(os.path.join(folder, "session_x", "logs"), exist_ok=True)
    with open(os.path.join(folder, "session_x", "logs", "dashboard_agent.out"), "a") as log:
        log.write("still starting\\n")
    time.sleep(0.05)
"""

_STOPPED_START = """
import signal, sys
from nrl_core.config.schema import ClusterConfig, RunConfig
from nrl_core.distributed.cluster import LocalCluster
from nrl_core.interfaces import ComponentContext

config = RunConfig(cluster=ClusterConfig(num_cpus=2))
cluster = LocalCluster(None, ComponentContext(config=config), temp_dir=sys.argv[1])
cluster._temp_pending = True  # the start made the folder, as start() does
cluster._stopped_while_starting(signal.SIGTERM)  # exits 143
"""


def test_a_stopped_start_outlasts_an_orphan_that_keeps_writing_into_the_temp_folder(tmp_path):
    """Under load, a Ctrl-C in the GCS phase left ``session_*/logs/*.out`` behind (the sweep
    above, 2 of 14 starts at load ~5): a Ray agent whose raylet died of the same Ctrl-C is
    nobody's child, so the stop does not find it, and it went on writing its log into the folder
    after the clean-up's last removal. Here an orphan (not the driver's child) names the folder
    on its command line and rewrites a log in it every 50 ms for up to 30 s: the stopped start
    (in a driver of its own: it stops the Ray of its process, as a start must) must stop it and
    leave the folder removed for good."""
    temp = tmp_path / f"nrl-ray-{uuid.uuid4().hex[:8]}"
    temp.mkdir()
    # `&` in a shell that exits at once: the writer is reparented, nobody's child here.
    subprocess.run(
        ["bash", "-c", f"{sys.executable} -c '{_ORPHAN_WRITER}' {temp} >/dev/null 2>&1 &"],
        check=True,
    )
    deadline = time.monotonic() + 30
    while not (temp / "session_x" / "logs" / "dashboard_agent.out").exists():
        assert time.monotonic() < deadline, "the writer never wrote"
        time.sleep(0.05)
    writers = processes_matching(str(temp))
    assert writers and not set(writers) & descendants(os.getpid())
    try:
        stopped = subprocess.run(
            [sys.executable, "-c", _STOPPED_START, str(temp)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stopped.returncode == 143, stopped.stderr[-2000:]
        assert "stopped by SIGTERM while the local Ray head was starting" in stopped.stderr
        time.sleep(1.5)  # 30 of the writer's rounds, had it survived
        assert not temp.exists(), sorted(str(p) for p in temp.rglob("*"))
        assert not alive(writers)
    finally:
        stop_processes(writers)
