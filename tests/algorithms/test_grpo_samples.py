"""GRPO's sample rollouts: what a record holds (prompt, completion, reference answer, reward,
advantage), when they are logged (step 1, every `logger.sample_period` steps, the last step),
and the console table."""

from __future__ import annotations

import time
from types import SimpleNamespace

import attrs
import pytest
import torch
from rich.console import Console

from nrl_core.algorithms.grpo import GRPOTrainer, StepData
from nrl_core.algorithms.rollout import Episode
from nrl_core.algorithms.samples import response_start, sample_records
from nrl_core.config.schema import GRPOConfig, GRPOSection, LoggerConfig
from nrl_core.metrics import MetricsLogger, read_samples

PROMPT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]


def episode(*response, answer="7", reward=1.0, group=0, **fields) -> Episode:
    return Episode(
        group=group,
        task="arithmetic",
        messages=[dict(m) for m in PROMPT] + list(response),
        metadata={"answer": answer, "task": "arithmetic"},
        token_ids=[1, 2, 3],
        prompt_length=3,
        reward=reward,
        **fields,
    )


def generated(content, role="assistant"):
    """A message as the core's rollout appends it: with the ids it was encoded to."""
    return {"role": role, "content": content, "token_ids": [5, 6]}


def test_records_split_prompt_and_completion_and_carry_answer_reward_and_advantage():
    single = episode(generated("7"), reward=1.0, weight_versions=[3, 3, 4])
    multi = episode(
        generated("let me check"), generated("it is 7", role="user"), generated("7"), reward=0.5
    )
    # An agent's trajectory: responses without ids, `context` messages between them.
    agent = episode(
        {"role": "assistant", "content": "call"},
        {"role": "context", "content": "result"},
        {"role": "assistant", "content": "7"},
        answer=None,
    )
    over_budget = episode(finish_reason="length", reward=0.0)  # nothing generated
    records = sample_records([single, multi, agent, over_budget], [1.5, -0.5, 0.0, -1.0])

    assert records[0] == {
        "task": "arithmetic",
        "prompt": PROMPT,
        "completion": "7",
        "answer": "7",
        "reward": 1.0,
        "advantage": 1.5,
        "finish_reason": "stop",
        "weight_versions": [[3, 2], [4, 1]],  # two tokens of version 3, then one of 4
        "partial": False,
    }
    assert records[1]["weight_versions"] == []  # unknown: no version recorded
    assert "age" not in records[1] and "is_weight" not in records[1]  # synchronous: unknown
    assert records[1]["prompt"] == PROMPT
    assert records[1]["completion"] == "assistant: let me check\nuser: it is 7\nassistant: 7"
    assert records[1]["advantage"] == -0.5
    assert records[2]["prompt"] == PROMPT and records[2]["answer"] is None
    assert records[2]["completion"] == "assistant: call\ncontext: result\nassistant: 7"
    assert records[3]["prompt"] == PROMPT and records[3]["completion"] == ""
    assert "advantage" not in sample_records([single])[0]  # validation: no advantage


def test_an_async_record_carries_age_partial_and_importance_weights():
    weights = {"mean": 1.25, "min": 0.5, "max": 2.0}
    late = episode(
        generated("7"), weight_versions=[3, 3, 4], partial=True, age=2, is_weight=weights
    )
    record = sample_records([late])[0]
    assert record["partial"] is True and record["age"] == 2
    assert record["is_weight"] == weights


def test_a_few_shot_prompt_keeps_its_assistant_turns():
    few_shot = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "3+4="},
    ]
    assert response_start([*few_shot, generated("7")]) == 3
    assert response_start([*few_shot, {"role": "assistant", "content": "7"}]) == 3  # agent
    assert response_start(few_shot) == 3


def trainer(tmp_path, console, *, period=2, steps=5, **logger):
    config = attrs.evolve(
        GRPOConfig(),
        grpo=GRPOSection(max_num_steps=steps),
        logger=LoggerConfig(log_dir=str(tmp_path), sample_period=period, **logger),
    )
    session = SimpleNamespace(
        config=config,
        gate=None,
        metrics=MetricsLogger(tmp_path / "run", config.logger),
        console=console,
    )
    return GRPOTrainer(session)


def step_data(rewards):
    episodes = [episode(generated(f"answer {r}"), reward=r) for r in rewards]
    tensor = torch.tensor(rewards)
    advantages = tensor - tensor.mean()
    return StepData(episodes, tensor, advantages, torch.ones(len(rewards)), 0.0)


def test_samples_are_logged_at_step_1_every_period_and_the_last_step(tmp_path):
    console = Console(record=True, width=200)
    grpo = trainer(tmp_path, console, period=2, steps=5, num_samples=3)
    data = step_data([1.0, 0.0, 0.0, 1.0, 0.0])
    for step in range(1, 6):
        metrics = grpo.close_step(step, data, {}, step_start=time.perf_counter(), timings={})
        assert "timing/step_s" in metrics

    records = read_samples(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 5, 5, 5]
    assert {r["split"] for r in records} == {"train"}
    first = records[0]
    assert first["prompt"] == PROMPT and first["completion"] == "answer 1.0"
    assert first["answer"] == "7" and first["reward"] == 1.0
    assert [r["advantage"] for r in records[:3]] == pytest.approx([0.6, -0.4, -0.4])

    # The console shows the same rows above the progress bar, one table per logged step.
    text = console.export_text()
    assert [line.split()[3] for line in text.splitlines() if "samples at step" in line] == [
        "1",
        "2",
        "4",
        "5",
    ]
    assert "answer 1.0" in text and "+0.600" in text and "-0.400" in text


def test_quiet_or_print_samples_false_prints_nothing_but_still_logs(tmp_path):
    quiet = Console(record=True, quiet=True)
    grpo = trainer(tmp_path / "quiet", quiet)
    grpo.close_step(1, step_data([1.0, 0.0]), {}, step_start=time.perf_counter(), timings={})
    assert quiet.export_text() == ""
    assert len(read_samples(tmp_path / "quiet" / "run")) == 2

    loud = Console(record=True)
    grpo = trainer(tmp_path / "off", loud, print_samples=False)
    grpo.close_step(1, step_data([1.0, 0.0]), {}, step_start=time.perf_counter(), timings={})
    assert loud.export_text() == ""
    assert len(read_samples(tmp_path / "off" / "run")) == 2


def test_sample_period_0_logs_no_samples(tmp_path):
    grpo = trainer(tmp_path, Console(record=True), period=0, steps=1)
    grpo.close_step(1, step_data([1.0, 0.0]), {}, step_start=time.perf_counter(), timings={})
    assert read_samples(tmp_path / "run") == []
