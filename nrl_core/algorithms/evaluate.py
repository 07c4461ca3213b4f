"""``nrl eval``: score a model or an nrl checkpoint on a dataset with an environment.

The evaluation runs on the training runtime (:class:`~nrl_core.algorithms.runtime.RunSession`:
cluster, tokenizer, data, policy workers, generation backend, environment actors) and the same
rollout engine as GRPO, so a model is evaluated exactly as it is validated during training.
Each problem of the dataset's validation split gets ``eval.num_samples`` responses sampled at
``generation.temperature``; the environment's reward decides which are correct.

Metrics (see :func:`score`): ``accuracy`` (the fraction of all responses that are correct: the
unbiased pass@1), ``pass@k`` for each ``k`` of ``eval.pass_k``, the mean reward and the mean
response length, overall and per task, plus each environment's own metrics.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from math import comb
from pathlib import Path
from statistics import fmean
from typing import Any

import attrs
import torch

from nrl_core.algorithms.grpo import sampling_params
from nrl_core.algorithms.recipes import resolve_eval_config
from nrl_core.algorithms.rollout import Episode, rollout, start_episodes
from nrl_core.algorithms.runtime import RunSession
from nrl_core.algorithms.samples import sample_records
from nrl_core.checkpoint import POLICY_CHECKPOINT
from nrl_core.config.schema import EvalConfig
from nrl_core.errors import ConfigError
from nrl_core.preflight import preflight
from nrl_core.registry import Registry

EVAL_FILE = "eval.json"
ALGORITHM = "eval"


# -- metrics ----------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` responses drawn without replacement from
    ``n``, ``c`` of them correct, is correct: ``1 - C(n-c, k) / C(n, k)``, the unbiased
    estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"). For
    ``n == k`` it is 1 when any response is correct, else 0."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n (n = {n})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def score(
    episodes: Sequence[Episode],
    ks: Sequence[int],
    correct_threshold: float,
    correctness: bool = True,
) -> dict[str, float]:
    """Accuracy, pass@k, reward and length statistics of finished episodes; without
    ``correctness`` (an environment whose reward does not say what is correct: partial credit),
    no accuracy and no pass@k.

    Episodes of one problem share their ``group``; every problem must have the same number of
    responses ``n`` (and every ``k`` must be at most ``n``).
    """
    correct = [e.reward >= correct_threshold for e in episodes]
    by_problem: dict[int, list[bool]] = {}
    for episode, ok in zip(episodes, correct, strict=True):
        by_problem.setdefault(episode.group, []).append(ok)
    sizes = {len(v) for v in by_problem.values()}
    if len(sizes) != 1:
        raise ValueError(f"problems have different numbers of responses: {sorted(sizes)}")
    (n,) = sizes
    metrics = {"num_problems": float(len(by_problem))}
    if correctness:
        metrics["accuracy"] = fmean(correct)
    for k in ks if correctness else ():
        metrics[f"pass@{k}"] = fmean(pass_at_k(n, sum(v), k) for v in by_problem.values())
    metrics.update(
        {
            "reward_mean": fmean(e.reward for e in episodes),
            "response_length_mean": fmean(e.response_length for e in episodes),
            "truncated_fraction": fmean(e.truncated for e in episodes),
            "finished_fraction": fmean(e.finish_reason == "stop" for e in episodes),
            "turns_mean": fmean(e.turns for e in episodes),
            "env_errors": float(sum(e.env_errors for e in episodes)),
        }
    )
    return metrics


# -- what is evaluated ------------------------------------------------------------------------


def pass_ks(config: EvalConfig) -> list[int]:
    """The k of each pass@k, checked against ``eval.num_samples``."""
    n = config.eval.num_samples
    ks = sorted(set(config.eval.pass_k or [1, n]))
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ConfigError(
            f"eval.pass_k={bad} must lie in 1..eval.num_samples ({n}); raise eval.num_samples "
            "or drop those k"
        )
    if n > 1 and config.generation.temperature == 0.0:
        raise ConfigError(
            f"eval.num_samples={n} with generation.temperature=0 samples one response {n} "
            "times; set a temperature > 0 or eval.num_samples=1"
        )
    return ks


def checkpoint_step(config: EvalConfig) -> Path | None:
    """The ``step_N`` folder to load: ``eval.checkpoint``, or ``policy.model_name`` when that
    is an nrl checkpoint (a ``step_N`` folder or a checkpoint directory: its best checkpoint by
    ``checkpointing.metric_name``, else its newest) rather than a Hugging Face model folder;
    ``None`` for a Hugging Face model."""
    from nrl_core.checkpoint import CheckpointManager, find_step_folder, is_step_folder

    ranking = config.checkpointing.metric_name, config.checkpointing.higher_is_better
    if config.eval.checkpoint:
        return find_step_folder(config.eval.checkpoint, *ranking)
    path = Path(config.policy.model_name)
    if path.is_dir() and (is_step_folder(path) or CheckpointManager(path).latest() is not None):
        return find_step_folder(path, *ranking)
    return None


def with_checkpoint_policy(config: EvalConfig, step: Path, registry: Registry) -> EvalConfig:
    """``config`` whose policy is the model of checkpoint ``step``: the keys that define the
    model come from the run config saved in the checkpoint; how it runs (ranks, batch sizes,
    sequence budget, actor_env) stays as ``config`` sets it."""
    from nrl_core.checkpoint import detect_format, saved_config

    _, saved = saved_config(step, registry, None)
    detect_format(step, saved.policy.backend)
    policy = attrs.evolve(
        config.policy,
        backend=saved.policy.backend,
        model_name=saved.policy.model_name,
        tokenizer_name=saved.policy.tokenizer_name,
        precision=saved.policy.precision,
        options=dict(saved.policy.options),
    )
    return attrs.evolve(config, policy=policy)


def output_path(config: EvalConfig) -> Path:
    if config.eval.output:
        return Path(config.eval.output)
    return Path(config.logger.log_dir) / config.logger.run_name / EVAL_FILE


# -- the evaluation ---------------------------------------------------------------------------


def evaluate(
    config: EvalConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Evaluate ``config``'s model (or checkpoint); write and return the ``eval.json`` record."""
    from rich.console import Console

    ks = pass_ks(config)
    step = checkpoint_step(config)
    if step is not None:
        config = with_checkpoint_policy(config, step, registry)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    console = Console(quiet=quiet)
    session = RunSession(config, registry, algorithm=ALGORITHM, console=console)
    try:
        preflight(config, registry)
        # The run set-up of training, without resume: an evaluation never continues one.
        session._setup()
        if not session.val_samples:
            raise ConfigError(
                f"data.dataset={config.data.dataset} has no validation samples to evaluate "
                "(set data.val_dataset, data.val_fraction or data.max_val_samples)"
            )
        if step is not None:
            session.policy.load_checkpoint(str(step.resolve() / POLICY_CHECKPOINT))
        session.refit()  # separate engines (vLLM, SGLang) get the policy's weights
        episodes = roll_out(session, config)
        record = build_record(config, step, ks, episodes, session)
        session.log(0, _flat("eval", record["metrics"], record["tasks"]))
        if config.logger.sample_period:
            # The responses themselves, like a validation pass's: what two evaluations of one
            # checkpoint (two backends) can be compared on response by response.
            chosen = episodes[: config.logger.num_samples]
            session.metrics.log_samples(0, sample_records(chosen), split="eval")
        path = output_path(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        record["path"] = str(path)
        console.print(results_table(record, verbose=verbose))
        return record
    finally:
        session.close()


def roll_out(session: RunSession, config: EvalConfig) -> list[Episode]:
    """``eval.num_samples`` responses to every validation problem, ``eval.batch_size``
    responses per rollout call (whole problems at a time)."""
    n = config.eval.num_samples
    samples = session.val_samples
    per_call = max(1, config.eval.batch_size // n) if config.eval.batch_size > 0 else len(samples)
    params = sampling_params(config, session.tokenizer, step=0)
    episodes: list[Episode] = []
    for index, start in enumerate(range(0, len(samples), per_call)):
        chunk = start_episodes(samples[start : start + per_call], session.codec, n)
        for episode in chunk:
            episode.group += start  # one group per problem over the whole set
        rollout(
            chunk,
            session.generate,
            session.env_pool,
            session.codec,
            # Each call its own seed: its problems must not replay the previous call's draws.
            attrs.evolve(params, seed=params.seed + 7919 * index),
            max_turns=config.eval.max_rollout_turns,
            max_total_length=config.policy.max_total_sequence_length,
        )
        episodes.extend(chunk)
    return episodes


def build_record(
    config: EvalConfig,
    step: Path | None,
    ks: Sequence[int],
    episodes: Sequence[Episode],
    session: RunSession,
) -> dict[str, Any]:
    """What ``eval.json`` holds: what was evaluated, how, and the metrics."""
    threshold = config.eval.correct_threshold
    tasks: dict[str, Any] = {}
    correct = {t: session.env_pool.defines_correctness(t) for t in {e.task for e in episodes}}
    for task in sorted(correct):
        chosen = [e for e in episodes if e.task == task]
        metrics = score(chosen, ks, threshold, correct[task])
        # The environment's own metrics (e.g. math's timeout fraction), as in training.
        env = session.env_pool.metrics(
            task,
            {
                "rewards": [e.reward for e in chosen],
                "group_ids": [e.group for e in chosen],
                "metadata": [e.metadata for e in chosen],
                "finish_reasons": [e.finish_reason for e in chosen],
                "response_lengths": [e.response_length for e in chosen],
            },
        )
        tasks[task] = {**metrics, "env": {k: float(v) for k, v in env.items()}}
    gen = config.generation
    return {
        "model": config.policy.model_name,
        "checkpoint": str(step.resolve()) if step is not None else None,
        "dataset": config.data.dataset,
        "val_dataset": config.data.val_dataset,
        "environment": config.env.name,
        "num_samples": config.eval.num_samples,
        "pass_k": list(ks),
        "correct_threshold": threshold,
        # The environment says its reward is correctness (else no accuracy, no pass@k).
        "defines_correctness": all(correct.values()),
        "generation": {
            "backend": gen.backend,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "max_new_tokens": gen.max_new_tokens,
        },
        "seed": config.seed,
        "metrics": score(episodes, ks, threshold, all(correct.values())),
        "tasks": tasks,
    }


def _flat(prefix: str, metrics: dict[str, float], tasks: dict[str, Any]) -> dict[str, float]:
    flat = {f"{prefix}/{k}": v for k, v in metrics.items()}
    for task, values in tasks.items():
        for key, value in values.items():
            if key == "env":
                flat.update({f"{prefix}/{task}/env/{k}": v for k, v in value.items()})
            else:
                flat[f"{prefix}/{task}/{key}"] = value
    return flat


def results_table(record: dict[str, Any], *, verbose: bool = False):
    """The metrics as a rich table: overall, then per task when there are several (and the
    environments' own metrics with ``verbose``)."""
    from rich.table import Table

    what = record["checkpoint"] or record["model"]
    table = Table(
        title=f"nrl eval: {what}",
        caption=f"{record['dataset']} scored by {record['environment']}: "
        f"{record['num_samples']} responses per problem, temperature "
        f"{record['generation']['temperature']}",
        min_width=60,
    )
    columns = ["all"] + (list(record["tasks"]) if len(record["tasks"]) > 1 else [])
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    rows = ["num_problems", "accuracy", *[f"pass@{k}" for k in record["pass_k"]]]
    rows += ["reward_mean", "response_length_mean", "truncated_fraction", "finished_fraction"]
    rows += ["turns_mean"]
    rows += ["env_errors"]
    values = [record["metrics"]] + [record["tasks"][t] for t in columns[1:]]
    for key in rows:
        if any(key in v for v in values):  # accuracy, pass@k: where correctness is defined
            table.add_row(key, *(_fmt(key, v[key]) if key in v else "-" for v in values))
    if verbose:
        for task, values in record["tasks"].items():
            for key, value in values["env"].items():
                table.add_row(f"{task} env: {key}", _fmt(key, value), *[""] * (len(columns) - 1))
    return table


def _fmt(key: str, value: float) -> str:
    if key in ("num_problems", "env_errors"):
        return str(int(value))
    return f"{value:.4f}" if key != "response_length_mean" else f"{value:.1f}"


__all__ = ["evaluate", "pass_at_k", "resolve_eval_config", "score"]
