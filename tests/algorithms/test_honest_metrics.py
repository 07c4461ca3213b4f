"""Issue 39: "val accuracy" was the mean reward of a partial-credit environment. Accuracy (and
pass@k) only where the environment defines correctness; elsewhere the mean reward, in the
metrics, the console, `nrl plot` and `nrl eval` alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nrl_core.algorithms.evaluate import score
from nrl_core.algorithms.rollout import Episode
from nrl_core.environments import EnvironmentActor, ExactMatchEnvironment
from nrl_core.reward_fn import RewardFnConfig

PARTIAL = "def score(prompt, completion, answer, **row):\n    return 0.5\n"
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]


def _episode(group: int, reward: float) -> Episode:
    episode = Episode(group, "t", [], {}, token_ids=[1, 2, 3], prompt_length=3)
    episode.append([7, 7], generated=True)
    episode.reward, episode.turns = reward, 1
    return episode


def test_score_without_correctness_has_no_accuracy_and_no_pass_at_k():
    episodes = [_episode(0, 0.5), _episode(0, 0.25), _episode(1, 0.0), _episode(1, 0.5)]
    with_it = score(episodes, [1, 2], 1.0, correctness=True)
    without = score(episodes, [1, 2], 1.0, correctness=False)
    assert with_it["accuracy"] == 0.0 and "pass@2" in with_it
    assert "accuracy" not in without and not any(k.startswith("pass@") for k in without)
    assert without["reward_mean"] == pytest.approx(0.3125)


def test_environments_declare_correctness(tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text(PARTIAL)
    assert ExactMatchEnvironment.defines_correctness is True
    from nrl_math_env.arithmetic import ArithmeticEnvironment
    from nrl_math_env.math_env import MathEnvironment

    assert ArithmeticEnvironment.defines_correctness and MathEnvironment.defines_correctness
    for correctness in (False, True):
        actor = EnvironmentActor(
            "nrl_core.reward_fn:RewardFunctionEnvironment",
            RewardFnConfig(path=f"{reward}:score", correctness=correctness),
            None,
        )
        assert actor.defines_correctness() is correctness


def test_plot_draws_the_validation_reward_where_there_is_no_accuracy(tmp_path):
    pytest.importorskip("matplotlib", reason="nrl plot needs the plot extra")
    from nrl_core.cli.plot import draw_charts, load_runs

    for name, keys in (
        ("partial", ["val/reward_mean"]),
        ("exact", ["val/reward_mean", "val/accuracy"]),
    ):
        run = tmp_path / name
        run.mkdir()
        lines = [
            {"step": s, "train/reward_mean": 0.1 * s, **dict.fromkeys(keys, 0.2 * s)}
            for s in range(3)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    partial = draw_charts(load_runs([tmp_path / "partial"]))
    exact = draw_charts(load_runs([tmp_path / "exact"]))
    assert "val_reward" in partial.figures and "val_accuracy" not in partial.figures
    assert "val_accuracy" in exact.figures and "val_reward" not in exact.figures


@pytest.mark.slow
def test_a_partial_credit_reward_fn_run_and_eval_say_reward_not_accuracy(tmp_path):
    (tmp_path / "my_reward.py").write_text(PARTIAL)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    common = [
        "data.dataset=prompts",
        "data.prompts.path=prompts.jsonl",
        "env.name=reward_fn",
        "env.reward_fn.path=my_reward.py:score",
        "policy.num_workers=1",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "run", "grpo", *common, "grpo.max_num_steps=2",
         "grpo.sft_warmup_steps=0", "grpo.val_period=1", "grpo.num_prompts_per_step=4",
         "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=4", "logger.log_dir=runs", "logger.run_name=r"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "runs/r/metrics.jsonl").read_text().splitlines()]
    validated = [r for r in records if "val/reward_mean" in r]
    assert [r["step"] for r in validated] == [0, 1, 2]
    assert all(r["val/reward_mean"] == 0.5 for r in validated)
    assert not any(k.endswith("accuracy") for r in records for k in r), records
    console = run.stdout
    assert "val reward 0.500" in console and "val acc" not in console, console[-3000:]
    assert "mean reward 0.500" in console and "accuracy" not in console.lower(), console[-3000:]

    checkpoint = sorted((tmp_path / "runs/r/checkpoints").glob("step_*"))[-1]
    evaluated = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "eval", *common, f"eval.checkpoint={checkpoint}",
         "eval.num_samples=2", "eval.pass_k=[1,2]", "eval.output=eval.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["defines_correctness"] is False
    assert record["metrics"]["reward_mean"] == 0.5 and "accuracy" not in record["metrics"]
    assert "reward_mean" in evaluated.stdout and "accuracy" not in evaluated.stdout
    assert "pass@" not in evaluated.stdout
