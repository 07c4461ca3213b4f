"""`nrl eval`: accuracy and pass@k of a model or checkpoint, written to eval.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import attrs
import pytest

from nrl_core.algorithms.evaluate import (
    checkpoint_step,
    pass_at_k,
    resolve_eval_config,
    score,
    with_checkpoint_policy,
)
from nrl_core.algorithms.rollout import Episode
from nrl_core.checkpoint import TRAINER_STATE
from nrl_core.cli import build_parser, main
from nrl_core.config.loader import ConfigConverter, dump_config, parse_yaml, resolve_config
from nrl_core.config.schema import EvalConfig
from nrl_core.errors import ConfigError


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_chance_that_k_of_n_draws_hold_a_correct_one(n):
    for c in range(n + 1):
        responses = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(combinations(responses, k))
            expected = sum(any(d) for d in draws) / len(draws)
            assert pass_at_k(n, c, k) == pytest.approx(expected)
        assert pass_at_k(n, c, n) == (1.0 if c else 0.0)  # n == k: any correct
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    with pytest.raises(ValueError):
        pass_at_k(n, 0, n + 1)


def _episode(group: int, reward: float, generated: int, task: str = "t") -> Episode:
    episode = Episode(group, task, [], {}, token_ids=[1, 2, 3], prompt_length=3)
    episode.append([7] * generated, generated=True)
    episode.reward, episode.turns = reward, 1
    return episode


def test_score_counts_problems_not_responses_for_pass_at_k():
    # Problem 0: 1 of 4 correct; problem 1: none; problem 2: all (reward above the threshold).
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0], [1.0, 1.0, 1.2, 1.0]]
    episodes = [
        _episode(group, reward, generated=group + 1)
        for group, row in enumerate(rewards)
        for reward in row
    ]
    metrics = score(episodes, [1, 2, 4], correct_threshold=1.0)
    assert metrics["num_problems"] == 3
    assert metrics["accuracy"] == pytest.approx(5 / 12)
    assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])
    assert metrics["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert metrics["reward_mean"] == pytest.approx(sum(map(sum, rewards)) / 12)
    assert metrics["response_length_mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="different numbers of responses"):
        score(episodes[:-1], [1], 1.0)


def test_without_config_the_embedded_recipe_evaluates_tiny_on_arithmetic(nrl_registry):
    config = resolve_eval_config(None, ["eval.num_samples=2"], nrl_registry)
    assert isinstance(config, EvalConfig)
    assert (config.policy.model_name, config.data.dataset, config.env.name) == (
        "tiny",
        "arithmetic",
        "arithmetic",
    )
    assert config.eval.num_samples == 2 and config.generation.backend == "torch"
    # The dumped config reads back as the same EvalConfig, and every key is documented.
    again = ConfigConverter(nrl_registry).structure(
        parse_yaml(dump_config(config, nrl_registry)), EvalConfig
    )
    assert again == config
    for cls in (EvalConfig, type(config.eval)):
        assert all(f.metadata.get("doc") for f in attrs.fields(cls) if f.name != "options")


def test_eval_command_line_and_one_line_errors(nrl_registry, capsys):
    args = build_parser().parse_args(["eval", "--config", "e.yaml", "eval.num_samples=8"])
    assert (args.config, args.overrides) == ("e.yaml", ["eval.num_samples=8"])

    assert main(["eval", "--show-config", "-q", "eval.num_samples=3"]) == 0
    shown = parse_yaml(capsys.readouterr().out)
    assert shown["eval"]["num_samples"] == 3 and shown["env"]["name"] == "arithmetic"

    assert main(["eval", "-q", "eval.num_sample=3"]) == ConfigError.exit_code
    assert "did you mean eval.num_samples?" in capsys.readouterr().err
    # Checked before anything starts: no cluster, no model.
    assert main(["eval", "-q", "eval.num_samples=2", "eval.pass_k=[1,4]"]) != 0
    err = capsys.readouterr().err
    assert "eval.pass_k=[4]" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", "-q", "eval.num_samples=2", "generation.temperature=0"]) != 0
    assert "temperature" in capsys.readouterr().err


def _fake_checkpoint(root: Path, step: int, registry, *overrides: str) -> Path:
    """A step folder as RunSession writes it, with a (one-tensor) dtensor-format policy:
    verification reads its weights."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    saved = resolve_config("grpo", None, list(overrides), registry)
    folder = root / f"step_{step}"
    (folder / "policy").mkdir(parents=True)
    with warnings.catch_warnings():  # a one-process save, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(folder / "policy"))
    (folder / "config.yaml").write_text(dump_config(saved, registry))
    (folder / TRAINER_STATE).write_text(json.dumps({"step": step}))
    return folder


def test_a_checkpoint_folder_means_its_best_checkpoint_by_validation(nrl_registry, tmp_path):
    """Issue 53: `nrl eval` of a run's checkpoint folder took the newest step even where an
    older one validated better; now the best by checkpointing.metric_name (null: the newest)."""
    ckpt = tmp_path / "ckpt"
    for step, accuracy in ((1, 0.6), (2, 0.9), (3, 0.7)):
        folder = _fake_checkpoint(ckpt, step, nrl_registry)
        state = {"step": step, "val": {"val/accuracy": accuracy}}
        (folder / TRAINER_STATE).write_text(json.dumps(state))
    config = resolve_eval_config(None, [f"eval.checkpoint={ckpt}"], nrl_registry)
    assert checkpoint_step(config) == ckpt / "step_2"
    config = resolve_eval_config(None, [f"policy.model_name={ckpt}"], nrl_registry)
    assert checkpoint_step(config) == ckpt / "step_2"
    overrides = [f"eval.checkpoint={ckpt}", "checkpointing.metric_name=null"]
    assert checkpoint_step(resolve_eval_config(None, overrides, nrl_registry)) == ckpt / "step_3"


def test_a_checkpoint_brings_its_model_and_keeps_the_eval_run_settings(
    nrl_registry, tmp_path, tiny_model_path
):
    ckpt = tmp_path / "ckpt"
    _fake_checkpoint(ckpt, 1, nrl_registry)
    newest = _fake_checkpoint(
        ckpt,
        2,
        nrl_registry,
        "policy.model_name=/models/base",
        "policy.precision=bfloat16",
        "policy.dtensor.lora_rank=4",
        "policy.num_workers=8",
    )
    config = resolve_eval_config(
        None, [f"eval.checkpoint={ckpt}", "policy.num_workers=2"], nrl_registry
    )
    assert checkpoint_step(config) == newest
    evaluated = with_checkpoint_policy(config, newest, nrl_registry).policy
    assert (evaluated.model_name, evaluated.precision) == ("/models/base", "bfloat16")
    assert evaluated.options["dtensor"].lora_rank == 4
    assert evaluated.num_workers == 2 and evaluated.max_total_sequence_length == 48

    # policy.model_name may name the checkpoint too; a Hugging Face folder or name is no
    # checkpoint.
    for name, expected in [(newest, newest), (ckpt, newest), (tiny_model_path, None)]:
        config = resolve_eval_config(None, [f"policy.model_name={name}"], nrl_registry)
        assert checkpoint_step(config) == expected
    config = resolve_eval_config(None, ["policy.model_name=Qwen/Qwen2.5-0.5B"], nrl_registry)
    assert checkpoint_step(config) is None

    (newest / "policy" / ".metadata").unlink()
    with pytest.raises(ConfigError, match="no known policy checkpoint"):
        with_checkpoint_policy(config, newest, nrl_registry)


@pytest.mark.slow
def test_nrl_eval_on_the_tiny_model_writes_eval_json(tmp_path):
    command = [sys.executable, "-m", "nrl_core.cli", "eval", f"logger.log_dir={tmp_path}"]
    command += ["logger.run_name=ev", "data.arithmetic.validation_size=6", "cluster.num_cpus=2"]
    # 3 responses per problem, rolled out 2 problems (6 responses) per call.
    command += ["eval.num_samples=3", "eval.pass_k=[1,2,3]", "eval.batch_size=6"]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = tmp_path / "ev" / "eval.json"
    assert f"wrote {path}" in done.stdout and "pass@3" in done.stdout

    record = json.loads(path.read_text())
    assert (record["model"], record["dataset"], record["environment"]) == (
        "tiny",
        "arithmetic",
        "arithmetic",
    )
    assert record["num_samples"] == 3 and record["pass_k"] == [1, 2, 3]
    metrics = record["metrics"]
    assert metrics["num_problems"] == 6
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])
    assert metrics["accuracy"] <= metrics["pass@2"] <= metrics["pass@3"] <= 1.0
    assert 0.0 < metrics["response_length_mean"] <= 4  # the recipe's max_new_tokens
    assert metrics["turns_mean"] == 1.0 and metrics["env_errors"] == 0
    task = record["tasks"]["arithmetic"]
    assert task["accuracy"] == metrics["accuracy"]
    # The environment's own metrics agree with ours on the same responses.
    assert task["env"]["accuracy"] == pytest.approx(metrics["accuracy"])
    assert task["env"]["pass@3"] == pytest.approx(metrics["pass@3"])
    # The metrics also go to the run's metrics log, like a training run's.
    logged = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").open()]
    assert logged[-1]["eval/accuracy"] == metrics["accuracy"]
    # And its first logger.num_samples (4) responses to samples.jsonl, like a validation pass.
    samples = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").open()]
    assert [(s["step"], s["split"]) for s in samples] == [(0, "eval")] * 4
    assert all(s["task"] == "arithmetic" and s["answer"] is not None for s in samples)
