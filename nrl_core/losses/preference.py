"""Preference losses: DPO for policies, Bradley-Terry for reward models.

DPO, with ``pi`` the sequence logprob of a response (sum of its token logprobs, or their mean
with ``average_logprobs``), ``ref`` the same under the reference model, ``c`` the chosen and
``r`` the rejected response of a pair::

    h = beta * ((pi_c - ref_c) - (pi_r - ref_r))       # the implicit reward margin
    L_pair = -log sigmoid(h) + sft_loss_weight * (-pi_c)
    L = sum_pairs L_pair / N_pairs                      # N_pairs of the WHOLE global batch

Bradley-Terry, with scalar scores ``s``: ``L = mean_pairs(-log sigmoid(s_c - s_r))``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.common import safe_divisor, sequence_mean, token_weights
from nrl_core.losses.config import DPOLossConfig

__all__ = ["DPOLoss", "DPOLossConfig", "bradley_terry_loss", "bradley_terry_metrics"]


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """``[B]`` sequence logprobs: ``sum_t m_t logp_t``, or that divided by ``sum_t m_t``."""
    if average:
        return sequence_mean(logprobs, mask)
    return torch.where(mask != 0, logprobs, torch.zeros_like(logprobs)).mul(mask).sum(dim=1)


class DPOLoss:
    """Direct Preference Optimization loss (see the module docstring for the formula).

    Batch layout: chosen and rejected responses as consecutive rows, ``2i`` chosen and
    ``2i + 1`` rejected, so micro batches and shards must have an even size (a pair is never
    split). Keys: ``loss_mask``, ``ref_logprobs``, optional ``sample_mask`` (a pair counts with
    the product of its two rows' ``sample_mask``).

    Normaliser: the number of pairs in the global batch, ``stats.valid_sequences / 2`` (the
    core counts rows, and each pair is two rows).

    Metrics (additive, each divided by the global pair count): ``loss``, ``preference_loss``,
    ``sft_loss`` (only with ``sft_loss_weight > 0``, unweighted), ``reward_margin`` (mean of
    ``h``), ``preference_accuracy`` (fraction of pairs with ``h > 0``), ``reward_chosen`` and
    ``reward_rejected`` (means of ``beta * (pi - ref)``).
    """

    needs_reference: bool = True
    needs_prev_logprobs: bool = False
    rows_per_sample: int = 2
    """A (chosen, rejected) pair is two consecutive rows, which sequence packing keeps in one
    micro batch (:func:`nrl_core.packing.first_fit_decreasing`)."""

    def __init__(self, options: DPOLossConfig | None = None, context: Any = None) -> None:
        self.options = options if options is not None else DPOLossConfig()
        self.context = context

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch of whole pairs."""
        if logprobs.shape[0] % 2:
            raise ValueError(
                f"DPO needs (chosen, rejected) row pairs; got a micro batch of {logprobs.shape[0]} "
                "rows. Use even micro batch sizes."
            )
        opts = self.options
        mask = token_weights(batch, logprobs)
        # sample_mask is folded into the pair weight below; the sequence logprobs use the
        # loss mask alone, so that a 0/1 sample mask cannot rescale a summed logprob.
        loss_mask = batch["loss_mask"].to(device=logprobs.device, dtype=logprobs.dtype)
        policy = sequence_logprobs(logprobs, loss_mask, opts.average_logprobs)
        ref = sequence_logprobs(
            batch["ref_logprobs"].to(logprobs.dtype), loss_mask, opts.average_logprobs
        )
        rewards = opts.beta * (policy - ref)
        reward_chosen, reward_rejected = rewards[0::2], rewards[1::2]
        margin = reward_chosen - reward_rejected

        has_tokens = (mask.sum(dim=1) > 0).to(logprobs.dtype)
        row_weight = has_tokens
        sample_mask = batch.get("sample_mask")
        if sample_mask is not None:
            row_weight = row_weight * (sample_mask.to(logprobs.dtype) != 0).to(logprobs.dtype)
        pair_weight = row_weight[0::2] * row_weight[1::2]

        num_pairs = safe_divisor(stats.valid_sequences / 2)
        preference_loss = (pair_weight * -F.logsigmoid(margin)).sum() / num_pairs
        loss = preference_loss
        sft_loss = None
        if opts.sft_loss_weight > 0:
            sft_loss = (pair_weight * -policy[0::2]).sum() / num_pairs
            loss = loss + opts.sft_loss_weight * sft_loss

        with torch.no_grad():

            def pair_mean(values: torch.Tensor) -> float:
                return float((pair_weight * values).sum() / num_pairs)

            metrics = {
                "loss": float(loss),
                "preference_loss": float(preference_loss),
                "reward_margin": pair_mean(margin),
                "preference_accuracy": pair_mean((margin > 0).to(margin.dtype)),
                "reward_chosen": pair_mean(reward_chosen),
                "reward_rejected": pair_mean(reward_rejected),
            }
            if sft_loss is not None:
                metrics["sft_loss"] = float(sft_loss)
        return loss, metrics


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, normaliser: float | None = None
) -> torch.Tensor:
    """Reward-model loss ``sum_pairs -log sigmoid(s_c - s_r) / normaliser``.

    ``normaliser`` defaults to the number of pairs given (a plain mean); pass the global pair
    count to get additive micro-batch contributions, as for the policy losses.
    """
    margin = chosen_scores - rejected_scores
    count = margin.numel() if normaliser is None else normaliser
    return -F.logsigmoid(margin).sum() / safe_divisor(count)


def bradley_terry_metrics(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, normaliser: float | None = None
) -> dict[str, float]:
    """``loss``, ``accuracy`` (fraction of pairs with ``s_c > s_r``; ties count as wrong) and
    ``margin`` (mean of ``s_c - s_r``), each summed and divided by ``normaliser`` (default: the
    number of pairs given), so they are additive like the loss."""
    with torch.no_grad():
        margin = (chosen_scores - rejected_scores).detach().float()
        count = safe_divisor(margin.numel() if normaliser is None else normaliser)
        return {
            "loss": float(-F.logsigmoid(margin).sum() / count),
            "accuracy": float((margin > 0).float().sum() / count),
            "margin": float(margin.sum() / count),
        }
