"""The local Ray head starts on a busy machine, and a start-up that fails leaves nothing behind.

Issue 39: on a loaded 2-core machine `nrl run` failed 11 times in a row with "The current node
timed out during startup", and kept a `/tmp/nrl-ray-*` folder per failure. What happens there:
the raylet gives its agents (Python processes) a fixed ~15 s to write their port files, and Ray's
driver waits a fixed 30 s for the raylet; under load the agents' start-up takes longer.

The slow agent is made real and deterministic with a ``sitecustomize`` on ``PYTHONPATH`` that
holds Ray's dashboard agent process for 40 s before it starts (as a CPU-starved machine does);
each driver runs in its own process (a process holds one Ray head) with its own ``TMPDIR``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from nrl_core.distributed.cluster import raylet_failure, start_timeout_s
from nrl_core.distributed.errors import ClusterError

from .conftest import processes_matching, stop_processes

_DRIVER = """
import os, sys, time
from nrl_core.config.schema import ClusterConfig, RunConfig
from nrl_core.distributed import cluster as module
from nrl_core.interfaces import ComponentContext
if {attempts!r} is not None:  # exactly this many start-ups
    module.START_ATTEMPTS = module.MAX_START_ATTEMPTS = {attempts!r}
config = RunConfig(cluster=ClusterConfig(num_cpus=1))
cluster = module.LocalCluster(None, ComponentContext(config=config))
cluster.console_output = False
cluster.keep_temp_on_failure = {keep}
started = time.monotonic()
try:
    cluster.start()
    print("STARTED", round(time.monotonic() - started, 1), flush=True)
    cluster.shutdown()
except module.ClusterError as exc:
    print("ERROR", exc, flush=True)
"""

_SLOW_AGENT = """
import os, sys, time
# Ray's dashboard agent, and only it: held before it starts, as on a CPU-starved machine.
if any(arg.endswith(os.path.join("dashboard", "agent.py")) for arg in sys.argv):
    marker = os.environ.get("NRL_TEST_SLOW_AGENT_ONCE")
    if not marker or not os.path.exists(marker):
        if marker:
            open(marker, "w").close()
        time.sleep(40)
"""


_BUSY = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"


def _run_driver(tmp_path: Path, *, attempts=None, keep=False, slow_agent=None, hogs=0):
    """Run a driver that starts and stops a local head; (its stdout+stderr, TMPDIR root)."""
    root = Path(tempfile.mkdtemp(prefix="nrl-s-", dir="/tmp"))  # short: Ray's socket paths
    env = {**os.environ, "TMPDIR": str(root)}
    env.pop(  # the adaptive limit is under test, not a setting of the machine running it
        "NRL_RAY_START_TIMEOUT_S", None
    )
    if slow_agent is not None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(_SLOW_AGENT)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
        if slow_agent == "once":
            env["NRL_TEST_SLOW_AGENT_ONCE"] = str(tmp_path / "held-once")
        # Ray's own wait for the node (C++, 30 s) ends in 2 s, so nrl's wrapper reads the
        # raylet's log after each 2 s wait (and its 0.5 s pause) instead of once after 30: the
        # same path (Ray's wait times out, the wrapper finds the raylet's fatal line), ~13 s
        # sooner per failed start-up.
        env["RAY_raylet_start_wait_time_s"] = "2"
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(attempts=attempts, keep=keep))
    busy = [
        # Bounded: each stops on its own after 5 minutes if this test dies without killing it.
        subprocess.Popen(
            [sys.executable, "-c", _BUSY],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(hogs)
    ]
    try:
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
        )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        stop_processes(processes_matching(str(root)))
    return done.stdout + done.stderr, root


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_local_head_starts_beside_busy_processes(tmp_path):
    """Four busy loops beside the start-up (on 2 cores: load 4+ on top of whatever else runs)."""
    out, root = _run_driver(tmp_path, hogs=4)
    try:
        assert "STARTED" in out, out[-3000:]
        assert list(root.iterdir()) == []  # the temp folder went with the head
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_start_whose_raylet_gives_up_on_its_agents_is_retried(tmp_path):
    """The first start-up's agent misses the raylet's fixed wait (the raylet dies); nrl sees it
    in the raylet's log at once, stops that attempt's processes and starts again."""
    out, root = _run_driver(tmp_path, slow_agent="once")
    try:
        assert "STARTED" in out, out[-3000:]
        assert "Ray's raylet gave up waiting for its agents" in out
        assert "trying again (attempt 2, " in out
        assert list(root.iterdir()) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept-with-v"])
def test_a_failed_start_is_one_line_and_leaves_no_temp_folder_unless_v(tmp_path, keep):
    out, root = _run_driver(tmp_path, attempts=1, keep=keep, slow_agent="always")
    try:
        errors = [line for line in out.splitlines() if line.startswith("ERROR ")]
        assert len(errors) == 1, out[-3000:]
        line = errors[0]
        assert "could not start a local Ray head (1 attempt in" in line
        assert "Ray's raylet gave up waiting for its agents" in line
        assert "cluster.backend=ray" in line  # what to try
        kept = [p for p in root.iterdir() if p.name.startswith("nrl-ray-")]
        if keep:
            assert len(kept) == 1 and f"Ray's logs are in {kept[0]}" in line
            assert (kept[0] / "session_latest" / "logs" / "raylet.out").is_file()
        else:
            assert kept == [] and "rerun with -v to keep Ray's logs" in line
        assert processes_matching(str(root)) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the pieces, without Ray ------------------------------------------------------------------


def test_the_start_up_limit_grows_with_the_load(monkeypatch):
    monkeypatch.delenv("NRL_RAY_START_TIMEOUT_S", raising=False)
    assert start_timeout_s(load=0.5, cpus=2) == 60
    assert start_timeout_s(load=8, cpus=2) == 240
    assert start_timeout_s(load=80, cpus=2) == 600  # capped
    monkeypatch.setenv("NRL_RAY_START_TIMEOUT_S", "45")
    assert start_timeout_s(load=80, cpus=2) == 45
    monkeypatch.setenv("NRL_RAY_START_TIMEOUT_S", "soon")
    with pytest.raises(ClusterError, match="NRL_RAY_START_TIMEOUT_S='soon' is not a number"):
        start_timeout_s()


def test_the_raylets_fatal_line_is_read_from_its_log(tmp_path):
    logs = tmp_path / "session_x" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(tmp_path / "session_x")
    assert raylet_failure(tmp_path) is None  # no log yet
    raylet = logs / "raylet.out"
    raylet.write_text("[2026-11-26 06:28:57,381 I 31730 31802] (raylet) agent_manager.cc:81: ok\n")
    assert raylet_failure(tmp_path) is None
    # The line Ray 2.60 wrote in the failures reproduced for issue 39 (10 busy loops, 2 cores).
    raylet.write_text(
        raylet.read_text()
        + textwrap.dedent("""\
        [2026-11-26 06:29:16,739 C 31730 31730] (raylet) node_manager.cc:3576:  An unexpected \
system state has occurred. You have likely discovered a bug in Ray. Please report this issue at \
https://github.com/ray-project/ray/issues and we'll work with you to fix it. Check failed: \
statussetor3576.has_value() Timed out waiting for file /tmp/nrl-ray-942c4f9c/session_2026-11-26\
_06-28-04_947533_30759/metrics_agent_port_b246496575bfc372c787ae0f8af10c2aa6f8b2f19871c0aaccc45f00
        """)
    )
    assert raylet_failure(tmp_path) == (
        "Ray's raylet gave up waiting for its agents (metrics_agent_port file)"
    )
