"""Test-only loss and batch builders (importable by the spawned ranks)."""

from __future__ import annotations

import torch
from nrl_dtensor.worker import DTensorPolicyWorker

from nrl_core.data import Batch, pad_sequences
from nrl_core.interfaces import GlobalBatchStats


class TokenMeanNLL:
    """Token-mean negative log-likelihood over ``loss_mask``, normalised by the GLOBAL token
    count (the core's loss contract)."""

    needs_reference = False
    needs_prev_logprobs = False

    def __call__(self, logprobs, batch, stats: GlobalBatchStats):
        mask = batch["loss_mask"] * batch["sample_mask"][:, None]
        nll = -(logprobs * mask).sum()
        return nll / stats.valid_tokens, {
            "nll_sum": float(nll.detach()),
            "tokens": float(mask.sum()),
        }


def make_batch(
    num: int, seed: int = 0, vocab: int = 100, min_len: int = 6, max_len: int = 24
) -> Batch:
    """Random sequences of varying lengths with the first 3 tokens as "prompt" (right padded)."""
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
    mask = batch["loss_mask"] * batch["sample_mask"][:, None]
    return GlobalBatchStats(
        valid_tokens=float(mask.sum()),
        valid_sequences=float((mask.sum(1) > 0).sum()),
        max_sequence_length=max_len,
    )


class InspectableWorker(DTensorPolicyWorker):
    """The policy worker plus a way for tests to read its full weights through Ray (a Ray
    method cannot return ``state_dict_buckets``' generator; every rank must iterate it)."""

    def bucket_list(self, bucket_bytes: int) -> list[dict]:
        return list(self.state_dict_buckets(bucket_bytes))

    def generate_counting_collectives(self, prompts, params) -> tuple:
        """``generate`` plus the all-gathers and all-reduces it issued on this rank, and
        whether every parameter is sharded again afterwards."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        counts = {"all_gather": 0, "all_reduce": 0}
        # FSDP2 gathers through dist.all_gather_single; a torch that renames it counts 0
        # gathers, which the test refuses.
        originals = {"all_gather": dist.all_gather_single, "all_reduce": dist.all_reduce}

        def counting(kind):
            def call(*args, **kwargs):
                counts[kind] += 1
                return originals[kind](*args, **kwargs)

            return call

        dist.all_gather_single = counting("all_gather")
        dist.all_reduce = counting("all_reduce")
        try:
            out = self.generate(prompts, params)
        finally:
            dist.all_gather_single = originals["all_gather"]
            dist.all_reduce = originals["all_reduce"]
        sharded = all(isinstance(p, DTensor) for p in self.model.parameters())
        return out, counts, sharded

    def is_sharded(self) -> bool:
        return self.sharded

    def _clip_gradients(self) -> float:
        # After the data-parallel reduction, before the step: the gradients the step applies.
        self.applied_gradients = {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        return super()._clip_gradients()

    def last_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients of the last optimizer step (see :meth:`_clip_gradients`)."""
        return self.applied_gradients

    def gradients_through_shared_memory(self) -> bool | None:
        reduce = self._gradient_all_reduce
        return None if reduce is None else reduce.shared

    def num_fsdp_modules(self) -> int:
        from nrl_dtensor.fsdp import fsdp_modules

        return len(fsdp_modules(self.model))

    def reduce_scatter_both_ways(self, numel: int) -> tuple[float, bool]:
        """gloo's reduce-scatter and :class:`~nrl_dtensor.fsdp.AllReduceScatter` of the same
        random per-rank input: the largest difference, and whether the policy's FSDP units use
        the latter."""
        import torch.distributed as dist
        from nrl_dtensor.fsdp import AllReduceScatter

        world = dist.get_world_size()
        x = torch.randn(numel * world, generator=torch.Generator().manual_seed(self.rank))
        expected, got = torch.empty(numel), torch.empty(numel)
        dist.reduce_scatter_tensor(expected, x.clone())
        AllReduceScatter()(got, x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        groups = self.model._get_fsdp_state()._fsdp_param_groups
        installed = all(isinstance(g._reduce_scatter_comm, AllReduceScatter) for g in groups)
        return float((expected - got).abs().max()), installed


class SmallHostWorker(InspectableWorker):
    """A worker on a host with too little memory for replicas of the model."""

    @staticmethod
    def _host_memory_bytes() -> int:
        return 1 << 20
