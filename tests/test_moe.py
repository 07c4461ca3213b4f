"""The core's router statistics (nrl_core.moe) without a model library: what they count over a
training step's micro batches, and that counting stays on the router's device."""

from __future__ import annotations

import pytest
import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.moe import RouterStatistics
from nrl_core.packing import PackedSequences
from nrl_core.training import train_on_rank

EXPERTS, TOP_K, HIDDEN = 4, 2, 8


class _TopK(RouterStatistics):
    """A router returning ``[tokens, experts]`` logits; top-k of their softmax."""

    def routing(self, router, args, output):
        probs = torch.softmax(output.float(), dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(TOP_K, dim=-1).indices, 1.0)
        return probs, chosen


class _MoEWorker:
    """One rank of a one-layer 'model': token embeddings through a linear router."""

    supports_sequence_packing = True

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.randn(64, HIDDEN, generator=generator)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=generator))
        self.stats = _TopK([self.router], [EXPERTS])

    def forward_backward(self, micro_batch, loss):
        packed = isinstance(micro_batch, PackedSequences)
        ids = micro_batch.input_ids if packed else micro_batch["input_ids"]
        with self.stats.collecting(micro_batch):
            logits = self.router(self.embed[ids.reshape(-1)])  # batch-major tokens
        loss(logits[:, 0].reshape(ids.shape))

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0, **self.stats.metrics()}


def _loss(logprobs, batch, stats):
    return logprobs.sum(), {}


_loss.needs_reference = _loss.needs_prev_logprobs = False


def _reference(worker: _MoEWorker, micro_batches: list[Batch]) -> dict[str, float]:
    """The statistics of the real tokens alone, computed here from the router weights."""
    tokens = torch.cat(
        [mb["input_ids"][row, :n] for mb in micro_batches for row, n in enumerate(mb["lengths"])]
    )
    with torch.no_grad():
        probs = torch.softmax(worker.router(worker.embed[tokens]), dim=-1).double()
    counts = torch.bincount(probs.topk(TOP_K, dim=-1).indices.reshape(-1), minlength=EXPERTS)
    counts = counts.double()
    return {
        "moe/load_cv": float(counts.std(correction=0) / counts.mean()),
        "moe/max_load": float(counts.max() / counts.mean()),
        "moe/aux_loss": float(EXPERTS * (counts / len(tokens) * probs.mean(0)).sum()),
    }


@pytest.mark.parametrize("packed", [False, True])
def test_filler_micro_batches_count_in_no_router_statistic(packed):
    """Review m3: a rank out of micro batches runs fillers (copies of its first sample) so that
    collectives stay aligned; their tokens are not the step's and must not count in moe/*."""
    ids = torch.arange(30).reshape(3, 10) % 64
    lengths = [torch.tensor([10, 4]), torch.tensor([7])]
    micro_batches = [
        Batch({"input_ids": ids[:2], "lengths": lengths[0]}),
        Batch({"input_ids": ids[2:] * 2 % 64, "lengths": lengths[1]}),
    ]
    worker = _MoEWorker()
    stats = GlobalBatchStats(valid_tokens=21, valid_sequences=3, max_sequence_length=10)
    # 2 real micro batches, 3 filler passes of micro_batches[0]'s first sample.
    result = train_on_rank(worker, micro_batches, 5, _loss, stats, 1.0, packed)
    expected = _reference(worker, micro_batches)
    assert result.step_metrics == pytest.approx(expected, rel=1e-9)
    # The statistics with the fillers counted differ (the test can tell): 21 + 3 x 10 tokens.
    with_fillers = _reference(worker, [*micro_batches, *[micro_batches[0].slice(0, 1)] * 3])
    assert with_fillers["moe/load_cv"] != pytest.approx(expected["moe/load_cv"], rel=1e-6)


def test_counting_never_copies_to_the_host():
    """Review m3: two host copies per MoE layer and micro batch stalled the GPU stream. Sums
    stay on the router's device until metrics() reads them; on the meta device (no data) any
    copy to the host fails."""
    router = torch.nn.Identity()
    stats = _TopK([router], [EXPERTS])
    batch = Batch(
        {"input_ids": torch.zeros(2, 5, dtype=torch.long), "lengths": torch.tensor([5, 3])}
    )
    logits = torch.empty(10, EXPERTS, device="meta")
    with stats.collecting(batch):
        router(logits)
        router(logits)
    assert stats._counts[0].device.type == "meta"
    assert stats._probs[0].device.type == "meta"
