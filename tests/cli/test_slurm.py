"""``nrl slurm`` and the shipped batch script against a real Slurm on this machine.

The ``slurm`` tests start munged, slurmctld and two slurmd (``slurmd -N``: two Slurm nodes on
one host) from a private folder, submit ``nrl_core/cluster_scripts/nrl.sbatch`` with a 3-step
GRPO, and check the run and that nothing of the job's Ray outlives it, also after ``scancel``.
They need Debian's ``slurm-wlm`` and ``munge`` and root: they run in ``nox -s slurm`` (which
sets ``NRL_SLURM_TESTS=1``; ``.ci/run`` calls it where ``apt-get`` can install them) or when
selected with ``-m slurm``, and are skipped, with that reason, in the everyday run. The other
tests here (bad input) need no Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nrl_core.cli.slurm import script_path

NRL = [sys.executable, "-m", "nrl_core.cli"]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
GRPO = [
    "grpo.max_num_steps=3",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "data.max_val_samples=8",
]


def _nrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*NRL, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


# -- without Slurm ----------------------------------------------------------------------------


def test_script_is_shipped_and_printed(tmp_path):
    assert script_path().is_file()
    printed = _nrl("slurm", "script")
    assert printed.returncode == 0 and printed.stdout == script_path().read_text()
    out = tmp_path / "nrl.sbatch"
    assert _nrl("slurm", "script", "-o", str(out)).returncode == 0
    assert out.read_text() == script_path().read_text() and os.access(out, os.X_OK)
    syntax = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["submit", "--nodes", "0", "--", "run", "grpo"], "--nodes 0: a run needs at least 1 node"),
        (["submit", "--nodes", "2"], "expected the nrl command to run after `--`"),
        (["submit", "--", "run", "grpo", "polcy.lr=1"], "unknown key polcy; did you mean policy?"),
        (["wait", "--address", "x:1", "--nodes", "0"], "--nodes 0: a cluster has at least 1 node"),
        (["plan", "--", "config", "show", "grpo"], "expected the nrl command to run after `--`"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    # An empty PATH folder holds no sbatch: only the checks before it can answer.
    result = _nrl("slurm", *args, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_submit_without_sbatch_is_one_line_exit_2(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    result = subprocess.run(
        [*NRL, "slurm", "submit", "--", "run", "grpo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: sbatch is not on PATH: run this on a Slurm login node, or write the script "
        "with `nrl slurm script -o nrl.sbatch` and submit it where Slurm is"
    ]


def test_script_outside_an_allocation_is_one_line_exit_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", str(script_path()), "run", "grpo"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: nrl.sbatch: not inside a Slurm allocation (no SLURM_JOB_ID); submit it with "
        "sbatch or `nrl slurm submit`"
    ]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"SLURM_GPUS_ON_NODE": "2"},
            ["cluster.gpus_per_node=4"],
            "cluster.gpus_per_node=4 but Slurm gave each node 2 GPU(s); submit with "
            "--gpus-per-node=4 or lower cluster.gpus_per_node",
        ),
        ({"NRL_RAY_PORT": "70000"}, [], "NRL_RAY_PORT=70000 is not a port (1 to 65535)"),
        ({"NRL_RAY_WAIT_S": "0"}, [], "NRL_RAY_WAIT_S=0 is not a whole number of seconds"),
        ({}, ["polcy.lr=1"], "unknown key polcy; did you mean policy?"),
    ],
)
def test_script_bad_input_is_one_line_exit_2_before_any_ray(env, args, message, tmp_path):
    # The variables Slurm sets in an allocation; each case stops before scontrol or srun.
    slurm_env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_ON_NODE": "2"}
    result = subprocess.run(
        ["bash", str(script_path()), "run", "grpo", f"logger.log_dir={tmp_path}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            **slurm_env,
            **env,
        },
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not any(tmp_path.iterdir())  # no run folder, no Ray log folder


# -- a real Slurm -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _processes_naming(text: str) -> list[str]:
    """Command lines (with PIDs) of the processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmd:
                found.append(f"{entry.name}: {cmd[:200]}")
    return found


class Slurm:
    """munged + slurmctld + slurmd(s) of one test module, all under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.nodes: list[str] = []

    def write_conf(self, nodes: list[str]) -> None:
        r = self.root
        node_lines = "\n".join(
            f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"Port={_free_port()} CPUs={os.cpu_count()} RealMemory=1000"
            for name in nodes
        )
        self.conf.write_text(
            f"""ClusterName=nrltest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
DebugFlags=NO_CONF_HASH
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=15
MpiDefault=none
PlugStackConfig=/dev/null
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{node_lines}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )
        self.nodes = nodes

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)}: {result.stderr[-2000:]}")
        return result

    def idle_nodes(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return sorted(line.split()[0] for line in out.splitlines() if line.split()[1:] == ["idle"])

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        m = self.root / "munge"
        self.run(
            "munged", "--force", f"--key-file={key}", f"--socket={m}/socket",
            f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/seed",
        )  # fmt: skip
        # Two nodes through `slurmd -N` (a build with multiple-slurmd support); one otherwise.
        self.write_conf(["n1", "n2"])
        self.run("slurmctld", "-i", "-f", str(self.conf))
        for node in self.nodes:
            self.run("slurmd", "-f", str(self.conf), "-N", node, check=False)
        deadline = time.monotonic() + 60
        while self.idle_nodes() != self.nodes and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.idle_nodes() == ["n1"]:
            self.stop_daemons(("slurmd",))
            self.write_conf(["n1"])
            self.run("scontrol", "reconfigure")
            self.run("slurmd", "-f", str(self.conf), "-N", "n1")
        while self.idle_nodes() != self.nodes and time.monotonic() < deadline:
            time.sleep(0.5)
        assert self.idle_nodes() == self.nodes, (self.root / "log" / "slurmctld.log").read_text()[
            -3000:
        ]

    def cancel_all(self) -> None:
        """Cancel every job of this (private) cluster and wait until none runs: a job outlives
        the daemons otherwise (its slurmstepd and Ray keep running)."""
        self.run("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                return
            time.sleep(1)

    def stop_daemons(self, names=("slurmd", "slurmctld", "munged")) -> None:
        """SIGTERM to the daemons of this test (by their pid files), then SIGKILL."""
        pids = []
        for name in names:
            pattern = {"munged": "munge/munged.pid"}.get(name, f"{name}*.pid")
            for pid_file in self.root.glob(pattern):
                with contextlib.suppress(ValueError, OSError):
                    pids.append(int(pid_file.read_text().strip()))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_done(self, job_id: str, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            # No JobState: scontrol did not answer (a busy machine); ask again.
            if info.get("JobState") not in (
                None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"
            ):  # fmt: skip
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {self.job(job_id).get('JobState')}")


@pytest.fixture(scope="module")
def slurm(request):
    selected = "slurm" in (request.config.getoption("markexpr") or "")
    if os.environ.get("NRL_SLURM_TESTS") != "1" and not selected:
        pytest.skip("starts Slurm daemons (root, slurm-wlm, munge): run `nox -s slurm` or -m slurm")
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(
            f"the slurm tests need root and Debian's slurm-wlm and munge (`apt-get install -y "
            f"slurm-wlm munge`); missing: {', '.join(missing) or 'root'}"
        )
    # Short: Ray's socket paths under the temp folders must stay below 107 bytes.
    root = Path(f"/tmp/nrls-{os.getpid()}")
    root.mkdir()
    cluster = Slurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.stop_daemons()
        shutil.rmtree(root, ignore_errors=True)


def _submit(slurm: Slurm, *extra: str) -> tuple[str, Path, Path, Path]:
    """sbatch the shipped script on every node with a 3-step GRPO; (job id, run folder, the
    job's temp root, its folder). Under the fixture's folder, not pytest's ``tmp_path``: other
    pytest runs of the same user prune old ``tmp_path`` roots, maybe while the job runs; and
    short, for Ray's socket paths (107 bytes at most)."""
    work = Path(tempfile.mkdtemp(prefix="j", dir=slurm.root))
    tmp_root = work / "t"
    tmp_root.mkdir()
    run_dir = work / "runs" / "r"
    env = {
        **slurm.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "NRL_ACTOR_ENV": "system",
        "TMPDIR": str(tmp_root),
        "NRL_RAY_PORT": str(_free_port()),
        "NRL_RAY_WAIT_S": "180",
    }
    result = subprocess.run(
        [
            "sbatch", "--parsable", f"--nodes={len(slurm.nodes)}",
            f"--output={work}/job.out", f"--chdir={work}",
            str(script_path()), "run", "grpo", "-q",
            f"logger.log_dir={run_dir.parent}", "logger.run_name=r", *GRPO, *extra,
        ],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0], run_dir, tmp_root, work


def _assert_nothing_left(job_id: str, tmp_root: Path, work: Path) -> None:
    """No process names the job's Ray temp folders, and none of them is left (the wrappers
    have Slurm's KillWait, 15 s here, to finish after the job ends)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        procs = _processes_naming(f"nrl-ray-{job_id}-")
        folders = sorted(p.name for p in tmp_root.glob("nrl-ray-*"))
        if not procs and not folders:
            return
        time.sleep(0.5)
    log = (work / "job.out").read_text()[-3000:]
    raise AssertionError(f"left behind: processes {procs}, folders {folders}\n{log}")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sbatch_runs_grpo_on_a_ray_cluster_inside_the_allocation(slurm):
    job_id, run_dir, tmp_root, work = _submit(slurm)
    info = slurm.wait_done(job_id, timeout_s=480)
    out = (work / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-3000:]
    assert f"{len(slurm.nodes)} node(s), 0 GPU(s)" in out  # every node joined before the run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_3").is_dir()
    logs = sorted(p.name for p in (run_dir / f"slurm-{job_id}").iterdir())
    assert "ray-n1.log" in logs
    _assert_nothing_left(job_id, tmp_root, work)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scancel_mid_run_leaves_no_ray_behind(slurm):
    # Many steps: it is cancelled long before the end.
    job_id, run_dir, tmp_root, work = _submit(slurm, "grpo.max_num_steps=1000")
    deadline = time.monotonic() + 480  # Ray's start alone took 3 min on a loaded machine
    # Cancelled once the run is under way on the cluster: the run's log says it joined Ray.
    while time.monotonic() < deadline:
        log = run_dir / "nrl.log"
        if log.exists() and "Connected to Ray cluster" in log.read_text():
            break
        assert slurm.job(job_id).get("JobState") in (None, "PENDING", "RUNNING"), (
            work / "job.out"
        ).read_text()[-3000:]
        time.sleep(1)
    else:
        raise AssertionError("the run never joined the cluster")
    assert _processes_naming(f"nrl-ray-{job_id}-"), "no Ray process of the job while it ran"
    slurm.run("scancel", job_id)
    info = slurm.wait_done(job_id, timeout_s=120)
    assert info["JobState"] == "CANCELLED"
    _assert_nothing_left(job_id, tmp_root, work)
