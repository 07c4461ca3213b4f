"""Episode metrics shared by this plugin's environments (their ``metrics(batch)`` method)."""

from __future__ import annotations

from collections import defaultdict
from math import comb
from statistics import fmean
from typing import Any


def episode_metrics(batch: dict[str, Any]) -> dict[str, float]:
    """Accuracy, pass@k, finished fraction and mean response length of a finished batch.

    Args:
        batch: one entry per sample in each list; only ``rewards`` is required.

            - ``rewards`` (list[float]): each episode's reward. A response is correct when its
              reward is positive (these environments give 1 or 0).
            - ``group_ids`` (list[hashable]): samples of the same prompt share an id (the GRPO
              group). Gives ``pass@k``, where k is the smallest group's size.
            - ``finish_reasons`` (list[str]): the last turn's ``"stop"`` (ended properly) or
              ``"length"`` (cut by max_new_tokens). Gives ``finished_fraction``.
            - ``response_lengths`` (list[int]): generated tokens. Gives
              ``mean_response_length``.

    Returns:
        ``accuracy`` always; the others when their inputs are present.
    """
    correct = [reward > 0 for reward in batch["rewards"]]
    if not correct:
        return {}
    metrics = {"accuracy": fmean(correct)}
    if batch.get("group_ids") is not None:
        groups: dict[Any, list[bool]] = defaultdict(list)
        for group_id, ok in zip(batch["group_ids"], correct, strict=True):
            groups[group_id].append(ok)
        k = min(len(group) for group in groups.values())
        metrics[f"pass@{k}"] = fmean(pass_at_k(len(g), sum(g), k) for g in groups.values())
    if batch.get("finish_reasons") is not None:
        metrics["finished_fraction"] = fmean(r == "stop" for r in batch["finish_reasons"])
    if batch.get("response_lengths") is not None:
        metrics["mean_response_length"] = fmean(batch["response_lengths"])
    return metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` draws (without replacement) from ``n`` responses,
    ``c`` of them correct, is correct: the unbiased estimator of Chen et al. (2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def status_fractions(
    batch: dict[str, Any], key: str, statuses: tuple[str, ...]
) -> dict[str, float]:
    """Fraction of samples whose final ``metadata[key]`` equals each of ``statuses``, as
    ``<status>_fraction`` (empty when the batch carries no ``metadata``)."""
    metadata = batch.get("metadata")
    if not metadata:
        return {}
    return {f"{s}_fraction": fmean(m.get(key) == s for m in metadata) for s in statuses}
