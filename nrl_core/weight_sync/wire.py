"""The wire form: refit messages as plain data for RPC layers that carry no Python objects
(vLLM's msgpack ``collective_rpc``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.weight_sync.cuda_ipc import CudaIpcHandle
from nrl_core.weight_sync.interface import TRANSPORTS, BucketHandle, WeightSyncError
from nrl_core.weight_sync.nccl import NcclBroadcastHandle
from nrl_core.weight_sync.packing import _dtype, _dtype_name
from nrl_core.weight_sync.shm import SharedMemoryHandle

# Ray pickles the refit messages (meta + handle) as they are, but an engine's own RPC layer may
# carry plain data only. vLLM 0.32 msgpack-encodes ``collective_rpc`` arguments whenever its
# engine core runs in another process (the default, VLLM_ENABLE_V1_MULTIPROCESSING=1):
# vllm/v1/engine/core_client.py:1010-1014 and :1091-1098 encode them with the MsgpackEncoder of
# vllm/v1/serial_utils.py:135-234, and the engine core decodes them untyped
# (vllm/v1/engine/core.py:1843, :1912-1913). On that path an attrs instance arrives as a plain
# dict (msgspec encodes attrs classes as maps), tuples arrive as lists, and a Python type or a
# torch dtype cannot be encoded at all (serial_utils.py:220-225) unless pickle is switched on
# (VLLM_ALLOW_INSECURE_SERIALIZATION, which nrl does not set). So such engines send the wire
# form below: dicts of str, int, bool, bytes, None and lists, rebuilt on the receiving side.

CUDA_IPC_ARGS: tuple[str, ...] = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
"""The parameters of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, in order: the
arguments ``reduce_tensor`` returns for a CUDA tensor (the wire form names each one)."""

_IPC_INTS = (
    "tensor_offset",
    "storage_device",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_offset",
)
_IPC_BYTES = ("storage_handle", "ref_counter_handle", "event_handle")
_IPC_BOOLS = ("requires_grad", "event_sync_required")


def _ipc_classes() -> dict[str, type]:
    """The tensor and storage classes ``reduce_tensor`` may name, by wire name: the receiver
    rebuilds a class only from this list, never from a name it was sent."""
    import torch

    return {
        "Tensor": torch.Tensor,
        "Parameter": torch.nn.Parameter,
        "TypedStorage": torch.storage.TypedStorage,
        "UntypedStorage": torch.UntypedStorage,
    }


def _ipc_plain(args: dict[str, Any]) -> dict[str, Any]:
    """The primitive fields of one GPU's rebuild arguments, normalised (tuples or lists to
    lists of int; bytes-like to bytes) in either direction."""
    out = {
        "tensor_size": [int(d) for d in args["tensor_size"]],
        "tensor_stride": [int(d) for d in args["tensor_stride"]],
    }
    out.update({k: int(args[k]) for k in _IPC_INTS})
    out.update({k: bool(args[k]) for k in _IPC_BOOLS})
    out.update({k: None if args[k] is None else bytes(args[k]) for k in _IPC_BYTES})
    return out


def _ipc_args_to_wire(args: Sequence[Any]) -> dict[str, Any]:
    if len(args) != len(CUDA_IPC_ARGS):
        raise WeightSyncError(
            f"CUDA IPC rebuild arguments have {len(args)} fields; torch's rebuild_cuda_tensor "
            f"takes {len(CUDA_IPC_ARGS)} ({', '.join(CUDA_IPC_ARGS)})"
        )
    named = dict(zip(CUDA_IPC_ARGS, args, strict=True))
    names = {cls: name for name, cls in _ipc_classes().items()}
    wire = _ipc_plain(named)
    for key in ("tensor_cls", "storage_cls"):
        if named[key] not in names:
            raise WeightSyncError(f"no wire form for a CUDA IPC {key} of {named[key]!r}")
        wire[key] = names[named[key]]
    wire["dtype"] = _dtype_name(named["dtype"])
    return wire


def _ipc_args_from_wire(wire: dict[str, Any]) -> tuple:
    classes = _ipc_classes()
    named = _ipc_plain(wire)
    for key in ("tensor_cls", "storage_cls"):
        if wire[key] not in classes:
            raise WeightSyncError(f"unknown CUDA IPC {key} {wire[key]!r} in a refit message")
        named[key] = classes[wire[key]]
    named["dtype"] = _dtype(str(wire["dtype"]))
    # Tuples, as reduce_tensor produced them (msgpack turned them into lists).
    named["tensor_size"] = tuple(named["tensor_size"])
    named["tensor_stride"] = tuple(named["tensor_stride"])
    return tuple(named[k] for k in CUDA_IPC_ARGS)


def handle_to_wire(handle: BucketHandle) -> dict[str, Any]:
    """``handle`` as plain data (``{"transport": "shm" | "cuda_ipc" | "nccl", ...}``) for RPC
    layers that carry no Python objects; :func:`handle_from_wire` rebuilds it. CUDA IPC keeps
    every argument of torch's ``rebuild_cuda_tensor`` (:data:`CUDA_IPC_ARGS`), its classes and
    dtype by name."""
    if isinstance(handle, SharedMemoryHandle):
        return {"transport": "shm", "name": handle.name}
    if isinstance(handle, CudaIpcHandle):
        by_gpu = {str(gpu): _ipc_args_to_wire(args) for gpu, args in handle.by_gpu.items()}
        return {"transport": "cuda_ipc", "by_gpu": by_gpu}
    if isinstance(handle, NcclBroadcastHandle):
        return {"transport": "nccl", "group": handle.group}
    raise WeightSyncError(f"no wire form for a bucket handle of type {type(handle).__name__}")


def handle_from_wire(data: dict[str, Any]) -> BucketHandle:
    """The handle that :func:`handle_to_wire` described (lists or tuples, bytes-like values
    all accepted); anything else is a :class:`WeightSyncError` naming what was received."""
    try:
        transport = data["transport"]
        if transport == "shm":
            return SharedMemoryHandle(str(data["name"]))
        if transport == "cuda_ipc":
            by_gpu = {str(g): _ipc_args_from_wire(a) for g, a in data["by_gpu"].items()}
            return CudaIpcHandle(by_gpu)
        if transport == "nccl":
            return NcclBroadcastHandle(str(data["group"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WeightSyncError(
            f"a refit message carries a malformed bucket handle ({type(exc).__name__}: "
            f"{exc}; got {type(data).__name__}); send handle_to_wire(handle)"
        ) from None
    raise WeightSyncError(
        f"unknown transport {transport!r} in a refit message; use one of {TRANSPORTS}"
    )
