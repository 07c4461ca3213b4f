"""Errors from inside workers: one line naming the group, rank and the file with the full
traceback (the run log ``<run dir>/nrl.log``); a hung environment step fails after
``env.step_timeout_s`` and its actor is stopped."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nrl_core.distributed.errors import WorkerError, WorkerTimeoutError
from nrl_core.environments import EnvironmentActor
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.run_log import RUN_LOG_FILE, open_run_log, run_log_path

from .conftest import HERE, alive
from .nrl_error_workers import HANG_MARKER_VAR, MisconfiguredEnvironment

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def failing_group(ray_cluster, worker_env):
    from nrl_core.distributed.worker_group import WorkerGroup

    group = WorkerGroup.start(
        "nrl_error_workers:FailingWorker",
        2,
        name="policy",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=60,
    )
    yield group
    group.shutdown()


def test_a_raising_worker_is_one_line_and_its_traceback_goes_to_the_run_log(
    failing_group, tmp_path
):
    close = open_run_log(tmp_path)
    try:
        with pytest.raises(WorkerError) as info:
            failing_group.run_all("crash", 1)
    finally:
        close()
    err, log = info.value, tmp_path / RUN_LOG_FILE
    assert str(err) == (
        f"policy rank 1 failed in crash: ValueError: bad batch on rank 1 (full traceback: {log})"
    )
    assert (err.group, err.rank, err.exit_code, err.log_file) == ("policy", 1, 1, str(log))
    text = log.read_text()
    assert "policy rank 1 failed in crash" in text
    assert "nrl_error_workers.py" in text and "second line of the message" in text
    assert "rank 1 is about to crash" in text  # the worker's own output (Ray log tail)
    assert ":job_id:" not in text  # Ray's routing lines are not the worker's output
    # The error crosses process boundaries (Ray, multiprocessing) with everything it holds.
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is WorkerError and str(copy) == str(err)
    assert (copy.rank, copy.exit_code, copy.log_file) == (1, 1, str(log))
    assert copy.remote_traceback == err.remote_traceback
    assert "nrl_error_workers.py" in copy.remote_traceback


def test_bad_user_input_in_a_worker_keeps_exit_2_and_its_own_message(failing_group, tmp_path):
    close = open_run_log(tmp_path)
    try:
        with pytest.raises(WorkerError) as info:
            failing_group.run_one(0, "bad_input")
    finally:
        close()
    assert str(info.value) == (
        "policy rank 0 failed in bad_input: policy.lr must be > 0; set policy.optimizer.lr=1e-5 "
        f"(full traceback: {tmp_path / RUN_LOG_FILE})"
    )
    assert info.value.exit_code == 2
    assert pickle.loads(pickle.dumps(info.value)).exit_code == 2


def test_without_a_run_log_the_error_names_the_ray_worker_log(failing_group):
    assert run_log_path() is None  # e.g. `nrl convert`: no run folder
    with pytest.raises(WorkerError) as info:
        failing_group.run_all("crash", 0)
    err = info.value
    message = str(err)
    assert "\n" not in message
    assert message.startswith("policy rank 0 failed in crash: ValueError: bad batch on rank 0 (")
    assert message.endswith(f"(worker log: {err.log_file}; -v prints the traceback)")
    assert Path(err.log_file).is_file() and "rank 0 is about to crash" in err.log_tail
    assert "second line of the message" in err.remote_traceback


@pytest.mark.parametrize(
    ("signal_name", "cause"),
    [
        ("SIGKILL", "was killed or exited without a word (SIGKILL"),
        ("SIGSEGV", "crashed (Segmentation fault)"),
        ("SIGTERM", "was terminated (SIGTERM)"),
    ],
)
def test_a_killed_worker_is_named_with_its_process_title_pid_and_cause(
    ray_cluster, worker_env, signal_name, cause
):
    """Each rank's process says what it is (``ps`` showed ``ray::_WorkerActor`` for every
    rank of every group), and a rank killed from outside is named with its pid and, as far as
    anyone can tell, the signal (it was "its process exited or was killed")."""
    import signal

    from nrl_core.distributed.worker_group import WorkerGroup

    group = WorkerGroup.start(
        "nrl_error_workers:FailingWorker",
        2,
        name="generation-torch",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=60,
    )
    try:
        pids = group.run_all("pid")
        for rank, pid in enumerate(pids):
            title = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0].strip()
            assert title == f"ray::nrl-generation-torch-{rank}", title
        os.kill(pids[1], getattr(signal, signal_name))
        # Ray learns how a process ended a moment after it is gone (a call made at once may
        # only see the connection drop): as a run does, call after the death, not during it.
        deadline = time.monotonic() + 30
        while alive([pids[1]]) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        with pytest.raises(WorkerError) as info:
            group.run_one(1, "pid")
        message = str(info.value)
        assert message.startswith(
            f"generation-torch rank 1 died in pid (pid {pids[1]}): its process {cause}"
        ), message
        assert "\n" not in message
        dead = group.dead_rank_error("refit")
        assert dead is not None and str(dead).startswith(
            f"generation-torch rank 1 died in refit (pid {pids[1]})"
        ), dead
    finally:
        group.shutdown(timeout_s=5)


def test_a_hung_environment_step_fails_after_its_own_timeout_and_is_stopped(
    ray_cluster, worker_env, tmp_path
):
    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.environments import ENV_ACTOR_TARGET, EnvironmentPool

    group = WorkerGroup.start(
        ENV_ACTOR_TARGET,
        1,
        args=("nrl_error_workers:HangingEnvironment", None, ComponentContext(config=None)),
        name="env-hang",
        env_vars=worker_env,
        num_cpus_per_worker=0.25,
        timeout_s=600,  # the worker timeout: the step must not wait for it
    )
    pid = group.infos[0].pid
    pool = EnvironmentPool({"default": group}, step_timeout_s=2)
    close = open_run_log(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            pool.step(["t"], [[{"role": "assistant", "content": "7"}]], [{"answer": "7"}])
        elapsed = time.monotonic() - started
    finally:
        close()
        group.shutdown(timeout_s=0)
    assert 2 <= elapsed < 10, elapsed
    assert str(info.value) == (
        "env-hang rank 0 did not finish step within 2s; raise env.step_timeout_s if this is "
        f"expected (details: {tmp_path / RUN_LOG_FILE})"
    )
    assert "hanging step started" in (tmp_path / RUN_LOG_FILE).read_text()
    # The hung actor was stopped at once, not left sleeping until the run's end.
    assert group.actors == []
    deadline = time.monotonic() + 10
    while alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive([pid]) == []


def test_an_environment_config_error_is_not_a_sample_error():
    # A sample's exception costs that sample (reward 0, counted); an nrl error says the
    # environment's set-up is wrong, which no retry fixes: it fails the step.
    actor = EnvironmentActor(MisconfiguredEnvironment, None, ComponentContext(config=None))
    with pytest.raises(ConfigError, match=r"env\.reference_file is missing"):
        actor.step(([[{"role": "assistant", "content": "1"}]], [{}]))


# ---------------------------------------------------------------------------------------------
# Through the CLI: `nrl run grpo` with a test environment plugin installed beside nrl

GRPO_ONE_STEP = [
    "grpo.max_num_steps=1",
    "grpo.val_period=0",
    "grpo.sft_warmup_steps=0",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=4",
    "policy.train_micro_batch_size=2",
    "cluster.num_cpus=2",
    "checkpointing.enabled=false",
    # One policy rank, still on Ray (`local`; `auto` would run the environments in the `nrl`
    # process): what is tested is an environment actor's failure and hang, how they are
    # reported and that the actor goes with the run, none of which depends on the policy's
    # rank count (a process fewer per run).
    "policy.num_workers=1",
    "cluster.backend=local",
]


@pytest.fixture
def error_plugin_env(tmp_path) -> dict[str, str]:
    """Environment variables for a CLI run that sees a plugin (found through its entry point)
    registering the failing environments of ``nrl_error_workers``; its actors run in this
    interpreter and import them too."""
    site = tmp_path / "site"
    info = site / "nrl_error_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nrl-error-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[nrl.plugins]\nerrors = nrl_error_plugin\n")
    (site / "nrl_error_plugin.py").write_text(
        textwrap.dedent("""
        from nrl_core import hookimpl

        @hookimpl
        def nrl_register_environments(register):
            register("broken_metrics", "nrl_error_workers:BrokenMetricsEnvironment")
            register("hung", "nrl_error_workers:HangingEnvironment")
    """)
    )
    path = os.pathsep.join(p for p in (str(site), str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NRL_ACTOR_ENV": "system"}


def run_grpo(log_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", *args,
        f"logger.log_dir={log_dir}", "logger.run_name=run", *GRPO_ONE_STEP,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)


@pytest.mark.slow
def test_cli_environment_error_is_one_line_and_the_traceback_is_in_the_run_log(
    tmp_path, error_plugin_env
):
    result = run_grpo(tmp_path, error_plugin_env, "-q", "env.name=broken_metrics")
    assert result.returncode == 1, result.stderr[-3000:]
    log = tmp_path / "run" / RUN_LOG_FILE
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: env-broken_metrics rank 0 failed in metrics: ValueError: metrics table is "
        f"corrupt (full traceback: {log})"
    ], result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == errors[0]
    assert "Traceback" not in result.stderr and "see the second line" not in result.stderr
    text = log.read_text()
    assert "Traceback" in text or "File " in text
    assert "nrl_error_workers.py" in text and "see the second line" in text


@pytest.mark.slow
def test_cli_hung_environment_stops_the_run_after_step_timeout(tmp_path, error_plugin_env):
    marker = tmp_path / "hang.json"
    env = {**error_plugin_env, HANG_MARKER_VAR: str(marker)}
    result = run_grpo(tmp_path, env, "-v", "env.name=hung", "env.step_timeout_s=2")
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    hang = json.loads(marker.read_text())
    # From the hung step's start to the end of the whole process: the 2 s timeout plus the
    # tear-down, far from cluster.worker_timeout_s (600 s).
    assert ended - hang["started"] < 60, ended - hang["started"]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last == (
        "error: env-hung rank 0 did not finish step within 2s; raise env.step_timeout_s if this "
        f"is expected (details: {tmp_path / 'run' / RUN_LOG_FILE})"
    )
    # -v also shows what the worker printed before it hung.
    assert "--- worker log (tail) ---" in result.stderr
    assert "hanging step started" in result.stderr
    assert alive([hang["pid"]]) == []  # the environment actor did not outlive the run
