"""GRPO driven by a real NeMo Gym environment, as users run it: `nrl run grpo` with the
plugin's example config, which mixes the core's `arithmetic` task with Gym's
example_single_tool_call (resources server + simple_agent, started from PyPI's nemo-gym in its
own venv with the run's Python and Ray, built on first use; Gym joins the run's Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).parents[3]
CONFIG = REPO / "plugins" / "nrl-gym" / "examples" / "weather_cpu.yaml"


def test_two_grpo_steps_on_a_gym_task_and_arithmetic(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nrl_core.cli",
            "run",
            "grpo",
            "-q",
            "--config",
            str(CONFIG),
            f"logger.log_dir={tmp_path}",
            "cluster.num_cpus=2",
            # One policy rank, not the example's two (a process fewer): what is tested is Gym's
            # servers, its agent and the rewards, not the ranks; Gym keeps the run on Ray.
            "policy.num_workers=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1100,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [
        json.loads(line)
        for line in (tmp_path / "weather-cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert 0.0 <= record["train/weather/reward_mean"] <= 1.0
        assert "train/arithmetic/reward_mean" in record
        # Every Gym row ran, and every model call continued exactly the ids before it.
        assert record["train/agent_failures"] == 0
        assert record["train/noncontiguous"] == 0
        assert record["train/weather/agent_failures"] == record["train/weather/noncontiguous"] == 0
    # Gym's reward is logged as a reward, not taken for an accuracy.
    assert "val/weather/reward_mean" in records[-1]
    assert "val/weather/accuracy" not in records[-1] and "val/accuracy" not in records[-1]
    # Gym joined the run's own Ray cluster instead of starting one (its log is kept).
    gym_log = (tmp_path / "weather-cpu" / "nemo_gym.log").read_text()
    assert "Connecting to Ray cluster at specified address" in gym_log
    assert "starting a new Ray cluster" not in gym_log
    # Validation went through Gym too, greedy (the endpoint enforced temperature 0).
    assert records[-1]["val/agent_failures"] == 0
    # Gym's servers (and its own Ray) were stopped with the run.
    # Only this run's ng_run (its config names the example server): another test file's Gym start
    # may run beside this one (pytest -n 2).
    left = subprocess.run(
        ["pgrep", "-f", "ng_run.*example_single_tool_call"], capture_output=True, text=True
    )
    assert left.stdout.strip() == "", left.stdout
