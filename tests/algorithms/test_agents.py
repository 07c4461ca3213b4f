"""Agent-driven rollouts in `nrl run grpo`: an agent calls the run's own OpenAI-compatible
endpoint over HTTP, next to a task rolled out by the core's loop (data.tasks), through the
real CLI, 2 policy ranks, local Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.testing.agents import NRL_WITH_TEST_AGENTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TASKS = (
    "data.tasks=[{name: arith, dataset: arithmetic, weight: 1},"
    " {name: chat, dataset: arithmetic, weight: 1, agent: two_turn}]"
)


def run_grpo(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-c",
        NRL_WITH_TEST_AGENTS,
        "run",
        "grpo",
        "-q",
        f"logger.log_dir={tmp_path}",
        "logger.run_name=run",
        "checkpointing.enabled=false",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
        "grpo.sft_warmup_steps=0",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "data.max_val_samples=4",
        "cluster.num_cpus=2",
        *overrides,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )


def test_an_agent_task_and_a_core_loop_task_train_together(tmp_path):
    result = run_grpo(tmp_path, TASKS)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # Both tasks drawn (weights 1:1 over 4 prompts; the draws are seeded) and scored.
        assert {"train/arith/reward_mean", "train/chat/reward_mean"} <= set(record)
        # Every agent trajectory continued exactly the ids sampled before it.
        assert record["train/noncontiguous"] == 0
        assert record["train/agent_failures"] == 0
        # ... per agent-driven task too (the core's loop has no such counts).
        assert record["train/chat/noncontiguous"] == record["train/chat/agent_failures"] == 0
        assert "train/arith/noncontiguous" not in record
        # The agent's own numbers, per task (Trajectory.metrics).
        assert record["train/chat/agent/final_lines"] >= 1
        assert record["train/loss"] == record["train/loss"]  # a number, not NaN
    last = records[-1]
    # An agent's reward is not taken for an accuracy: that task logs its reward only, and
    # the run no overall accuracy.
    assert {"val/arith/accuracy", "val/chat/reward_mean"} <= set(last)
    assert "val/chat/accuracy" not in last and "val/accuracy" not in last
    # The agent's episodes are two model calls each.
    assert any(r.get("train/turns_mean", 1) > 1 for r in steps)


def test_an_unknown_agent_in_a_task_is_one_line_before_anything_starts(tmp_path):
    bad = TASKS.replace("two_turn", "no_such_agent")
    result = run_grpo(tmp_path, bad)
    assert result.returncode == 2
    assert "data.tasks[1].agent" in result.stderr and "no_such_agent" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
