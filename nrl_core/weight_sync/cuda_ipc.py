"""The CUDA IPC transport (``cuda_ipc``): engines colocated on the policy's GPUs open the
packed bucket where it already sits (GPU-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.weight_sync.interface import BucketMeta, Post, Wait, WeightSyncError
from nrl_core.weight_sync.packing import bucket_layout, pack_bucket

if TYPE_CHECKING:
    import torch


@attrs.frozen
class CudaIpcHandle:
    """CUDA IPC handles of a packed GPU buffer, keyed by the physical GPU's UUID, so that each
    engine rank opens the copy that already sits on its own GPU (colocated refit).

    ``args`` are :func:`torch.multiprocessing.reductions.reduce_tensor`'s rebuild arguments
    (Python types and a torch dtype among them: Ray pickles them as they are, plain-data RPC
    layers such as vLLM's need :func:`handle_to_wire`). GPU-only; has not run in this
    repository.
    """

    by_gpu: dict[str, tuple] = attrs.field(factory=dict)

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = torch.cuda.current_device() if device is None else torch.device(device).index
        gpu = str(torch.cuda.get_device_properties(index).uuid)
        if gpu not in self.by_gpu:
            raise WeightSyncError(
                f"no CUDA IPC handle for GPU {gpu}: the cuda_ipc transport needs every engine "
                "rank on a GPU of a policy rank (colocated); use transport nccl otherwise"
            )
        args = list(self.by_gpu[gpu])
        args[6] = index  # the device index in the receiver's CUDA_VISIBLE_DEVICES numbering
        return rebuild_cuda_tensor(*args)

    def close(self) -> None:
        return None


def send_ipc(
    bucket: dict[str, torch.Tensor],
    post: Post,
    wait: Wait,
    lead: bool,
    gather_object,
    share: bool = True,
) -> int:
    """One policy rank's part of a ``cuda_ipc`` bucket: pack it on this rank's GPU (when
    ``share``), exchange every rank's handle through ``gather_object``, and on the lead rank
    have every engine load it. A collective of every policy rank; returns the payload bytes."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if not share:
        # No engine on this rank's GPU: no packed copy, no handle; it still takes part in
        # the exchange and the barrier (collectives of every policy rank).
        meta = bucket_layout(bucket)
        handles = gather_object({}) if gather_object is not None else [{}]
        if lead:
            _deliver(meta, handles, post, wait)
        if gather_object is not None:
            gather_object(None)
        return meta.payload_bytes
    flat, meta = pack_bucket(bucket)
    if flat.device.type != "cuda":
        raise WeightSyncError("the cuda_ipc transport needs the policy's weights on a GPU")
    gpu = str(torch.cuda.get_device_properties(flat.device).uuid)
    # Rebuild arguments, not a pickled tensor: a receiver opens them where the bucket is
    # loaded (vLLM: in its GPU worker), or passes them on unopened when another process of
    # its own loads it (SGLang: nrl_sglang.worker._ipc_payloads), since a CUDA tensor it
    # received could not be pickled on by it.
    _, args = reduce_tensor(flat)
    mine = {gpu: args}
    handles = gather_object(mine) if gather_object is not None else [mine]
    if lead:
        _deliver(meta, handles, post, wait)
    if gather_object is not None:
        gather_object(None)  # a barrier: no rank frees its buffer while engines read it
    torch.cuda.synchronize(flat.device)
    del flat
    return meta.payload_bytes


def _deliver(meta: BucketMeta, handles: list[dict[str, tuple]], post: Post, wait: Wait) -> None:
    """Every engine loads the bucket from the copy on its own GPU (all ranks' handles)."""
    merged: dict[str, tuple] = {}
    for part in handles:
        merged.update(part)
    wait(post(meta, CudaIpcHandle(merged)))
