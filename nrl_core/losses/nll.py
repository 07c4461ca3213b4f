"""Supervised fine-tuning loss: negative log-likelihood of the assistant tokens.

``L = -sum_it m_it * logp_it / N_tokens`` with ``m = loss_mask * sample_mask`` and ``N_tokens``
the valid token count of the WHOLE global batch (the ``token_mean`` default; the other
aggregations of :func:`nrl_core.losses.common.aggregate` are available too).
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.common import aggregate, token_weights
from nrl_core.losses.config import NLLConfig

__all__ = ["NLLConfig", "NLLLoss"]


class NLLLoss:
    """Token-mean negative log-likelihood over ``loss_mask`` (SFT).

    Batch keys: ``loss_mask`` and optionally ``sample_mask``. Metrics (additive): ``loss``
    (equal to the token-mean NLL with the default aggregation) and ``num_valid_tokens`` (this
    micro batch's count; the sum over micro batches and ranks is the global count).
    """

    needs_reference: bool = False
    needs_prev_logprobs: bool = False

    def __init__(self, options: NLLConfig | None = None, context: Any = None) -> None:
        self.options = options if options is not None else NLLConfig()
        self.context = context

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch."""
        mask = token_weights(batch, logprobs)
        loss = aggregate(-logprobs, mask, stats, self.options.aggregation)
        metrics = {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}
        return loss, metrics
