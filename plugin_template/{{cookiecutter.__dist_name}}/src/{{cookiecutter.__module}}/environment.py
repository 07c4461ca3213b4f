"""The environment: scores the model's answer against the reversed word."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.data import Message
from nrl_core.interfaces import ComponentContext, EnvStep

from {{ cookiecutter.__module }}.config import {{ cookiecutter.__class_prefix }}EnvConfig


def score(response: str, answer: str, partial_credit: float) -> float:
    """1.0 for the exact answer; otherwise ``partial_credit`` times the fraction of positions
    holding the right character (a dense signal a small model can climb)."""
    guess = response.strip().splitlines()[0].strip() if response.strip() else ""
    if guess == answer:
        return 1.0
    right = sum(a == b for a, b in zip(guess, answer, strict=False))
    return partial_credit * right / max(len(answer), len(guess), 1)


class {{ cookiecutter.__class_prefix }}Environment:
    """Single turn: each response gets :func:`score` and the episode ends.

    Runs as a Ray actor, built as ``{{ cookiecutter.__class_prefix }}Environment(options, context)``; the reference
    answer arrives in each sample's ``metadata["answer"]``.
    """

    def __init__(self, options: {{ cookiecutter.__class_prefix }}EnvConfig | None, context: ComponentContext) -> None:
        self.options = options or {{ cookiecutter.__class_prefix }}EnvConfig()
        self.context = context

    def step(
        self, conversations: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> list[EnvStep]:
        """Score the last (assistant) message of each conversation."""
        steps = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            if not conversation or conversation[-1].get("role") != "assistant":
                raise ValueError("the conversation must end with the assistant's response")
            response = conversation[-1].get("content") or ""
            reward = score(response, str(meta["answer"]), self.options.partial_credit)
            steps.append(EnvStep(reward=reward, terminated=True))
        return steps

    def metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """Share of exactly right answers (``batch["rewards"]`` holds the rewards)."""
        rewards = list(batch.get("rewards") or [])
        if not rewards:
            return {}
        return {"exact": sum(r == 1.0 for r in rewards) / len(rewards)}
