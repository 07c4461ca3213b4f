"""DPO: direct preference optimisation on (prompt, chosen, rejected) pairs.

One step: draw ``policy.train_global_batch_size / 2`` pairs, encode each prompt + response with
the chat template (the loss mask covers the response's assistant tokens), lay the pairs out as
rows ``2i`` (chosen) and ``2i + 1`` (rejected), compute the reference logprobs once for the
batch (the frozen initial weights, ``get_reference_logprobs``), and take one optimizer step with
:class:`~nrl_core.losses.preference.DPOLoss` (``dpo.beta``, ``dpo.sft_loss_weight``,
``dpo.average_logprobs``). Validation reports the same loss, reward margin and preference
accuracy on the validation pairs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from nrl_core.algorithms.runtime import RunSession
from nrl_core.algorithms.sft import OfflineTrainer, masked_batch
from nrl_core.config.schema import DPOConfig, RunConfig
from nrl_core.data import Batch, Sample
from nrl_core.errors import ConfigError
from nrl_core.losses.config import DPOLossConfig
from nrl_core.policy import global_batch_stats
from nrl_core.registry import Registry


def check_pair_layout(config: RunConfig) -> None:
    """Pairs are consecutive rows; every split of a batch must keep them together."""
    policy = config.policy
    if policy.train_global_batch_size % 2 or policy.train_micro_batch_size % 2:
        raise ConfigError(
            f"policy.train_global_batch_size ({policy.train_global_batch_size}) and "
            f"train_micro_batch_size ({policy.train_micro_batch_size}) must be even: each "
            "(chosen, rejected) pair is two rows"
        )
    pairs = policy.train_global_batch_size // 2
    if pairs % policy.num_workers:
        raise ConfigError(
            f"policy.train_global_batch_size / 2 = {pairs} pairs cannot be split evenly over "
            f"{policy.num_workers} policy ranks; make it a multiple of {2 * policy.num_workers}"
        )
    options = policy.options_for()
    if getattr(options, "micro_batch_token_budget", None):
        raise ConfigError(
            f"policy.{policy.backend}.micro_batch_token_budget packs rows by length and would "
            "split (chosen, rejected) pairs; unset it for preference training"
        )


class PairEncoder:
    """Encodes preference samples as consecutive (chosen, rejected) rows."""

    def pair_rows(self, samples: Sequence[Sample]) -> list[tuple[list[int], list[float]]]:
        rows = []
        for sample in samples:
            for key in ("chosen", "rejected"):
                rows.append(self.encode([*sample.messages, *sample.metadata[key]]))
        return rows


class DPOTrainer(PairEncoder, OfflineTrainer):
    """DPO over a :class:`~nrl_core.algorithms.runtime.RunSession`."""

    algorithm = "dpo"
    progress_fields = (
        ("train/loss", "loss"),
        ("train/preference_accuracy", "acc"),
        ("val/preference_accuracy", "val acc"),
        ("timing/step_s", "s/step"),
    )

    def __init__(self, session: RunSession) -> None:
        super().__init__(session)
        from nrl_core.losses.preference import DPOLoss

        dpo = self.config.dpo
        self.loss_fn = DPOLoss(
            DPOLossConfig(
                beta=dpo.beta,
                sft_loss_weight=dpo.sft_loss_weight,
                average_logprobs=dpo.average_logprobs,
            ),
            session.context,
        )

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """Rows ``2i``/``2i + 1``: chosen/rejected, with their reference logprobs."""
        batch = masked_batch(self.pair_rows(samples), self.pad_token_id)
        batch["ref_logprobs"] = self.session.policy.get_logprobs(batch, reference=True)
        return batch

    def train_step(self, step: int) -> dict[str, float]:
        s = self.session
        samples = s.train_stream.take(self.config.policy.train_global_batch_size // 2)
        start = time.perf_counter()
        batch = self.batch(samples)
        logprobs_s = time.perf_counter() - start
        start = time.perf_counter()
        metrics = {f"train/{k}": v for k, v in s.policy.train(batch, self.loss_fn).items()}
        metrics["timing/logprobs_s"] = logprobs_s
        metrics["timing/train_s"] = time.perf_counter() - start
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """The DPO loss and its metrics on the validation pairs (no update)."""
        s = self.session
        if not s.val_samples:
            return {}
        batch = self.batch(s.val_samples)
        logprobs = s.policy.get_logprobs(batch)
        stats = global_batch_stats(batch, self.config.policy.max_total_sequence_length)
        with torch.no_grad():
            _, metrics = self.loss_fn(logprobs, batch, stats)
        return {f"val/{k}": v for k, v in metrics.items()}


def run(
    config: DPOConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run dpo``."""
    check_pair_layout(config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with RunSession.open(config, registry, algorithm="dpo", verbose=verbose, quiet=quiet) as s:
        if s.finished_early:
            return 0
        return DPOTrainer(s).fit()


__all__ = ["DPOTrainer", "check_pair_layout", "run"]
