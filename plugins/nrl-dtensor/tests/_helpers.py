"""Test-only policy workers of the dtensor tests (importable by the Ray actors); the loss and
batch builders they share with other policy plugins are in :mod:`nrl_core.testing.batches`."""

from __future__ import annotations

import torch
from nrl_dtensor.worker import DTensorPolicyWorker


class InspectableWorker(DTensorPolicyWorker):
    """The policy worker plus a way for tests to read its full weights through Ray (a Ray
    method cannot return ``state_dict_buckets``' generator; every rank must iterate it)."""

    def bucket_list(self, bucket_bytes: int, layout: str = "in_memory") -> list[dict]:
        return list(self.state_dict_buckets(bucket_bytes, layout))

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

    def materialised_logits_shape(self, input_ids: torch.Tensor) -> tuple[int, ...]:
        """The shape of the logits this rank holds after a forward (its local shard of a
        vocabulary-parallel DTensor)."""
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        return tuple((logits.to_local() if hasattr(logits, "to_local") else logits).shape)

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


def build_counting_reads(rank: int, port: int, path: str, options, out: str) -> None:
    """One rank of a 2-rank gloo world (``torch.multiprocessing.spawn`` target): build the
    policy and its frozen reference, counting this rank's ``safe_open`` calls (how transformers
    reads checkpoint tensors from disk), and save the counts, the full weights and buffers."""
    import os

    import transformers.modeling_utils as modeling_utils

    from nrl_core.config.schema import GRPOConfig, PolicyConfig
    from nrl_core.interfaces import ComponentContext

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    reads = []
    original = modeling_utils.safe_open

    def counting_safe_open(file, *args, **kwargs):
        reads.append(str(file))
        return original(file, *args, **kwargs)

    modeling_utils.safe_open = counting_safe_open
    config = GRPOConfig(seed=0, policy=PolicyConfig(model_name=path))
    context = ComponentContext(config=config, rank=rank, world_size=2, seed=config.seed)
    worker = InspectableWorker(options, context)
    policy_reads = len(reads)
    reference = worker.reference.model()
    modeling_utils.safe_open = original
    weights = {k: v for bucket in worker.bucket_list(1 << 16) for k, v in bucket.items()}
    ref_weights = {}
    for name, tensor in reference.state_dict().items():
        ref_weights[name] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    buffers = {name: b.clone() for name, b in worker.model.named_buffers()}
    torch.save(
        {
            "policy_reads": policy_reads,
            "reference_reads": len(reads) - policy_reads,
            "weights": weights,
            "reference": {k: v.detach().clone() for k, v in ref_weights.items()},
            "buffers": buffers,
            "sharded": worker.sharded,
        },
        f"{out}/rank{rank}.pt",
    )
    import torch.distributed as dist

    dist.destroy_process_group()
