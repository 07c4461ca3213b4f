"""Reward-model training: Bradley-Terry on (prompt, chosen, rejected) pairs.

The policy workers run in scalar-head mode (``policy.dtensor.head``, ``auto`` selects it for
this algorithm): the causal LM gets a one-output score head, and the score of a sequence is the
head's value at its last valid token (see :mod:`nrl_core.reward_model`). One step: draw
``policy.train_global_batch_size / 2`` pairs, lay them out as rows ``2i`` (chosen) and ``2i + 1``
(rejected) with the loss mask on each row's last token, and take one optimizer step on
``-log sigmoid(s_c - s_r)``. Validation reports the loss and the accuracy on held-out pairs
(``val/accuracy``). ``nrl convert`` turns a checkpoint into a Hugging Face
``AutoModelForSequenceClassification`` folder that the ``reward_model`` environment loads.
The loop is :class:`~nrl_core.algorithms.supervised.SupervisedTrainer`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nrl_core.algorithms.supervised import PairTrainer
from nrl_core.config.schema import RMConfig
from nrl_core.data import Batch, Sample, pad_sequences
from nrl_core.registry import Registry
from nrl_core.reward_model import BradleyTerryLoss, last_token_mask


class RMTrainer(PairTrainer):
    """Bradley-Terry reward-model training (the validation metrics are the loss's: loss,
    accuracy and margin; the scalar-head workers' ``get_logprobs`` returns per-token values)."""

    algorithm = "rm"

    def build_loss(self):
        return BradleyTerryLoss(None, self.session.context)

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


def run(config: RMConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False) -> int:
    """``nrl run rm``."""
    return RMTrainer.run(config, registry, verbose=verbose, quiet=quiet)


__all__ = ["RMTrainer", "run"]
