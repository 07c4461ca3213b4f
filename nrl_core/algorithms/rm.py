"""Reward-model training: Bradley-Terry on (prompt, chosen, rejected) pairs.

The policy workers run in scalar-head mode (``policy.dtensor.head``, ``auto`` selects it for
this algorithm): the causal LM gets a one-output score head, and the score of a sequence is the
head's value at its last valid token (see :mod:`nrl_core.reward_model`). One step: draw
``policy.train_global_batch_size / 2`` pairs, lay them out as rows ``2i`` (chosen) and ``2i + 1``
(rejected) with the loss mask on each row's last token, and take one optimizer step on
``-log sigmoid(s_c - s_r)``. Validation reports the loss and the accuracy on held-out pairs
(``val/accuracy``). ``nrl convert`` turns a checkpoint into a Hugging Face
``AutoModelForSequenceClassification`` folder that the ``reward_model`` environment loads.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from nrl_core.algorithms.dpo import PairEncoder, check_pair_layout
from nrl_core.algorithms.runtime import RunSession
from nrl_core.algorithms.sft import OfflineTrainer
from nrl_core.config.schema import RMConfig
from nrl_core.data import Batch, Sample, pad_sequences
from nrl_core.policy import global_batch_stats
from nrl_core.registry import Registry
from nrl_core.reward_model import BradleyTerryLoss, last_token_mask


class RMTrainer(PairEncoder, OfflineTrainer):
    """Bradley-Terry reward-model training over a :class:`RunSession`."""

    algorithm = "rm"
    progress_fields = (
        ("train/loss", "loss"),
        ("train/accuracy", "acc"),
        ("val/accuracy", "val acc"),
        ("timing/step_s", "s/step"),
    )

    def __init__(self, session: RunSession) -> None:
        super().__init__(session)
        self.loss_fn = BradleyTerryLoss(None, session.context)

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """Rows ``2i``/``2i + 1``: chosen/rejected, scored at their last token."""
        ids = [row_ids for row_ids, _ in self.pair_rows(samples)]
        input_ids = pad_sequences(ids, pad_value=self.pad_token_id)
        lengths = [len(row) for row in ids]
        return Batch(
            {
                "input_ids": input_ids,
                "lengths": torch.tensor(lengths),
                "loss_mask": torch.tensor(last_token_mask(lengths, input_ids.shape[1])),
            }
        )

    def train_step(self, step: int) -> dict[str, float]:
        s = self.session
        batch = self.batch(s.train_stream.take(self.config.policy.train_global_batch_size // 2))
        start = time.perf_counter()
        metrics = {f"train/{k}": v for k, v in s.policy.train(batch, self.loss_fn).items()}
        metrics["timing/train_s"] = time.perf_counter() - start
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Bradley-Terry loss, accuracy and margin on the held-out pairs."""
        s = self.session
        if not s.val_samples:
            return {}
        batch = self.batch(s.val_samples)
        values = s.policy.get_logprobs(batch)  # scalar-head workers return per-token values
        stats = global_batch_stats(batch, self.config.policy.max_total_sequence_length)
        with torch.no_grad():
            _, metrics = self.loss_fn(values, batch, stats)
        return {f"val/{k}": v for k, v in metrics.items()}


def run(config: RMConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False) -> int:
    """``nrl run rm``."""
    check_pair_layout(config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with RunSession.open(config, registry, algorithm="rm", verbose=verbose, quiet=quiet) as s:
        if s.finished_early:
            return 0
        return RMTrainer(s).fit()


__all__ = ["RMTrainer", "run"]
