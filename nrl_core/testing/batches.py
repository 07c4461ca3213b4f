"""Test losses and batches for policy plugins: a token-mean NLL under the core's loss contract,
random right-padded batches and their global normalisers (importable by spawned ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nrl_core.data import Batch
    from nrl_core.interfaces import GlobalBatchStats


class TokenMeanNLL:
    """Token-mean negative log-likelihood over ``loss_mask * sample_mask`` (``sample_mask``
    where the batch has one), normalised by the GLOBAL token count (the core's loss contract).
    The policy plugins' tests and the conformance suites train with it."""

    needs_reference = False
    needs_prev_logprobs = False

    def __call__(self, logprobs, batch, stats: GlobalBatchStats):
        mask = batch["loss_mask"].to(logprobs.dtype)
        if "sample_mask" in batch:
            mask = mask * batch["sample_mask"].to(logprobs.dtype)[:, None]
        nll = -(logprobs * mask).sum()
        tokens = max(stats.valid_tokens, 1.0)  # a batch with no valid token contributes 0
        # Like every real loss, it reports its own value as `loss` too.
        return nll / tokens, {
            "loss": float(nll.detach()) / tokens,
            "nll_sum": float(nll.detach()),
            "tokens": float(mask.sum()),
        }


class NaNLoss(TokenMeanNLL):
    """:class:`TokenMeanNLL` times NaN: every gradient is NaN (what NaN rewards or advantages
    give). A policy must not apply such a step (issue 40)."""

    def __call__(self, logprobs, batch, stats: GlobalBatchStats):
        loss, metrics = super().__call__(logprobs, batch, stats)
        return loss * float("nan"), metrics


def make_batch(
    num: int, seed: int = 0, vocab: int = 100, min_len: int = 6, max_len: int = 24
) -> Batch:
    """Random sequences of varying lengths with the first 3 tokens as "prompt" (right padded)."""
    import torch

    from nrl_core.data import Batch, pad_sequences

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g)
    seqs = [torch.randint(7, vocab, (int(n),), generator=g).tolist() for n in lengths]
    ids = pad_sequences(seqs, pad_value=0)
    width = ids.shape[1]
    pos = torch.arange(width)[None, :]
    loss_mask = ((pos >= 3) & (pos < lengths[:, None])).float()
    return Batch(
        {
            "input_ids": ids,
            "lengths": lengths,
            "loss_mask": loss_mask,
            "sample_mask": torch.ones(num),
        }
    )


def stats_for(batch: Batch, max_len: int = 512) -> GlobalBatchStats:
    """The global normalisers of ``batch``."""
    from nrl_core.interfaces import GlobalBatchStats

    mask = batch["loss_mask"] * batch["sample_mask"][:, None]
    return GlobalBatchStats(
        valid_tokens=float(mask.sum()),
        valid_sequences=float((mask.sum(1) > 0).sum()),
        max_sequence_length=max_len,
    )
