"""Small environments for testing the RL loop itself (registered by tests, not by the core).

- :class:`FlakyEnvironment` raises for some samples, to check that environment errors cost
  only those samples (reward 0, counted) and never the run.
- :class:`CountdownEnvironment` keeps a conversation going for a fixed number of turns, with an
  observation, per-turn stop strings and metadata carried across turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.interfaces import EnvStep


class FlakyEnvironment:
    """Exact-match reward on the response's last line; raises ``ValueError`` for every sample
    whose answer is an odd integer."""

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.context = context

    def step(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[EnvStep]:
        steps = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            answer = str(meta.get("answer", "")).strip()
            if answer.lstrip("-").isdigit() and int(answer) % 2:
                raise ValueError(f"flaky environment refuses odd answer {answer}")
            lines = conversation[-1]["content"].strip().splitlines() or [""]
            steps.append(EnvStep(reward=float(lines[-1].strip() == answer)))
        return steps


class CountdownEnvironment:
    """Answers every turn with the observation ``"<n> more"`` until ``turns`` responses were
    given (default 3); the reward is the number of responses that contain a digit.

    Each step returns the next turn's stop strings (``["\\n"]``) and metadata
    ``{"remaining": n, "seen": [...responses...]}`` for the next call.
    """

    def __init__(self, options: Any = None, context: Any = None, turns: int = 3) -> None:
        self.turns = turns

    def step(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[EnvStep]:
        steps = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            remaining = int(meta.get("remaining", self.turns)) - 1
            seen = [*meta.get("seen", []), conversation[-1]["content"]]
            reward = float(any(c.isdigit() for c in conversation[-1]["content"]))
            carried = {**meta, "remaining": remaining, "seen": seen}
            if remaining <= 0:
                steps.append(EnvStep(reward=reward, terminated=True, metadata=carried))
            else:
                steps.append(
                    EnvStep(
                        reward=reward,
                        terminated=False,
                        observation={"role": "user", "content": f"{remaining} more"},
                        stop_strings=("\n",),
                        metadata=carried,
                    )
                )
        return steps
