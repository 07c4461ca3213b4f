"""The clipped value (critic) loss of PPO, for a critic trained by the core's step.

Per valid token, with the critic's values ``V`` (the tensor the core hands the loss in place
of logprobs), the values at rollout time ``V_old`` and the regression targets ``R`` (the GAE
returns, :func:`nrl_core.algorithms.advantages.gae_advantages`)::

    L_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - eps, V_old_t + eps) - R_t)^2)
    L_t = 0.5 * (V_t - R_t)^2                                  if clip_eps is None

aggregated over the global batch like the policy loss (:func:`nrl_core.losses.common.
aggregate`), so micro batches and data-parallel ranks sum to the one-rank loss. The clipped
branch gives no gradient where it wins with ``V`` outside the clip range: the critic is not
pushed further from ``V_old`` than ``eps`` in one rollout's updates.
"""

from __future__ import annotations

import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.common import aggregate, token_mean_metric, token_weights
from nrl_core.losses.config import ValueLossConfig

__all__ = ["ClippedValueLoss", "ValueLossConfig", "explained_variance"]


class ClippedValueLoss:
    """``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` (see the module docstring).

    Called like a policy loss, ``loss_fn(values, batch, stats)``, with ``values`` ``[B, T]``
    the critic's predictions. Batch keys: ``loss_mask``, ``returns`` and (with a clip range)
    ``old_values``; ``sample_mask`` optionally.

    Metrics (additive shares of the global token mean): ``value_loss``, ``value_clip_frac``
    (fraction of valid tokens where the clipped branch won with V outside the range, i.e. had
    no gradient), ``values_mean`` and ``returns_mean``.
    """

    needs_reference: bool = False
    needs_prev_logprobs: bool = False

    def __init__(self, options: ValueLossConfig | None = None, context: object = None) -> None:
        self.options = options if options is not None else ValueLossConfig()
        self.context = context

    def __call__(
        self, values: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        opts = self.options
        mask = token_weights(batch, values)
        valid = mask != 0
        zeros = torch.zeros_like(values)
        # Zeroed before any arithmetic: padding may hold inf / NaN (see clipped_pg).
        predicted = torch.where(valid, values, zeros)
        returns = torch.where(valid, batch["returns"].to(values.dtype), zeros)
        per_token = 0.5 * (predicted - returns) ** 2
        clipped_won = torch.zeros_like(valid)
        if opts.clip_eps is not None:
            old = torch.where(valid, batch["old_values"].to(values.dtype), zeros)
            clipped = old + (predicted - old).clamp(-opts.clip_eps, opts.clip_eps)
            clipped_loss = 0.5 * (clipped - returns) ** 2
            clipped_won = (clipped_loss > per_token) & valid
            per_token = torch.maximum(per_token, clipped_loss)
        loss = opts.coef * aggregate(per_token, mask, stats, opts.aggregation)
        with torch.no_grad():
            metrics = {
                "value_loss": float(loss.detach()),
                "value_clip_frac": token_mean_metric(clipped_won.to(mask.dtype), mask, stats),
                "values_mean": token_mean_metric(predicted, mask, stats),
                "returns_mean": token_mean_metric(returns, mask, stats),
            }
        return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the valid tokens (``mask != 0``) of the WHOLE batch
    (population variances; not additive, so compute it where the whole batch is). 1 is a
    perfect critic, 0 no better than the mean return, < 0 worse; NaN when the returns do not
    vary (nothing to explain)."""
    valid = mask != 0
    r = returns[valid].to(torch.float64)
    v = values[valid].to(torch.float64)
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if float(var_r) == 0:
        return float("nan")
    return float(1 - (r - v).var(unbiased=False) / var_r)
