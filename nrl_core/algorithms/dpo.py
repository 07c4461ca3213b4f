"""DPO: direct preference optimisation on (prompt, chosen, rejected) pairs.

One step: draw ``policy.train_global_batch_size / 2`` pairs, encode each prompt + response with
the chat template (the loss mask covers the response's assistant tokens), lay the pairs out as
rows ``2i`` (chosen) and ``2i + 1`` (rejected), compute the reference logprobs once for the
batch (the frozen initial weights: ``Policy.get_logprobs(batch, reference=True)``), and take one optimizer step with
:class:`~nrl_core.losses.preference.DPOLoss` (``dpo.beta``, ``dpo.sft_loss_weight``,
``dpo.average_logprobs``). Validation reports the same loss, reward margin and preference
accuracy on the validation pairs. The loop is
:class:`~nrl_core.algorithms.supervised.SupervisedTrainer`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from nrl_core.algorithms.supervised import PairTrainer, check_pair_layout, masked_batch
from nrl_core.config.schema import DPOConfig
from nrl_core.data import Batch, Sample
from nrl_core.losses.config import DPOLossConfig
from nrl_core.registry import Registry


class DPOTrainer(PairTrainer):
    """DPO with :class:`~nrl_core.losses.preference.DPOLoss` from the ``dpo`` section."""

    algorithm = "dpo"
    accuracy_metric = "preference_accuracy"

    def build_loss(self):
        from nrl_core.losses.preference import DPOLoss

        dpo = self.config.dpo
        return DPOLoss(
            DPOLossConfig(
                beta=dpo.beta,
                sft_loss_weight=dpo.sft_loss_weight,
                average_logprobs=dpo.average_logprobs,
            ),
            self.session.context,
        )

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """Rows ``2i``/``2i + 1``: chosen/rejected, with their reference logprobs."""
        batch = masked_batch(self.pair_rows(samples), self.pad_token_id)
        batch["ref_logprobs"] = self.session.policy.get_logprobs(batch, reference=True)
        return batch

    def step_metrics(self, batch: Batch, batch_s: float, train_s: float) -> dict[str, float]:
        # Building the batch is the reference forward.
        return {"timing/logprobs_s": batch_s, "timing/train_s": train_s}


def run(
    config: DPOConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run dpo``."""
    return DPOTrainer.run(config, registry, verbose=verbose, quiet=quiet)


__all__ = ["DPOTrainer", "check_pair_layout", "run"]
