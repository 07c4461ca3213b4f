"""A multi-turn game: the model guesses a secret number, the environment answers higher/lower.

This is the model for multi-turn environments: ``step`` is called once per turn with the
whole conversation so far; it returns an observation (the next user message), the stop strings
of the next turn and the metadata carried into the next call, until it ends the episode.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from statistics import fmean
from typing import Any

from nrl_core.data import Message, Sample
from nrl_core.interfaces import ComponentContext, EnvStep
from nrl_math_env.common import last_integer, response_text
from nrl_math_env.config import GuessNumberDataConfig, GuessNumberEnvConfig
from nrl_math_env.metrics import episode_metrics


class GuessNumberDataset:
    """One game per sample: a secret number in ``[low, high]``, drawn from the seed.

    The secret is the sample's ``answer``; ``low`` and ``high`` go into its metadata.
    """

    def __init__(self, options: GuessNumberDataConfig, context: ComponentContext) -> None:
        self.options = options
        self.seed = context.seed if options.seed is None else options.seed

    def load(self, split: str) -> list[Sample]:
        """The games of ``split`` (``train`` or ``validation``)."""
        size = {"train": self.options.train_size, "validation": self.options.validation_size}[split]
        rng = random.Random(f"guess_number/{split}/{self.seed}")
        low, high = self.options.low, self.options.high
        prompt = f"Guess my number from {low} to {high}. Reply with one number."
        return [
            Sample(
                messages=[{"role": "user", "content": prompt}],
                answer=str(rng.randint(low, high)),
                task="guess_number",
                metadata={"low": low, "high": high},
            )
            for _ in range(size)
        ]


class GuessNumberEnvironment:
    """The environment of the game: reward 1.0 for guessing the secret within the turn limit.

    Metadata in: ``answer`` (the secret). Metadata out, carried turn to turn: ``secret``,
    ``turn`` (guesses made) and ``guesses`` (each parsed guess, ``None`` when unreadable). A
    guess is the response's last integer; the observation is a ``user`` message, "higher" or
    "lower" (or a reminder of the format), and every turn but the last gets
    ``options.stop_strings``. The episode ends on the right guess or after
    ``options.max_turns`` guesses; rewards of the turns before the last are 0.
    """

    defines_correctness = True
    """Reward 1.0 is a correct response, 0.0 a wrong one."""

    def __init__(self, options: GuessNumberEnvConfig, context: ComponentContext) -> None:
        self.options = options

    def step(
        self, conversations: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> list[EnvStep]:
        """Answer each sample's latest guess."""
        return [self._turn(c, m) for c, m in zip(conversations, metadata, strict=True)]

    def _turn(self, conversation: Sequence[Message], meta: dict[str, Any]) -> EnvStep:
        secret = int(meta.get("secret", meta["answer"]))
        guess = last_integer(response_text(conversation))
        state = {
            **meta,
            "secret": secret,
            "turn": meta.get("turn", 0) + 1,
            "guesses": [*meta.get("guesses", []), guess],
        }
        if guess == secret:
            return EnvStep(reward=1.0, terminated=True, metadata=state)
        if state["turn"] >= self.options.max_turns:
            return EnvStep(reward=0.0, terminated=True, metadata=state)
        if guess is None:
            hint = "Reply with one number."
        else:
            hint = "higher" if guess < secret else "lower"
        return EnvStep(
            reward=0.0,
            terminated=False,
            observation={"role": "user", "content": hint},
            stop_strings=tuple(self.options.stop_strings),
            metadata=state,
        )

    def metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """Metrics of finished games.

        Args:
            batch: as :func:`~nrl_math_env.metrics.episode_metrics` documents, plus
                ``metadata`` (list[dict], each game's final metadata) for ``mean_turns``.
        """
        metrics = episode_metrics(batch)
        if batch.get("metadata"):
            metrics["mean_turns"] = fmean(m.get("turn", 0) for m in batch["metadata"])
        return metrics
