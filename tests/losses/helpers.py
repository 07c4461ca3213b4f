"""Shared builders for the loss tests: small float64 batches and the invariance checks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.training import reduce_metrics

T = torch.float64


def tensor(values) -> torch.Tensor:
    """A float64 tensor (the tests compare with hand-computed numbers at 1e-9)."""
    return torch.tensor(values, dtype=T)


def make_batch(**values) -> Batch:
    """A :class:`Batch` from nested lists, every key as float64."""
    return Batch({key: tensor(value) for key, value in values.items()})


def leaf(values) -> torch.Tensor:
    """Logprobs that require grad, like the policy's output."""
    return tensor(values).requires_grad_(True)


def global_stats(batch: Batch, max_sequence_length: int = 16) -> GlobalBatchStats:
    """The normalisers the core computes over a whole global batch."""
    mask = batch["loss_mask"]
    if "sample_mask" in batch:
        mask = mask * batch["sample_mask"][:, None]
    valid_tokens = float(mask.sum())
    valid_sequences = float((mask.sum(dim=1) > 0).sum())
    return GlobalBatchStats(
        valid_tokens=valid_tokens,
        valid_sequences=valid_sequences,
        max_sequence_length=max_sequence_length,
    )


def loss_and_grad(
    loss_fn: Callable, logprobs: torch.Tensor, parts: list[Batch], stats: GlobalBatchStats
) -> tuple[float, torch.Tensor, dict[str, float]]:
    """Run the loss on each part (micro batch or rank shard) of ``logprobs``' batch, summing
    losses and gradients and reducing metrics the way the core does.

    ``parts`` must be consecutive row slices; their row counts split ``logprobs``.
    """
    logprobs = logprobs.detach()
    grads, total, metrics = [], 0.0, []
    start = 0
    for part in parts:
        rows = logprobs[start : start + len(part)].clone().requires_grad_(True)
        start += len(part)
        loss, part_metrics = loss_fn(rows, part, stats)
        loss.backward()
        total += float(loss.detach())
        grads.append(rows.grad)
        metrics.append(part_metrics)
    return total, torch.cat(grads), reduce_metrics(metrics)


def random_loss_mask(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """A right-padded ``rows x width`` loss mask: each row skips a prompt of 1-3 tokens, then
    has at least one generated token, then padding."""
    loss_mask = torch.zeros(rows, width, dtype=T)
    for i in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=gen))
        stop = int(torch.randint(start + 1, width + 1, (1,), generator=gen))
        loss_mask[i, start:stop] = 1.0
    return loss_mask


def random_policy_batch(
    seed: int = 0, rows: int = 8, width: int = 12
) -> tuple[torch.Tensor, Batch]:
    """A random right-padded batch with every key the clipped PG loss reads.

    Each row has a prompt of 1-3 tokens, then 1..(width - prompt) generated tokens, then
    padding; one row has ``sample_mask`` 0 and one row is all prompt (no valid token).
    """
    gen = torch.Generator().manual_seed(seed)
    loss_mask = random_loss_mask(gen, rows, width)
    loss_mask[rows - 1] = 0.0

    def logp() -> torch.Tensor:
        return -torch.rand(rows, width, generator=gen, dtype=T) * 3

    logprobs = logp()
    prev = logprobs + 0.7 * torch.randn(rows, width, generator=gen, dtype=T)
    gen_lp = prev + 0.6 * torch.randn(rows, width, generator=gen, dtype=T)
    ref = logprobs + 0.5 * torch.randn(rows, width, generator=gen, dtype=T)
    advantages = torch.randn(rows, generator=gen, dtype=T)
    sample_mask = torch.ones(rows, dtype=T)
    sample_mask[2] = 0.0
    batch = Batch(
        {
            "loss_mask": loss_mask,
            "prev_logprobs": prev,
            "gen_logprobs": gen_lp,
            "ref_logprobs": ref,
            "advantages": advantages,
            "sample_mask": sample_mask,
        }
    )
    return logprobs, batch


def right_pad(logprobs: torch.Tensor, batch: Batch, extra: int) -> tuple[torch.Tensor, Batch]:
    """Append ``extra`` masked columns holding garbage (inf, NaN, huge values)."""
    garbage = {
        "logprobs": float("inf"),
        "prev_logprobs": float("-inf"),
        "gen_logprobs": float("nan"),
        "ref_logprobs": float("nan"),
        "advantages": float("nan"),
    }

    def pad(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=1)

    tensors = {}
    for key, value in batch.tensors.items():
        if value.dim() == 2:
            value = pad(value, 0.0 if key == "loss_mask" else garbage[key])
        tensors[key] = value
    return pad(logprobs, garbage["logprobs"]), Batch(tensors)
