"""Logprobs from vocabulary-sharded logits, for tensor parallelism without full-vocabulary
logits on every rank (review m10).

With ``lm_head`` whole, each TP rank would compute and keep the ``[B, T, V]`` logits and their
``log_softmax``: the largest activation of a step (V = 152k for Qwen), not reduced by TP. The
dtensor TP plan (:mod:`nrl_dtensor.building`) makes an untied ``lm_head`` column-parallel over
the vocabulary (``ColwiseParallel(output_layouts=Shard(-1))``): each rank holds ``[B, T, V /
tp]`` of its vocabulary slice (:func:`vocab_slice`), and the functions here give what the
unsharded path's ``log_softmax(...).gather(...)`` / ``topk`` give, with two small all-reduces
of ``[B, T]`` over the TP group: the log-sum-exp and the picked token's logit. Both carry gradients (to each rank's
own slice), so training back-propagates through them.

Temperature: divide the local logits by ``T`` before calling, as the unsharded path does.
"""

from __future__ import annotations

from typing import Any

import torch


def vocab_slice(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the vocabulary rank ``tp_rank`` holds when a ``[V, H]`` weight is
    sharded on dim 0 as DTensor's ``Shard(0)`` does (``torch.chunk``: ``ceil(V / tp)`` rows
    per rank, the last ranks fewer or none)."""
    per = -(-vocab_size // tp_size)
    start = min(tp_rank * per, vocab_size)
    return start, min(start + per, vocab_size)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce sum forward; the gradient passes through unchanged. Every TP rank computes
    the same loss from the summed (replicated) value, so each rank's local input gets the
    loss's gradient once (Megatron's ``reduce_from_tensor_model_parallel_region``); an
    all-reduce in the backward too would count it ``tp`` times."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _SumOverRanks.apply(x, group)


def log_normalizer(local_logits: torch.Tensor, group: Any) -> torch.Tensor:
    """``[..., 1]`` log-sum-exp over the whole vocabulary of ``[..., V / tp]`` local logits.
    The max is only a shift for stability: taken without a gradient (the result's gradient
    does not depend on it)."""
    import torch.distributed as dist

    shift = local_logits.detach().amax(-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    total = _sum((local_logits - shift).exp().sum(-1, keepdim=True), group)
    return shift + total.log()


def logprobs_of(
    local_logits: torch.Tensor, ids: torch.Tensor, vocab_start: int, group: Any
) -> torch.Tensor:
    """Logprobs ``[..., K]`` of token ``ids`` ``[..., K]`` (global vocabulary ids) from the
    ``[..., V / tp]`` local logits of the slice starting at ``vocab_start``; every rank gets
    the same values. ``K = 1`` for the sampled tokens, ``k`` for a teacher's top-k ids."""
    width = local_logits.shape[-1]
    local_ids = ids - vocab_start
    mine = (local_ids >= 0) & (local_ids < width)
    picked = local_logits.gather(-1, local_ids.clamp(0, max(width - 1, 0)))
    # where, not a product: a masked logit may be -inf.
    picked = _sum(torch.where(mine, picked, torch.zeros_like(picked)), group)
    return picked - log_normalizer(local_logits, group)


def token_logprobs(
    local_logits: torch.Tensor, input_ids: torch.Tensor, vocab_start: int, group: Any
) -> torch.Tensor:
    """``[B, T]`` logprobs of ``input_ids`` as the unsharded path computes them: position 0 is
    0, position ``t`` is token ``t`` under the logits of position ``t - 1``
    (``local_logits`` ``[B, T, V / tp]``, all positions)."""
    lp = logprobs_of(local_logits[:, :-1], input_ids[:, 1:, None], vocab_start, group)
    return torch.nn.functional.pad(lp.squeeze(-1), (1, 0))


def vocab_parallel_topk(
    local_logits: torch.Tensor, ids: torch.Tensor, k: int, vocab_start: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without a graph (a distillation teacher): the logprobs ``[...]`` of ``ids`` ``[...]``
    and the ``k' = min(k, V)`` largest logprobs and their global ids ``[..., k']`` from the
    ``[..., V / tp]`` local logits. Each rank's own top ``k'`` (padded with ``-inf`` where its
    slice is narrower), all-gathered: ``[..., tp * k']``, of which the overall top ``k'``,
    minus the log normaliser. Every rank gets the same values."""
    import torch.distributed as dist

    tp = dist.get_world_size(group)
    width = local_logits.shape[-1]
    # The whole vocabulary: the sum of the slices' widths (a tensor on the logits' device, so
    # that NCCL takes it too).
    vocab = torch.tensor([width], device=local_logits.device)
    dist.all_reduce(vocab, group=group)
    vocab = int(vocab.item())
    kk = min(k, vocab)
    mine = min(kk, width)
    values, local_ids = local_logits.topk(mine, dim=-1)
    pad = kk - mine
    values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    local_ids = torch.nn.functional.pad(local_ids + vocab_start, (0, pad))
    all_values = [torch.empty_like(values) for _ in range(tp)]
    all_ids = [torch.empty_like(local_ids) for _ in range(tp)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, local_ids.contiguous(), group=group)
    values, where = torch.cat(all_values, -1).topk(kk, dim=-1)
    top_ids = torch.cat(all_ids, -1).gather(-1, where)
    normalizer = log_normalizer(local_logits, group)
    token_lp = logprobs_of(local_logits, ids[..., None], vocab_start, group).squeeze(-1)
    return token_lp, values - normalizer, top_ids
