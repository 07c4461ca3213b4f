"""`nrl run ppo` through the real CLI: a 2-rank policy, a 1-rank critic, local Ray."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.algorithms.test_grpo_cli import metrics, run_nrl

pytestmark = pytest.mark.slow

# A tiny model a warm-up step in answers no sum right: arithmetic would give every sample
# reward 0, and the critic nothing to learn. This reward varies with the completion's length.
REWARD = Path(__file__).with_name("ppo_length_reward.py")
SMALL = [
    "env.name=reward_fn",
    f"env.reward_fn.path={REWARD}:score",
    "ppo.num_prompts_per_step=8",
    "ppo.num_generations_per_prompt=2",
    "ppo.sft_warmup_steps=1",
    "ppo.critic_warmup_steps=1",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
    "critic.train_global_batch_size=8",
    "critic.train_micro_batch_size=4",
    "data.max_val_samples=8",
    "cluster.num_cpus=2",
]
CRITIC_KEYS = (
    "train/value_loss",
    "train/explained_variance",
    "train/value_clip_frac",
    "train/values_mean",
    "train/returns_mean",
    "train/advantages_mean",
    "train/advantages_std",
)


def run_ppo(tmp_path: Path, *overrides: str, check: bool = True, quiet: bool = True):
    return run_nrl(tmp_path, *overrides, check=check, quiet=quiet, algorithm="ppo", base=SMALL)


# One 4-step run, the first test's subject and the second's uninterrupted reference (a PPO run
# starts Ray, a 2-rank policy and a 1-rank critic: about 30 CPU-s before its first step): two
# PPO epochs a step, validation at steps 0 and 4, checkpoints at steps 2 and 4.
FOUR_STEPS = [
    "ppo.max_num_steps=4",
    "ppo.val_period=4",
    "ppo.ppo_epochs=2",
    "checkpointing.save_period=2",
]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The run folder (``run/``, ``ckpt/``) and the finished process of one `nrl run ppo` of
    FOUR_STEPS."""
    path = tmp_path_factory.mktemp("ppo")
    return path, run_ppo(path, *FOUR_STEPS, quiet=False)


def test_four_steps_train_the_critic_then_the_policy(four_steps, tmp_path):
    path, result = four_steps
    assert "critic: 1 dtensor rank ready" in result.stdout, result.stdout
    assert "value loss" in result.stdout and "expl var" in result.stdout  # the console line
    records = {r["step"]: r for r in metrics(path)}
    assert sorted(records) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        record = records[step]
        for key in CRITIC_KEYS:
            if key == "train/explained_variance" and record["train/reward_std"] == 0:
                # Returns that do not vary leave nothing to explain: null, never a made-up
                # number (a tiny model one warm-up step in is usually wrong everywhere).
                assert record[key] is None, (step, record[key])
                continue
            assert math.isfinite(record[key]), (step, key, record.get(key))
        assert record["train/value_loss"] > 0 and record["timing/critic_s"] > 0
    assert records[1]["train/value_loss"] > 0 and records[1]["train/returns_mean"] > 0
    # Step 1 trains the critic only; the fresh critic's values are 0, so it explains nothing.
    assert records[1]["train/critic_warmup"] == 1 and "train/loss" not in records[1]
    if records[1]["train/explained_variance"] is not None:
        assert records[1]["train/explained_variance"] == pytest.approx(0.0, abs=1e-9)
    assert "train/loss" in records[2] and "train/critic_warmup" not in records[2]
    step = path / "ckpt" / "step_4"
    assert (step / "critic").is_dir() and (step / "policy").is_dir()

    # The charts go to a copy: the shared run folder stays as the run left it.
    run = tmp_path / "run"
    shutil.copytree(path / "run", run)
    plot = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "plot", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    for chart in ("value_loss.png", "explained_variance.png", "reward.png"):
        assert (run / chart).stat().st_size > 1000


def test_kill_then_resume_gives_the_uninterrupted_runs_metrics(four_steps, tmp_path):
    """kill -9 once the step-2 checkpoint is written; the resumed run's steps 3 and 4 (policy
    and critic restored with their optimizers) are the uninterrupted run's (the shared
    four-step run)."""
    steps = FOUR_STEPS
    reference = four_steps[0]

    killed = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "ppo",
        "-q",
        f"logger.log_dir={killed}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={killed / 'ckpt'}",
        *SMALL,
        *steps,
    ]
    process = subprocess.Popen(
        command,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    written = killed / "ckpt" / "step_2" / "manifest.json"
    deadline = time.monotonic() + 500
    while not written.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert written.exists(), "the run never wrote its step-2 checkpoint"
    os.killpg(process.pid, signal.SIGKILL)  # the driver and every Ray process of its session
    process.wait(timeout=60)
    assert not (killed / "ckpt" / "step_4").exists(), "the kill came after the run ended"

    resumed_run = run_ppo(killed, *steps, quiet=False)
    assert "resuming from" in resumed_run.stdout + resumed_run.stderr
    expected = {r["step"]: r for r in metrics(reference)}
    resumed = {r["step"]: r for r in metrics(killed)}
    assert sorted(resumed) == sorted(expected) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in (*CRITIC_KEYS, "train/critic_grad_norm", "train/loss", "train/grad_norm"):
            if expected[step][key] is None:  # explained variance of returns that do not vary
                assert resumed[step][key] is None, (step, key)
                continue
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (
                step,
                key,
            )
        # The critic had something to learn: a restore that lost its weights or optimizer
        # would show here.
        assert expected[step]["train/value_loss"] > 0
