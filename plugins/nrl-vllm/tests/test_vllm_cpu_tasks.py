"""Multi-turn and agent rollouts, and ``nrl eval``, with vLLM's CPU build as the engine.

One ``nrl run grpo generation.backend=vllm`` trains two tasks together (``data.tasks``): the
``guess_number`` game, rolled out by the core's multi-turn loop on the engine, and an
arithmetic task driven by an agent (``two_turn`` of :mod:`nrl_core.testing.agents`) that calls
the run's in-run OpenAI endpoint over HTTP, served by the same engine. Its last checkpoint is
then evaluated by ``nrl eval`` on both backends, greedy: the same metrics.

Marked ``vllm_cpu`` (see ``conftest.py``); the policy is nrl-dtensor's and the game is
nrl-math-env's (``nox -s plugin-vllm`` installs both next to nrl-vllm).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.testing.agents import NRL_WITH_TEST_AGENTS

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_LOGPROB_GAP = 1e-4
"""Engine vs trainer, float32 (measured: max 1.7-1.9e-6; see test_vllm_cpu.py)."""

TASKS = (
    "data.tasks=[{name: game, dataset: guess_number, env: guess_number, weight: 1},"
    " {name: chat, dataset: arithmetic, weight: 1, agent: two_turn}]"
)


def _env() -> dict[str, str]:
    return {**os.environ, "NRL_ACTOR_ENV": "system"}


@pytest.fixture(scope="module")
def tasks_run(tmp_path_factory) -> Path:
    """The run folder of a 2-step GRPO run of both tasks on one vLLM engine; its checkpoint of
    step 2 is in ``<run>/ckpt``."""
    pytest.importorskip("nrl_dtensor", reason="the policy is nrl-dtensor's; nox installs it")
    pytest.importorskip("nrl_math_env", reason="guess_number is nrl-math-env's")
    tmp = tmp_path_factory.mktemp("tasks")
    command = [sys.executable, "-c", NRL_WITH_TEST_AGENTS, "run", "grpo", "-q"]
    command += ["generation.backend=vllm", "generation.actor_env=venv", TASKS]
    command += [f"logger.log_dir={tmp}", "logger.run_name=run", "cluster.num_cpus=2"]
    command += [f"checkpointing.checkpoint_dir={tmp / 'run' / 'ckpt'}"]
    # One policy rank (CI time: a rank is a process importing torch and the model, ~5 CPU-s):
    # the tasks' rollouts and the refit are the engine's, whatever the rank count
    # (test_vllm_cpu_cli.py's 3-step run refits the engine from two ranks).
    command += ["policy.num_workers=1"]
    # SFT warm-up steps move the policy away from the weights the engine loaded from the model
    # folder: a refit that did not happen shows in step 1's gen_logprob_error. 30 of them (the
    # recipe's count) also make the checkpoint's greedy answers depend on the problem (measured
    # with the torch backend: "1" or "11" by the size of the sum, where 12 steps answer "1" to
    # every problem and 4 steps stop at once), so the eval comparison below has answers to compare.
    # Validation every step: each step's rollouts follow a validation (on one refit's weights
    # when no policy call came between, else refitted; nrl_core.memory_contract checks it).
    command += ["grpo.sft_warmup_steps=30", "grpo.max_num_steps=2", "grpo.val_period=1"]
    command += ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4"]
    command += ["policy.train_global_batch_size=16", "policy.train_micro_batch_size=8"]
    command += ["policy.max_total_sequence_length=256", "data.max_val_samples=4"]
    # The game: up to 4 guesses, each a number and a newline.
    command += ["grpo.max_rollout_turns=4", "env.guess_number.max_turns=4"]
    command += ['generation.stop_strings=["\\n"]', 'env.guess_number.stop_strings=["\\n"]']
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / "run"


def test_multi_turn_game_and_agent_task_train_on_the_vllm_engine(tasks_run):
    """Both tasks are drawn and scored every step; the game takes several turns and the agent
    two model calls through the endpoint, each continuing exactly the ids sampled before it;
    the engine is refit every step and its logprobs equal the trainer's."""
    rows = [json.loads(line) for line in (tasks_run / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "train/gen_logprob_error" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert {"train/game/reward_mean", "train/chat/reward_mean"} <= set(row)
        assert row["train/game/mean_turns"] > 1
        assert row["train/noncontiguous"] == 0 and row["train/agent_failures"] == 0
        assert row["refit/bytes"] > 0 and row["timing/refit_s"] > 0
        assert row["train/gen_logprob_error_max"] < math.exp(MAX_LOGPROB_GAP), row
    # The agent's episodes are two model calls each, the game's up to 4 turns.
    assert all(1 < r["train/turns_mean"] <= 4 for r in steps)
    # Validated per task: the game's environment defines correctness, an agent's task is scored
    # by reward only, so the run as a whole claims no accuracy (issue 39's honest names).
    assert [r["step"] for r in rows if "val/chat/reward_mean" in r] == [0, 1, 2]
    assert {"val/game/accuracy", "val/chat/reward_mean"} <= set(rows[-1])
    assert not {"val/chat/accuracy", "val/accuracy"} & set(rows[-1])


def _eval(run: Path | None, out: Path, backend: str) -> tuple[dict, list[dict]]:
    """``nrl eval`` of ``run``'s checkpoint (None: the model folder's weights, untrained),
    greedy, on ``backend``: its ``eval.json`` record and its responses (``samples.jsonl``)."""
    command = [sys.executable, "-m", "nrl_core.cli", "eval", "-q", f"eval.output={out}"]
    if run is not None:
        command += [f"eval.checkpoint={run / 'ckpt'}"]
    command += [f"logger.log_dir={out.parent}", f"logger.run_name={out.stem}", "cluster.num_cpus=2"]
    command += ["generation.temperature=0", "eval.num_samples=1", "data.max_val_samples=16"]
    command += ["logger.num_samples=16", f"generation.backend={backend}"]
    if backend == "vllm":
        command += ["generation.actor_env=venv"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (out.parent / out.stem / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) == 16 and {s["split"] for s in samples} == {"eval"}
    return json.loads(out.read_text()), samples


def _responses(samples: list[dict]) -> list[tuple]:
    return [(s["prompt"], s["completion"], s["finish_reason"]) for s in samples]


def test_nrl_eval_of_a_checkpoint_with_vllm_equals_the_torch_backend(tasks_run, tmp_path):
    """``nrl eval`` of the run's checkpoint, greedy: vLLM (the engine refit from the loaded
    checkpoint) gives every problem the same response as the torch backend (generation inside
    the policy workers), character for character (the tiny tokenizer's tokens), hence the same
    metrics. The model folder's weights, which an engine that missed the refit would keep,
    answer differently (checked here: else this test could not tell)."""
    torch_record, torch_samples = _eval(tasks_run, tmp_path / "torch.json", "torch")
    vllm_record, vllm_samples = _eval(tasks_run, tmp_path / "vllm.json", "vllm")
    _, initial_samples = _eval(None, tmp_path / "initial.json", "torch")
    assert vllm_record["generation"]["backend"] == "vllm"
    assert vllm_record["checkpoint"] == torch_record["checkpoint"]
    assert torch_record["checkpoint"].endswith("step_2")
    assert _responses(vllm_samples) == _responses(torch_samples)
    # The checkpoint is trained: its answers depend on the problem, and are not the model
    # folder's (whose untrained greedy answers run to max_new_tokens).
    assert len({s["completion"] for s in torch_samples}) > 1, torch_samples
    assert _responses(initial_samples) != _responses(torch_samples), torch_samples
    keys = ["num_problems", "accuracy", "pass@1", "reward_mean", "response_length_mean"]
    keys += ["truncated_fraction", "finished_fraction"]
    assert {k: vllm_record["metrics"].get(k) for k in keys} == {
        k: torch_record["metrics"].get(k) for k in keys
    }
