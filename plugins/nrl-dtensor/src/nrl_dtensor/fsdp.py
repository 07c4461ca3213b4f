"""FSDP2 helpers of the dtensor policy: keeping the weights gathered for a generation call, and
the gradient reduce-scatter on gloo."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist


def fsdp_modules(model) -> list:
    """The FSDP2 units of ``model`` (the modules ``fully_shard`` was applied to), root included."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_fsdp_weights(model, reshard_after_forward: bool = True) -> Iterator[None]:
    """Keep every FSDP2 module of ``model`` unsharded from entry to exit: one all-gather per
    module on entry (instead of one per module and forward).

    Costs one full copy of the weights per rank meanwhile. A no-op for a model without FSDP
    modules. On exit every module but the root (which always keeps its parameters after a
    forward) gets ``reshard_after_forward`` back, the setting the model was sharded with, and
    the weights are left as FSDP itself leaves them after a forward under that setting:
    resharded, or (``False``) still gathered, so that the next training forward needs no
    all-gather (the backward reshards; a state dict reshards first).
    """
    modules = fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        for module in modules:
            module.unshard()
        yield
    finally:
        for module in modules:
            module.set_reshard_after_forward(
                reshard_after_forward and module is not model, recurse=False
            )
            if reshard_after_forward:
                module.reshard()


class AllReduceScatter:
    """FSDP2's gradient reduce-scatter as one all-reduce plus this rank's slice, for gloo.

    Installed with ``FSDPModule.set_custom_reduce_scatter`` on CPU ranks: gloo's all-reduce of a
    whole model's gradients takes about 60% of the time of its reduce-scatter (6.9 vs 11.8 ms
    for 3.2M float32 parameters on 2 ranks, measured). The result is the same sum: FSDP lays the
    input out as one contiguous chunk per rank, in rank order, and reads chunk ``rank`` back.
    """

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        if async_op:  # FSDP2 calls it synchronously; an async caller would need a Work
            raise NotImplementedError("AllReduceScatter runs synchronously only")
        dist.all_reduce(input_tensor, op=op, group=group)
        chunks = input_tensor.view(dist.get_world_size(group), -1)
        output_tensor.copy_(chunks[dist.get_rank(group)])
