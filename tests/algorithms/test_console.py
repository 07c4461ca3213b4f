"""What a run prints: start-up phases, the step lines off a terminal, Ray's output in the run log."""

from __future__ import annotations

import io
import json
import logging
import os
import re

from rich.console import Console

from nrl_core.algorithms.runtime import STEP_LINES, RunSession, StepLines
from nrl_core.config.schema import GRPOConfig, LoggerConfig
from nrl_core.metrics import MetricsLogger
from nrl_core.run_log import RUN_LOG_FILE, open_run_log


def plain_console() -> tuple[Console, io.StringIO]:
    """A console writing to a string, as on a pipe or a Slurm log (not a terminal)."""
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=60), out


class Clock:
    """A clock the test sets: ``now`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_every_step_of_a_short_run_is_one_line_with_the_time_left(tmp_path):
    console, out = plain_console()
    config = GRPOConfig(logger=LoggerConfig(log_dir=str(tmp_path), run_name="run"))
    session = RunSession(config, None, algorithm="grpo", console=console)
    with session.progress(20, 0) as advance:
        for step in range(1, 21):
            metrics = {"train/reward_mean": step / 100, "timing/step_s": 1.5}
            if step % 10 == 0:
                metrics["val/accuracy"] = 0.5
            advance(metrics)
            # Printed as the step ends, not when the loop is over (a progress bar off a
            # terminal prints nothing until then).
            assert out.getvalue().count("\n") == step
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step  1/20  reward 0.010  1.50 s/step  eta ")
    assert lines[9].startswith("step 10/20  reward 0.100  val acc 0.500  1.50 s/step  eta ")
    assert re.fullmatch(
        r"step 20/20  reward 0\.200  val acc 0\.500  1\.50 s/step  took \d+s", lines[19]
    )
    # Plain text, whatever the width: no bar, no colour codes, no wrapped lines.
    assert all("\x1b" not in line and "━" not in line for line in lines)


def test_a_long_run_prints_about_fifty_lines_with_the_first_last_and_validation_steps():
    console, out = plain_console()
    clock = Clock()
    advance = StepLines(console, 275, 0, clock=clock)
    for step in range(1, 276):
        clock.now = 2.0 * step  # each step takes 2 s
        metrics = {"train/reward_mean": 0.25, "timing/step_s": 2.0}
        if step % 25 == 0:
            metrics["val/accuracy"] = 0.5
        advance(metrics)
    steps = [int(re.match(r"step +(\d+)/275", line)[1]) for line in out.getvalue().splitlines()]
    assert steps[0] == 1 and steps[-1] == 275
    assert {25, 50, 275} <= set(steps) and 2 not in steps and 7 not in steps
    assert STEP_LINES <= len(steps) <= STEP_LINES + 10
    lines = dict(zip(steps, out.getvalue().splitlines(), strict=True))
    # 2 s per step, 225 steps left after step 50.
    assert lines[50].endswith("val acc 0.500  2.00 s/step  eta 7m30s")
    assert lines[275].endswith("took 9m10s")


def test_a_resumed_run_starts_its_lines_at_its_first_step_with_the_algorithms_fields():
    console, out = plain_console()
    clock = Clock()
    advance = StepLines(
        console,
        300,
        250,
        fields=(("train/loss", "loss"), ("timing/step_s", "s/step")),
        clock=clock,
    )
    for step in range(1, 51):
        clock.now = 3.0 * step
        advance({"train/loss": 0.5, "timing/step_s": 3.0})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 251/300  loss 0.500  3.00 s/step  eta 2m27s"
    assert len(lines) == 50  # 50 steps this session: every one
    assert lines[-1] == "step 300/300  loss 0.500  3.00 s/step  took 2m30s"


def test_each_start_up_phase_is_a_line_once_done_and_a_failed_one_prints_nothing(tmp_path):
    console, out = plain_console()
    config = GRPOConfig(logger=LoggerConfig(log_dir=str(tmp_path), run_name="run"))
    session = RunSession(config, None, algorithm="grpo", console=console)
    with session.phase("starting Ray") as done:
        done("Ray: 2 CPUs [local]")  # brackets are text, not markup
    with session.phase("loading the data"):
        pass
    try:
        with session.phase("starting the policy"):
            raise RuntimeError("no")
    except RuntimeError:
        pass
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"  Ray: 2 CPUs \[local\] \(\d+\.\d s\)", lines[0]), lines
    assert re.fullmatch(r"  loading the data \(\d+\.\d s\)", lines[1]), lines
    assert len(lines) == 2


def test_rays_own_lines_and_the_workers_output_go_to_the_run_log_until_removed(tmp_path, capsys):
    import ray._private.worker as ray_worker

    from nrl_core.distributed.cluster import RayOutputToRunLog

    close = open_run_log(tmp_path)
    printer = ray_worker.print_worker_logs
    output = RayOutputToRunLog({"NRL_TEST_QUIET_VAR": "1"})
    try:
        assert os.environ["NRL_TEST_QUIET_VAR"] == "1"
        # What Ray's log thread and its error-message thread call for each batch of lines.
        ray_worker.print_worker_logs(
            {
                "lines": ["Loading weights: 100%", "a warning"],
                "pid": 4242,
                "actor_name": "nrl-policy-0",
                "ip": "10.0.0.1",
                "localhost": "10.0.0.1",
                "is_err": True,
            },
            None,
        )
        ray_worker.print_worker_logs({"lines": ["worker died"], "pid": "raylet"}, None)
        # The autoscaler's status table (every 5 s) is no event: Ray would not print it.
        ray_worker.print_worker_logs({"lines": ["Autoscaler status: ..."], "pid": "autoscaler"})
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
    finally:
        output.remove()
    assert "NRL_TEST_QUIET_VAR" not in os.environ
    assert ray_worker.print_worker_logs is printer
    logged = (tmp_path / RUN_LOG_FILE).read_text()
    assert "(nrl-policy-0 pid=4242) Loading weights: 100%" in logged
    assert "(nrl-policy-0 pid=4242) a warning" in logged
    assert "(raylet) worker died" in logged
    assert "ray._private.worker: Started a local Ray instance." in logged
    assert "Autoscaler status" not in logged
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.out + captured.err
    assert "Started a local Ray instance" not in captured.out + captured.err
    # Removed: Ray's own lines no longer reach the run log.
    logging.getLogger("ray._private.worker").info("after removal")
    close()
    assert "after removal" not in (tmp_path / RUN_LOG_FILE).read_text()


def test_the_summary_shows_the_best_validation_and_the_checkpoint_eval_takes(tmp_path):
    """Issue 53: a curve that ends lower than it peaked showed only first -> last. The
    summary names the best validation and which checkpoint `nrl eval` of the folder takes;
    a checkpoint saved at a validation step records that step's validation metrics."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=250)
    config = GRPOConfig(logger=LoggerConfig(log_dir=str(tmp_path), run_name="run"))
    session = RunSession(config, None, algorithm="grpo", console=console)
    session.policy = _FilePolicy()
    session.train_stream = None
    session.metrics = MetricsLogger(session.run_dir, config.logger, resume_step=None)
    for step, accuracy in ((0, 0.2), (10, 0.9), (20, 0.7)):
        metrics = {"val/accuracy": accuracy, "val/reward_mean": accuracy}
        if step:
            metrics |= {"train/reward_mean": accuracy, "timing/step_s": 1.0}
        session.log(step, metrics)
        if step:
            session.save_checkpoint(step)
    session.log(25, {"train/reward_mean": 0.8, "timing/step_s": 1.0})
    session.save_checkpoint(25)  # no validation at this step: records none
    session.summary()
    session.metrics.close()
    text = " ".join(out.getvalue().replace("│", " ").split())  # the table's rows, one line each
    assert "val accuracy (first -> last) 0.200 (step 0) -> 0.700 (step 20)" in text, text
    assert "val accuracy best 0.900 (step 10)" in text, text
    assert "nrl eval picks step_10 (best val/accuracy 0.900; checkpointing.metric_name)" in text
    states = {
        p.name: json.loads((p / "trainer_state.json").read_text())
        for p in session.folder.checkpoints.complete()
    }
    assert states["step_20"]["val"] == {"val/accuracy": 0.7, "val/reward_mean": 0.7}
    assert "val" not in states["step_25"]


class _FilePolicy:
    """Writes a one-file checkpoint: what the checkpoint folder, not the model, is tested on."""

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path)
        with open(os.path.join(path, "weights.bin"), "wb") as handle:
            handle.write(b"w")
