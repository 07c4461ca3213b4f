"""The clipped policy-gradient loss behind GRPO, DAPO, Dr. GRPO and GSPO.

Per valid token (``m_it > 0``), with ``rho_it = exp(logp_it - old_it)``::

    L_it = max(-A_i * rho_it, -A_i * clip(rho_it, 1 - eps_low, 1 + eps_high))
    L_it = -sg(clip(rho_it, 1 - eps_low, 1 + eps_high)) * A_i * logp_it     if use_cispo (CISPO)
    L_it = min(L_it, -A_i * c)                  if dual clip and A_i < 0
    L_it = w_it * L_it                          if an importance-sampling correction is on
    L_it = L_it + kl_coef * KL_it               if kl_coef > 0 (never weighted by w_it)

and the loss is ``aggregate(L, m)`` over the global batch (see
:func:`nrl_core.losses.common.aggregate`). ``old`` is ``prev_logprobs`` when the batch carries
them; otherwise the step is taken as fully on-policy and ``old = sg(logp)`` (``rho`` is 1 with
the exact policy gradient). GSPO (``ratio_level="sequence"``) replaces ``rho_it`` by the
sequence ratio ``s_i = exp(mean_t(logp_it - old_it))`` and ``A_i`` by the sequence's mean
advantage, so ``L_it`` is the same for every token of a sequence; its default aggregation
(``auto``) is then the per-sequence ``seq_mean_token_mean``.

CISPO (``use_cispo``, MiniMax-M1) keeps the REINFORCE form: the clipped ratio is a detached
per-token weight, so the gradient is ``-w_it * A_i * grad(logp_it)`` for EVERY valid token,
clipped or not (the PPO surrogate gives a clipped token no gradient). Its loss value is a
surrogate of the gradient only (``-A * logp``, not ``-A * rho``).

Metrics are additive contributions (already divided by the global normaliser), except the ones
:attr:`ClippedPGLoss.metric_reductions` declares as max / min over micro batches and ranks. See
:class:`ClippedPGLoss` for the list.
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_core.data import VERSION_GAP_BUCKETS, VERSION_GAPS, Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.common import aggregate, sequence_mean, token_mean_metric, token_weights
from nrl_core.losses.config import ClippedPGConfig, resolve_aggregation, resolve_is_correction

__all__ = [
    "ClippedPGConfig",
    "ClippedPGLoss",
    "kl_penalty",
    "resolve_aggregation",
    "resolve_is_correction",
]

KL_LOG_RATIO_CLAMP = 20.0
"""``|ref - logp|`` is clamped to this before exponentiating, so k3 cannot overflow."""

IS_LOG_WEIGHT_CLAMP = 20.0
"""``|old - gen|`` is clamped to this before exponentiating (exp(20) ~ 5e8 is already far
outside any truncation or mask bound, so the clamp changes no decision)."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    With ``d = clamp(ref - logp, -20, 20)``: ``k1 = -d``, ``k2 = d^2 / 2``,
    ``k3 = exp(d) - 1 - d`` (non-negative, low variance).
    """
    d = (ref_logprobs - logprobs).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown kl_estimator {estimator!r}")


class ClippedPGLoss:
    """PPO-style clipped policy-gradient loss with the GRPO/DAPO/Dr. GRPO/GSPO/CISPO options.

    Built as ``ClippedPGLoss(options, context)``; see :class:`ClippedPGConfig` for the options
    and the module docstring for the formula.

    Batch keys: ``loss_mask`` and ``advantages`` (``[B, T]``, or ``[B]`` broadcast over tokens)
    always; ``prev_logprobs`` when present (absent: on-policy shortcut); ``ref_logprobs`` when
    ``kl_coef > 0`` (used for the ``kl`` metric whenever present); ``gen_logprobs`` for an
    importance-sampling correction (required unless it is ``none``; used for the mismatch
    metrics whenever present); ``sample_mask`` optionally.

    ``is_correction="auto"`` should be resolved by the core before the loss is built (see
    :func:`resolve_is_correction`); an unresolved ``auto`` acts as ``token_truncate`` on batches
    that carry ``gen_logprobs`` and as ``none`` on batches that do not. ``aggregation="auto"``
    needs no run information and is resolved here as well (see
    :func:`nrl_core.losses.config.resolve_aggregation`).

    Metrics (additive: the core sums them over micro batches and ranks):

    * ``loss``: the loss value.
    * ``clip_fraction``: fraction of valid tokens whose ratio was clipped (the clipped branch
      was active, so the token had no gradient from the PG term; with CISPO: whose weight was
      clipped, the token keeping its gradient).
    * ``dual_clip_fraction`` (dual clip only): fraction of valid tokens capped by the dual clip.
    * ``kl`` (when ``ref_logprobs`` are present): token mean of the configured KL estimator.
    * ``entropy``: token mean of ``-logp`` (a one-sample entropy estimate).
    * ``gen_logprob_error`` (when ``gen_logprobs`` are present): token mean of
      ``exp(|old - gen|)``; about 1.0 when trainer and generator agree.
    * ``is_clipped_fraction`` (with a correction): fraction of valid tokens whose weight was
      truncated or masked (every token of an affected sequence counts in sequence modes).
    * ``gen_logprob_error_gap<k>`` and ``gen_logprob_tokens_gap<k>`` (when ``gen_logprobs``
      and :data:`~nrl_core.data.VERSION_GAPS` are present; ``k`` in 0 ..
      ``VERSION_GAP_BUCKETS - 1``, the last one for that gap and more): the additive shares of
      ``sum exp(|old - gen|)`` and of the token count over the valid tokens generated ``k``
      versions before the trainer's weights; their ratio is the mismatch at that gap.

    Metrics reduced with max / min (NOT summed): ``ratio_max``, ``ratio_min`` (over valid
    tokens; the sequence ratio for GSPO) and ``gen_logprob_error_max``. They are left out of a
    micro batch with no valid token.
    """

    metric_reductions = {
        "ratio_max": "max",
        "ratio_min": "min",
        "gen_logprob_error_max": "max",
    }
    """How the core combines these metrics over micro batches and ranks (others are summed)."""

    def __init__(self, options: ClippedPGConfig | None = None, context: Any = None) -> None:
        self.options = options if options is not None else ClippedPGConfig()
        self.context = context
        self.needs_reference: bool = self.options.kl_coef > 0
        # The shortcut is only valid when nothing has changed the weights since the rollout;
        # the config states that promise, the loss cannot check it. An unresolved `auto`
        # recomputes: the core resolves it (resolve_on_policy_shortcut) when it knows.
        self.needs_prev_logprobs: bool = self.options.on_policy_shortcut is not True

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch (see the class docstring)."""
        opts = self.options
        mask = token_weights(batch, logprobs)
        valid = mask != 0
        old = batch.get("prev_logprobs")
        old = logprobs.detach() if old is None else old.to(logprobs.dtype)
        zeros = torch.zeros_like(logprobs)
        advantages = torch.where(valid, self._token_advantages(batch, logprobs), zeros)

        # Padded positions may hold anything (even inf); every input is zeroed there before a
        # non-linear op, or 0 * inf in the backward pass would turn the gradient into NaN.
        log_ratio = torch.where(valid, logprobs - old, zeros)
        if opts.ratio_level == "sequence":
            ratio = torch.exp(sequence_mean(log_ratio, mask))[:, None].expand_as(logprobs)
            advantages = sequence_mean(advantages, mask)[:, None].expand_as(logprobs)
        else:
            ratio = torch.exp(log_ratio)

        clipped_ratio = ratio.clamp(1.0 - opts.clip_eps_low, 1.0 + opts.clip_eps_high)
        if opts.use_cispo:
            # The weight is detached: the gradient flows only through logp, on every token.
            weight = clipped_ratio.detach()
            per_token = -weight * advantages * torch.where(valid, logprobs, zeros)
            clipped = (weight != ratio.detach()) & valid
        else:
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * clipped_ratio
            per_token = torch.maximum(unclipped_loss, clipped_loss)
            clipped = clipped_loss > unclipped_loss
        dual_capped = None
        if opts.dual_clip_c is not None and not opts.use_cispo:
            cap = -advantages * opts.dual_clip_c
            dual_capped = (advantages < 0) & (cap < per_token)
            per_token = torch.where(dual_capped, cap, per_token)

        # The IS weight corrects the policy-gradient estimate for sampling from the generator
        # instead of the trainer's policy; it weights the PG term only. The KL penalty is a
        # regulariser of the current policy towards the reference, estimated on the same
        # tokens, and stays unweighted (NeMo RL does the same): a masked token (w = 0) still
        # feels the KL pull, and a truncated weight does not double it.
        mode = self._is_mode(batch)
        weights, weight_limited = self._is_weights(batch, old, mask, mode)
        if weights is not None:
            per_token = per_token * weights

        kl = None
        ref = batch.get("ref_logprobs")
        if ref is not None:
            kl = kl_penalty(
                torch.where(valid, logprobs, zeros),
                torch.where(valid, ref.to(logprobs.dtype), zeros),
                opts.kl_estimator,
            )
        if opts.kl_coef > 0:
            if kl is None:
                raise KeyError("kl_coef > 0 needs 'ref_logprobs' in the batch")
            per_token = per_token + opts.kl_coef * kl

        loss = aggregate(per_token, mask, stats, resolve_aggregation(opts))

        with torch.no_grad():
            metrics: dict[str, float] = {
                "loss": float(loss.detach()),
                "clip_fraction": token_mean_metric(clipped.to(mask.dtype), mask, stats),
                "entropy": token_mean_metric(-logprobs, mask, stats),
            }
            if dual_capped is not None:
                metrics["dual_clip_fraction"] = token_mean_metric(
                    dual_capped.to(mask.dtype), mask, stats
                )
            if kl is not None:
                metrics["kl"] = token_mean_metric(kl, mask, stats)
            if weight_limited is not None:
                metrics["is_clipped_fraction"] = token_mean_metric(
                    weight_limited.to(mask.dtype), mask, stats
                )
            if bool(valid.any()):
                metrics["ratio_max"] = float(ratio.detach()[valid].max())
                metrics["ratio_min"] = float(ratio.detach()[valid].min())
            gen = batch.get("gen_logprobs")
            if gen is not None:
                error = torch.exp(torch.where(valid, (old - gen.to(old.dtype)).abs(), zeros))
                metrics["gen_logprob_error"] = token_mean_metric(error, mask, stats)
                if bool(valid.any()):
                    metrics["gen_logprob_error_max"] = float(error[valid].max())
                gaps = batch.get(VERSION_GAPS)
                if gaps is not None:
                    gaps = gaps.to(logprobs.device)
                    last = VERSION_GAP_BUCKETS - 1
                    for k in range(VERSION_GAP_BUCKETS):
                        chosen = mask * ((gaps >= k) if k == last else (gaps == k)).to(mask.dtype)
                        metrics[f"gen_logprob_error_gap{k}"] = token_mean_metric(
                            error, chosen, stats
                        )
                        metrics[f"gen_logprob_tokens_gap{k}"] = token_mean_metric(
                            torch.ones_like(error), chosen, stats
                        )
        return loss, metrics

    @staticmethod
    def _token_advantages(batch: Batch, like: torch.Tensor) -> torch.Tensor:
        """The advantages as ``[B, T]`` (a ``[B]`` tensor is broadcast over the tokens)."""
        advantages = batch["advantages"].to(device=like.device, dtype=like.dtype)
        if advantages.dim() == 1:
            advantages = advantages[:, None]
        return advantages.expand_as(like)

    def _is_mode(self, batch: Batch) -> str:
        """The correction for this batch (an unresolved ``auto`` depends on ``gen_logprobs``)."""
        mode = self.options.is_correction
        if mode == "auto":
            return resolve_is_correction(mode, colocated="gen_logprobs" not in batch)
        return mode

    def _is_weights(
        self, batch: Batch, old: torch.Tensor, mask: torch.Tensor, mode: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Detached correction weights ``[B, T]`` and where they were truncated or masked.

        ``w = exp(old - gen)`` per token, or per sequence ``exp(mean_t(old - gen))``
        (geometric mean) / ``exp(sum_t(old - gen))`` (product); ``*_truncate`` uses
        ``min(w, C)``, ``*_mask`` keeps ``w`` inside ``[lo, hi]`` and 0 outside.
        """
        if mode == "none":
            return None, None
        gen = batch.get("gen_logprobs")
        if gen is None:
            raise KeyError(f"is_correction={mode!r} needs 'gen_logprobs' in the batch")
        opts = self.options
        with torch.no_grad():
            log_w = torch.where(mask != 0, old.detach() - gen.to(old.dtype), torch.zeros_like(old))
            if mode.startswith("sequence"):
                if opts.is_sequence_weight == "product":
                    log_w = _row_sum(log_w, mask)
                else:
                    log_w = sequence_mean(log_w, mask)
                log_w = log_w[:, None].expand_as(old)
            weights = torch.exp(log_w.clamp(-IS_LOG_WEIGHT_CLAMP, IS_LOG_WEIGHT_CLAMP))
            if mode.endswith("truncate"):
                limited = weights > opts.is_truncate_c
                weights = weights.clamp(max=opts.is_truncate_c)
            elif mode.endswith("mask"):
                limited = (weights < opts.is_mask_low) | (weights > opts.is_mask_high)
                weights = torch.where(limited, torch.zeros_like(weights), weights)
            else:
                raise ValueError(f"unknown is_correction {mode!r}")
        return weights, limited


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row ``sum_t values_t`` over the tokens with non-zero weight (``[B]``).

    Unweighted on purpose: the product weight multiplies one factor per valid token.
    """
    return torch.where(mask != 0, values, torch.zeros_like(values)).sum(dim=1)
