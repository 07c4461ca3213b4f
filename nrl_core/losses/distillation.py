"""On-policy distillation: a per-token KL between the student (the policy) and a teacher.

The student generated every row; a frozen teacher scored each position ``t`` (aligned with
``input_ids``: position ``t`` holds the distributions predicting token ``t`` from the tokens
before it) and kept its ``K`` most likely tokens. The batch carries, per position:

* ``teacher_topk_logprobs`` ``[B, T, K]``: the teacher's log-probabilities ``a_i`` of its top-k
  tokens, over the FULL vocabulary (not renormalised over the K tokens);
* ``teacher_topk_ids`` ``[B, T, K]``: those tokens' ids;
* ``logprobs_at`` ``[B, T, K]``: the student's full-vocabulary log-probabilities ``b_i`` of the
  same ids, with the autograd graph (the core computes it because the loss declares
  ``logprobs_at_key = "teacher_topk_ids"``);
* optionally ``teacher_logprobs`` ``[B, T]`` (the teacher's logprob of the sampled token; only
  for the ``logprob_gap`` metric), plus ``loss_mask`` and ``sample_mask`` as in every loss.

Both distributions are coarsened to ``K + 1`` categories: the teacher's K tokens and one tail
bucket holding every other token::

    p_T(i) = exp(a_i),  p_T(tail) = max(1 - sum_i exp(a_i), EPS) = max(-expm1(logsumexp(a)), EPS)
    p_S(i) = exp(b_i),  p_S(tail) = max(1 - sum_i exp(b_i), EPS) = max(-expm1(logsumexp(b)), EPS)

with the floor ``EPS = TAIL_FLOOR = 1e-8``: it keeps ``log p(tail)`` finite when the K tokens
hold (up to rounding) all the mass, and it stops the tail's gradient while it is active (only
for a tail below 1e-8). The per-token divergences over the ``K + 1`` categories ``c`` are::

    reverse: KL(S || T) = sum_c p_S(c) (log p_S(c) - log p_T(c))      (kl_type="reverse", default)
    forward: KL(T || S) = sum_c p_T(c) (log p_T(c) - log p_S(c))      (kl_type="forward")
    mixed:   w * KL(T || S) + (1 - w) * KL(S || T),  w = mixed_weight  (kl_type="mixed")

(in the forward KL a teacher category of probability 0 contributes 0: ``0 log 0 = 0``). By the
data-processing inequality (coarsening is a deterministic map of the vocabulary) each is a
lower bound of the corresponding full-vocabulary KL, and equals it when the K tokens cover the
vocabulary (both tails then sit at the floor and contribute ``EPS * 0 = 0``, or rounding
noise of about 1e-7 in float32). The teacher's logprobs must be finite at valid positions
where the student has mass: a ``-inf`` there makes the reverse KL infinite. The gradient
reaches the student only through ``logprobs_at``; the sampled token's ``logprobs`` enter the
metrics alone.

The per-token divergence ``D_it`` is aggregated like every loss
(:func:`nrl_core.losses.common.aggregate`; ``token_mean`` by default:
``L = sum_it m_it D_it / N_tokens`` with ``m = loss_mask * sample_mask`` and ``N_tokens`` the
valid token count of the WHOLE global batch), so micro-batch and data-parallel sums give the
global loss. Positions with weight 0 may hold anything (inf, NaN): they are replaced by a
uniform ``K + 1`` distribution with ``torch.where`` before any arithmetic, so neither value nor
gradient is poisoned.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.common import aggregate, token_mean_metric, token_weights
from nrl_core.losses.config import DistillationLossConfig

__all__ = ["TAIL_FLOOR", "DistillationLoss", "DistillationLossConfig", "coarsened_logprobs"]

TAIL_FLOOR = 1e-8
"""Lower bound of the tail bucket's probability ``p(tail)`` before its log is taken."""

_REQUIRED = ("teacher_topk_logprobs", "logprobs_at")


def coarsened_logprobs(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` full-vocabulary log-probabilities of K tokens -> ``[..., K + 1]``
    log-probabilities of (those K tokens, the tail bucket).

    The tail is ``max(-expm1(logsumexp(topk)), TAIL_FLOOR)``: no exp under- or overflow, an
    absolute error of the order of the rounding of the sum (about 1e-7 in float32, which is why
    the loss computes in float32 at least), and the floor keeps its log finite when rounding
    makes the sum reach (or pass) 1.
    """
    tail = -torch.expm1(torch.logsumexp(topk_logprobs, dim=-1, keepdim=True))
    return torch.cat([topk_logprobs, tail.clamp(min=TAIL_FLOOR).log()], dim=-1)


def _reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``sum_c p_S(c) (log p_S(c) - log p_T(c))`` over the last dimension."""
    return (student.exp() * (student - teacher)).sum(dim=-1)


def _forward_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``sum_c p_T(c) (log p_T(c) - log p_S(c))`` over the last dimension (``0 log 0 = 0``)."""
    p_teacher = teacher.exp()
    terms = p_teacher * (teacher - student)
    return torch.where(p_teacher > 0, terms, torch.zeros_like(terms)).sum(dim=-1)


class DistillationLoss:
    """Reverse, forward or mixed KL from the student to a teacher's top-k distribution.

    See the module docstring for the formulas. Batch keys: ``teacher_topk_logprobs``,
    ``logprobs_at`` (put there by the core from ``teacher_topk_ids``), ``loss_mask``, and
    optionally ``sample_mask`` and ``teacher_logprobs``. Metrics (additive: each is a share of
    a global token mean, so the core's sum gives the global value): ``kl_to_teacher`` (the
    optimised divergence, token mean whatever the aggregation), ``reverse_kl``, ``forward_kl``,
    ``teacher_topk_mass`` (token mean of ``sum_i p_T(i)``), ``logprob_gap`` (token mean of
    ``teacher_logprobs - logprobs``, only when the batch has ``teacher_logprobs``) and
    ``num_valid_tokens`` (this micro batch's count).
    """

    needs_reference: bool = False
    needs_prev_logprobs: bool = False
    logprobs_at_key: str = "teacher_topk_ids"
    """The batch key whose ids the core scores with the policy, as ``batch["logprobs_at"]``."""

    def __init__(self, options: DistillationLossConfig | None = None, context: Any = None) -> None:
        self.options = options if options is not None else DistillationLossConfig()
        self.context = context

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch."""
        for key in _REQUIRED:
            if key not in batch:
                raise ValueError(
                    f"the distillation loss needs batch[{key!r}], which only the distillation "
                    "loop provides: run it with `nrl run distill`"
                )
        student_at = batch["logprobs_at"]
        teacher_at = batch["teacher_topk_logprobs"]
        if student_at.shape != teacher_at.shape or student_at.shape[:2] != logprobs.shape:
            raise ValueError(
                f"logprobs_at {tuple(student_at.shape)} and teacher_topk_logprobs "
                f"{tuple(teacher_at.shape)} must both be [B, T, K] with [B, T] = "
                f"{tuple(logprobs.shape)} (the logprobs)"
            )
        # At least float32: the tail is 1 - (a sum close to 1).
        dtype = torch.promote_types(student_at.dtype, torch.float32)
        student_at = student_at.to(dtype)
        mask = token_weights(batch, student_at)
        valid = (mask != 0)[..., None]
        # Weight-0 positions may hold garbage: replace them by a uniform (K + 1)-category
        # distribution before any arithmetic, so values and gradients stay finite there.
        uniform = torch.full_like(student_at, -math.log(student_at.shape[-1] + 1))
        teacher_at = teacher_at.to(device=student_at.device, dtype=dtype)
        student = coarsened_logprobs(torch.where(valid, student_at, uniform))
        teacher = coarsened_logprobs(torch.where(valid, teacher_at, uniform))

        kl_type, w = self.options.kl_type, self.options.mixed_weight
        # The divergence that is not optimised is only a metric: no graph for it.
        with torch.set_grad_enabled(kl_type != "forward" and torch.is_grad_enabled()):
            reverse = _reverse_kl(student, teacher)
        with torch.set_grad_enabled(kl_type != "reverse" and torch.is_grad_enabled()):
            forward = _forward_kl(student, teacher)
        if kl_type == "reverse":
            per_token = reverse
        elif kl_type == "forward":
            per_token = forward
        else:
            per_token = w * forward + (1.0 - w) * reverse
        loss = aggregate(per_token, mask, stats, self.options.aggregation)

        metrics = {
            "kl_to_teacher": token_mean_metric(per_token, mask, stats),
            "reverse_kl": token_mean_metric(reverse, mask, stats),
            "forward_kl": token_mean_metric(forward, mask, stats),
            "teacher_topk_mass": token_mean_metric(teacher[..., :-1].exp().sum(-1), mask, stats),
        }
        teacher_logprobs = batch.get("teacher_logprobs")
        if teacher_logprobs is not None:
            gap = teacher_logprobs.to(device=mask.device, dtype=dtype) - logprobs.to(dtype)
            metrics["logprob_gap"] = token_mean_metric(gap, mask, stats)
        metrics["num_valid_tokens"] = float(mask.sum())
        return loss, metrics
