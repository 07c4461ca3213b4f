"""Helpers shared by the losses: the effective token mask and the global aggregation.

Every loss divides its micro batch's sum by a normaliser of the WHOLE global batch (from
:class:`nrl_core.interfaces.GlobalBatchStats`), never by the micro batch's own counts, so that
summing the micro-batch losses over micro batches and data-parallel ranks gives the global loss.
"""

from __future__ import annotations

import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats


def token_weights(batch: Batch, like: torch.Tensor) -> torch.Tensor:
    """``loss_mask * sample_mask[:, None]`` as a ``[B, T]`` tensor of ``like``'s dtype/device."""
    mask = batch["loss_mask"].to(device=like.device, dtype=like.dtype)
    sample_mask = batch.get("sample_mask")
    if sample_mask is not None:
        mask = mask * sample_mask.to(device=like.device, dtype=like.dtype)[:, None]
    return mask


def safe_divisor(value: float) -> float:
    """``value``, or 1 when it is 0: an all-masked global batch then gives loss 0, not NaN."""
    return float(value) if value > 0 else 1.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(mask * values)``, ignoring whatever ``values`` holds where ``mask`` is 0.

    ``torch.where`` rather than a product: padded positions may hold inf or NaN (garbage
    logprobs), and ``0 * inf`` would poison both the value and the gradient.
    """
    return torch.where(mask != 0, values, torch.zeros_like(values)).mul(mask).sum()


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row weighted mean ``sum_t m_t v_t / sum_t m_t`` (``[B]``; 0 for rows with no weight)."""
    total = torch.where(mask != 0, values, torch.zeros_like(values)).mul(mask).sum(dim=1)
    count = mask.sum(dim=1)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, stats: GlobalBatchStats, mode: str
) -> torch.Tensor:
    """This micro batch's share of the global loss.

    With ``m`` the token weights and ``L`` the per-token loss:

    * ``token_mean``: ``sum_it m_it L_it / N_tokens``
    * ``seq_mean_token_mean``: ``sum_i (sum_t m_it L_it / sum_t m_it) / N_seqs``
    * ``seq_mean_token_sum_norm`` (Dr. GRPO): ``sum_it m_it L_it / (N_seqs * L_max)``

    where ``N_tokens``, ``N_seqs`` and ``L_max`` are the global ``stats``. With
    ``seq_mean_token_mean`` a row's ``sample_mask`` weight cancels inside its own mean, so it
    drops rows (weight 0) but does not re-weight them.
    """
    if mode == "token_mean":
        return masked_sum(per_token, mask) / safe_divisor(stats.valid_tokens)
    if mode == "seq_mean_token_mean":
        return sequence_mean(per_token, mask).sum() / safe_divisor(stats.valid_sequences)
    if mode == "seq_mean_token_sum_norm":
        normaliser = stats.valid_sequences * stats.max_sequence_length
        return masked_sum(per_token, mask) / safe_divisor(normaliser)
    raise ValueError(f"unknown aggregation {mode!r}")


def token_mean_metric(values: torch.Tensor, mask: torch.Tensor, stats: GlobalBatchStats) -> float:
    """Additive share of a diagnostic's global token mean: ``sum(m * v) / N_tokens``."""
    with torch.no_grad():
        return float(masked_sum(values.detach(), mask) / safe_divisor(stats.valid_tokens))
