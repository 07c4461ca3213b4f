"""The ``math`` environment: math-verify checks each response against its reference answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.data import Message
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, EnvStep
from nrl_math_env.common import response_text
from nrl_math_env.config import MathEnvConfig
from nrl_math_env.metrics import episode_metrics, status_fractions
from nrl_math_env.workers import VerifierPool


class MissingAnswerError(NrlError):
    """A sample reached the math environment without a reference answer."""


class MathEnvironment:
    """Single-turn math: reward 1.0 when the response's answer equals the reference, else 0.0.

    Expects per-sample metadata with ``answer`` (LaTeX, a plain expression or a number). Each
    response is checked by ``options.verify_fn`` in a pool of ``options.num_workers`` processes
    with a hard ``options.timeout_s`` limit. The returned metadata adds ``verify_status``:
    ``ok``, ``timeout``, ``error`` or ``crashed`` (see :class:`~nrl_math_env.workers.Verdict`).
    """

    defines_correctness = True
    """Reward 1.0 is a correct response, 0.0 a wrong one."""

    def __init__(self, options: MathEnvConfig, context: ComponentContext) -> None:
        self.options = options
        self._pool = VerifierPool(options.verify_fn, options.num_workers, options.timeout_s)
        self._what = f"env.math.verify_fn={options.verify_fn}"

    def step(
        self, conversations: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> list[EnvStep]:
        """Score each conversation's last (assistant) message; every episode ends here."""
        if any(meta.get("answer") is None for meta in metadata):
            raise MissingAnswerError(
                "a sample has no reference answer: the dataset must set Sample.answer "
                "(for JSONL files, check data.jsonl.answer_field)"
            )
        pairs = [
            (response_text(c), m["answer"]) for c, m in zip(conversations, metadata, strict=True)
        ]
        verdicts = self._pool.map(pairs)
        return [
            EnvStep(
                reward=v.reward,
                metadata={**m, "verify_status": v.status},
                # Not a score: counted by the core (train/env_*_frac, env.stop_failed_fraction).
                failure=None if v.status == "ok" else f"{v.status}: {v.error or self._what}",
            )
            for v, m in zip(verdicts, metadata, strict=True)
        ]

    def metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """Metrics of a finished batch.

        Args:
            batch: ``rewards``, ``group_ids``, ``finish_reasons`` and ``response_lengths`` as
                :func:`~nrl_math_env.metrics.episode_metrics` documents, plus ``metadata``
                (list[dict], each sample's final metadata) for ``timeout_fraction``,
                ``error_fraction`` and ``crashed_fraction``.
        """
        return episode_metrics(batch) | status_fractions(
            batch, "verify_status", ("timeout", "error", "crashed")
        )

    def close(self) -> None:
        """Stop the verifier processes (they also die with this actor's process)."""
        self._pool.close()
