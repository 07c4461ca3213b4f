"""Sample rollouts as ``samples.jsonl`` records: the prompt, the response text, the answer, the
reward and advantage of each logged episode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.algorithms.rollout import (
    Episode,
)


def sample_records(
    episodes: Sequence[Episode], advantages: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """The ``samples.jsonl`` fields of ``episodes``: ``task``, ``prompt`` (the chat messages
    before the response), ``completion`` (the response text; a multi-turn one as ``role:
    content`` lines with the observations between), ``answer`` (the sample's reference, None
    without one), ``reward``, ``advantage`` (when ``advantages``, aligned with ``episodes``, are
    given), ``finish_reason``, ``weight_versions`` (the versions of the weights that
    generated the response's tokens, as ``[version, tokens]`` runs in token order; empty when
    unknown), ``partial`` (whether a response was continued across generate calls), and,
    where known, ``age`` (optimizer steps between the oldest weights that generated it and the
    weights that trained it) and ``is_weight`` (``mean``, ``min``, ``max`` of its tokens'
    importance weights ``exp(old - gen)``)."""
    records = []
    for index, e in enumerate(episodes):
        cut = response_start(e.messages)
        response = e.messages[cut:]
        record: dict[str, Any] = {
            "task": e.task,
            "prompt": [{"role": m["role"], "content": m["content"]} for m in e.messages[:cut]],
            "completion": (
                str(response[0]["content"])
                if len(response) == 1
                else "\n".join(f"{m['role']}: {m['content']}" for m in response)
            ),
            "answer": e.metadata.get("answer"),
            "reward": float(e.reward),
        }
        if advantages is not None:
            record["advantage"] = float(advantages[index])
        record["finish_reason"] = e.finish_reason
        record["weight_versions"] = version_runs(e.weight_versions)
        record["partial"] = e.partial
        if e.age is not None:
            record["age"] = e.age
        if e.is_weight is not None:
            record["is_weight"] = dict(e.is_weight)
        records.append(record)
    return records


def response_start(messages: Sequence[dict[str, Any]]) -> int:
    """Index of the first message of the response in an episode's ``messages``.

    The rollout gives every message it appends (responses, observations) its ``token_ids``; an
    agent's trajectory appends ``context`` messages between its responses (see
    :func:`~nrl_core.algorithms.rollout.apply_trajectory`). The response starts at the first
    such message, or at the trailing assistant messages before it: an agent's responses carry
    no ids, while a prompt (even one with few-shot assistant turns) ends with a user turn.
    """
    cut = next(
        (i for i, m in enumerate(messages) if "token_ids" in m or m.get("role") == "context"),
        len(messages),
    )
    if cut < len(messages) and "token_ids" in messages[cut]:
        return cut
    while cut > 0 and messages[cut - 1].get("role") == "assistant":
        cut -= 1
    return cut


def version_runs(versions: Sequence[int]) -> list[list[int]]:
    """``versions`` as ``[version, count]`` runs, in order: ``[3, 3, 4]`` -> ``[[3, 2], [4, 1]]``."""
    runs: list[list[int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([int(version), 1])
    return runs
