"""Weight sync ("refit"): moving a policy's current weights into a generation engine.

Kept apart from generation: an engine only has to *receive* buckets (see
:class:`~nrl_core.interfaces.WeightSync`); the policy plugin only has to *yield* its full state dict in
size-bounded buckets with the engine's parameter names (for ``dtensor``: Hugging Face names,
which both vLLM and SGLang load). Everything in between lives here and is engine-independent:

* **packing**: a bucket ``{name: tensor}`` becomes one flat ``uint8`` buffer plus a
  :class:`BucketMeta` (name, dtype, shape, byte offset of each tensor). One buffer per bucket
  means one IPC handle, one broadcast or one shared-memory segment per bucket instead of one per
  tensor. :func:`unpack_bucket` reverses it bit-exactly (views of the same bytes).
* **transports**, each a small picklable *handle* that the sender creates per bucket and the
  receiver turns back into the flat buffer with :meth:`BucketHandle.open`:

  - :class:`SharedMemoryHandle`: a POSIX shared-memory segment (``/dev/shm``); CPU, same node.
    Used by the tests and by CPU runs; it is the only transport that has run in this repository.
  - :class:`CudaIpcHandle`: CUDA IPC handles of the sender's GPU buffer, one per GPU (UUID), for
    engines colocated on the trainer's GPUs. GPU-only; has not run.
  - :class:`NcclBroadcastHandle`: a broadcast from trainer rank 0 over an NCCL group spanning
    that rank and every engine rank (:func:`init_nccl_group`), for engines on their own GPUs.
    GPU-only; has not run.

* **sending**: :class:`WeightSender` runs inside the policy workers (``push_weights``), iterates
  the policy's buckets on every rank, and calls each engine's ``receive_bucket`` through Ray.
  It returns a :class:`RefitStats` (seconds, bytes, buckets) that the driver logs as
  ``timing/refit_s`` and ``refit/bytes``.

Nothing here imports an engine; torch is imported lazily so that ``nrl --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch

Transport = Literal["shm", "cuda_ipc", "nccl"]
TRANSPORTS: tuple[str, ...] = ("shm", "cuda_ipc", "nccl")

_ALIGN = 16
"""Byte alignment of every tensor inside a packed buffer, so that ``view(dtype)`` of any
element size (up to complex128) is legal and vectorised copies stay aligned."""


class WeightSyncError(NrlError):
    """A refit cannot run as configured (wrong transport for the placement, mismatched names)."""


# ---------------------------------------------------------------------------------------------
# Packing


@attrs.frozen
class TensorMeta:
    """Where one tensor lives inside a packed bucket."""

    name: str
    dtype: str
    """The torch dtype's name without ``torch.`` (``"bfloat16"``), so the meta pickles and
    prints without torch."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset inside the flat buffer (a multiple of 16)."""
    nbytes: int

    def to_wire(self) -> dict[str, Any]:
        """This meta as plain data (see "Wire form" below); :meth:`from_wire` reverses it."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TensorMeta:
        """The meta that :meth:`to_wire` described (the shape may arrive as a list)."""
        shape = tuple(int(d) for d in data["shape"])
        return cls(
            str(data["name"]), str(data["dtype"]), shape, int(data["offset"]), int(data["nbytes"])
        )


@attrs.frozen
class BucketMeta:
    """The layout of one packed bucket: what :func:`unpack_bucket` needs besides the bytes."""

    tensors: tuple[TensorMeta, ...]
    nbytes: int
    """Size of the flat buffer (the padded sum of the tensors' sizes)."""

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, padding excluded (what "bytes moved" reports)."""
        return sum(t.nbytes for t in self.tensors)

    def to_wire(self) -> dict[str, Any]:
        """This layout as plain data (dicts, lists, str, int), for RPC layers that carry no
        Python objects (see "Wire form" below); :meth:`from_wire` reverses it."""
        return {"tensors": [t.to_wire() for t in self.tensors], "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BucketMeta:
        """The layout that :meth:`to_wire` described, whether its lists arrive as lists or
        tuples; anything else is a :class:`WeightSyncError` naming what was received."""
        try:
            tensors = tuple(TensorMeta.from_wire(t) for t in data["tensors"])
            return cls(tensors, int(data["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightSyncError(
                f"a refit message carries a malformed bucket meta ({type(exc).__name__}: "
                f"{exc}; got {type(data).__name__}); send BucketMeta.to_wire()"
            ) from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown tensor dtype {name!r} in a weight bucket")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def bucket_layout(tensors: dict[str, torch.Tensor]) -> BucketMeta:
    """The :class:`BucketMeta` that :func:`pack_bucket` would produce, without copying."""
    metas, offset = [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(
            TensorMeta(name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes)
        )
        offset = _aligned(offset + nbytes)
    return BucketMeta(tuple(metas), offset)


def pack_bucket(
    tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, BucketMeta]:
    """Copy ``tensors`` into one flat ``uint8`` buffer on their device; return it and its meta.

    ``out`` (a ``uint8`` tensor of at least ``meta.nbytes``, e.g. a shared-memory view or a
    reused staging buffer) receives the bytes instead of a fresh allocation. All tensors must be
    on one device. The bytes are copied verbatim (no dtype conversion), so unpacking is
    bit-exact.
    """
    import torch

    meta = bucket_layout(tensors)
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise WeightSyncError(
            f"a weight bucket spans several devices ({sorted(map(str, devices))})"
        )
    device = next(iter(devices)) if devices else torch.device("cpu")
    if out is None:
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.numel() < meta.nbytes:
            raise WeightSyncError(f"pack_bucket needs a uint8 buffer of {meta.nbytes} bytes")
        flat = out[: meta.nbytes]
    for tm, tensor in zip(meta.tensors, tensors.values(), strict=True):
        if tm.nbytes:
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[tm.offset : tm.offset + tm.nbytes].copy_(src)
    return flat, meta


def unpack_bucket(flat: torch.Tensor, meta: BucketMeta) -> dict[str, torch.Tensor]:
    """Views into ``flat`` with the names, dtypes and shapes of ``meta`` (no copy).

    Copy them (or load them into a model) before ``flat`` is released or reused.
    """
    import torch

    if flat.dtype != torch.uint8 or flat.numel() < meta.nbytes:
        raise WeightSyncError(
            f"a packed bucket needs {meta.nbytes} uint8 bytes; got {flat.numel()} {flat.dtype}"
        )
    out = {}
    for tm in meta.tensors:
        raw = flat[tm.offset : tm.offset + tm.nbytes]
        out[tm.name] = raw.view(_dtype(tm.dtype)).view(tm.shape)
    return out


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` (a larger single
    tensor gets a bucket of its own). For policies that do not bucket themselves."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------------
# Parameter names


@attrs.frozen
class NameMap:
    """Renames a policy's parameters to an engine's, and drops the ones the engine lacks.

    Owned by the policy plugin (it knows its layout); engines only ever see their own names.
    ``rename`` maps exact names; ``prefixes`` replaces leading prefixes (first match wins);
    names in ``drop`` (after renaming) are not sent.
    """

    rename: dict[str, str] = attrs.field(factory=dict)
    prefixes: tuple[tuple[str, str], ...] = ()
    drop: frozenset[str] = frozenset()

    def __call__(self, name: str) -> str | None:
        """The engine's name for ``name``, or None when it is not sent."""
        if name in self.rename:
            name = self.rename[name]
        else:
            for old, new in self.prefixes:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
        return None if name in self.drop else name

    def apply(self, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``bucket`` with engine names; dropped entries removed."""
        out = {}
        for name, tensor in bucket.items():
            mapped = self(name)
            if mapped is not None:
                out[mapped] = tensor
        return out


# ---------------------------------------------------------------------------------------------
# Transports: per-bucket handles


class BucketHandle(Protocol):
    """What a receiver gets next to a :class:`BucketMeta`: a way to reach the bucket's bytes."""

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        """The flat ``uint8`` buffer of the bucket, on ``device`` when the transport allows.
        Valid until :meth:`close`."""
        ...

    def close(self) -> None:
        """Release what :meth:`open` mapped (never frees the sender's memory)."""
        ...


@attrs.define
class SharedMemoryHandle:
    """A bucket in a POSIX shared-memory segment (``/dev/shm``); sender and receiver must be on
    the same node. The sender creates and unlinks the segment; the receiver maps it. Pickles
    (and crosses plain-data RPC, :func:`handle_to_wire`) as its segment name only."""

    name: str
    _shm: Any = attrs.field(default=None, init=False, repr=False, eq=False)

    def __getstate__(self) -> dict:
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.name = state["name"]
        self._shm = None

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:

        import torch

        try:
            self._shm = _attach_shm(self.name)
        except FileNotFoundError:
            raise WeightSyncError(
                f"shared-memory segment {self.name!r} not found: the shm transport needs the "
                "policy and the engine on the same node; use transport nccl across nodes"
            ) from None
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=meta.nbytes)
        if device is not None and torch.device(device).type != "cpu":
            return flat.to(device)
        return flat

    def close(self) -> None:
        if self._shm is not None:
            shm, self._shm = self._shm, None
            # A tensor view may still reference the mapping; it is then unmapped with the view.
            with contextlib.suppress(BufferError):
                shm.close()


def _attach_shm(name: str):
    """Map an existing segment without letting this process's resource tracker own it (the
    tracker would unlink the sender's segment, with a warning, when this process exits)."""
    from multiprocessing import resource_tracker, shared_memory

    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")
        return shm


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


@attrs.frozen
class NcclBroadcastHandle:
    """The bucket arrives by a broadcast from rank 0 of the group ``group`` (set up once with
    :func:`init_nccl_group` on the trainer's rank 0 and on every engine rank). GPU-only; has
    not run in this repository."""

    group: str

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        import torch

        pg = _NCCL_GROUPS.get(self.group)
        if pg is None:
            raise WeightSyncError(f"NCCL weight-sync group {self.group!r} is not initialised here")
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=device or "cuda")
        pg.broadcast(flat, 0).wait()
        return flat

    def close(self) -> None:
        return None


_NCCL_GROUPS: dict[str, Any] = {}


def init_nccl_group(
    name: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    device: Any = None,
    *,
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> None:
    """Join the refit group ``name`` used by :class:`NcclBroadcastHandle` (rank 0: the trainer).

    A stand-alone process group built from a ``TCPStore``: it does not touch the default group
    of the trainer (FSDP) or of the engine (its own tensor parallelism), so both sides can hold
    it next to their own. Call on all members at once; rank 0 hosts the store. ``backend`` is
    ``"nccl"`` (GPU tensors) or ``"gloo"`` (CPU tensors, for tests); ``timeout_s`` bounds the
    rendezvous and every collective. The NCCL path has not run in this repository.

    Members may be SGLang engine ranks, which join through SGLang's own
    ``init_custom_process_group`` (sglang/srt/utils/common.py:2859-2927, called by
    ``init_weights_update_group``): that wraps the rendezvous store in ``PrefixStore(name)``
    (common.py:2905), then torch's ``_new_process_group_helper`` wraps it in
    ``PrefixStore(f"{name}/")`` and, for the backend of the first device the backend serves,
    ``PrefixStore(f"{device}/")`` (torch/distributed/distributed_c10d.py:2734, 2764, 2921: ``cuda``
    for nccl, ``cpu`` for gloo; torch 2.14.1 on both sides). The backend exchanges its unique id
    through that innermost store, so this group must be built on the same three prefixes or the
    ranks never meet. It is built directly instead of through ``_new_process_group_helper``:
    that helper registers the group in torch's global state (names must be unique per process)
    and would split it off the trainer's default NCCL group when that one is bound to a device,
    which is not a group the engines are in.
    """
    import atexit
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    if backend not in ("nccl", "gloo"):
        raise WeightSyncError(f"refit group backend {backend!r}; use nccl or gloo")
    timeout = timedelta(seconds=timeout_s)
    listen_fd = None
    if rank == 0:
        # Listen on master_addr only (127.0.0.1 when every member runs on the driver's node):
        # TCPStore's own server would listen on every interface, without authentication. The
        # store takes the socket over (it closes it when it goes), hence detach().
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        listen_fd = socket.create_server((master_addr, master_port), family=family).detach()
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=listen_fd,
    )
    device_type = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    group_store = dist.PrefixStore(
        f"{device_type}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    )
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(group_store, rank, world_size, timeout)
    else:
        if device is not None:
            torch.cuda.set_device(device)
        # The options torch's own NCCL creator sets (distributed_c10d.py:682-713), no split.
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = name
        pg = dist.ProcessGroupNCCL(group_store, rank, world_size, options)
    atexit.unregister(_destroy_nccl_groups)  # registered once, however many groups
    atexit.register(_destroy_nccl_groups)
    _NCCL_GROUPS[name] = pg


def destroy_nccl_group(name: str) -> None:
    """Shut the group ``name`` down and forget it."""
    pg = _NCCL_GROUPS.pop(name, None)
    if pg is not None and hasattr(pg, "shutdown"):
        pg.shutdown()


def _destroy_nccl_groups() -> None:
    """Shut every group down while the interpreter still runs: a backend left to the
    interpreter's final teardown may destroy its threads unjoined, and the process then
    aborts on exit ("terminate called without an active exception", seen with gloo in
    tests/test_nccl_group.py)."""
    for name in list(_NCCL_GROUPS):
        destroy_nccl_group(name)


# ---------------------------------------------------------------------------------------------
# Wire form
#
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


# ---------------------------------------------------------------------------------------------
# Receiving


def receive_into(meta: BucketMeta, handle: BucketHandle, load, device: Any = None) -> int:
    """Open ``handle``, call ``load(list of (name, tensor))`` with views of the bucket, close.

    The helper every engine's ``receive_bucket`` uses, whatever the transport: ``load`` must
    copy the tensors (``model.load_weights`` does).
    """
    flat = handle.open(meta, device)
    try:
        load(list(unpack_bucket(flat, meta).items()))
    finally:
        del flat
        handle.close()
    return meta.payload_bytes


# ---------------------------------------------------------------------------------------------
# Sending


@attrs.frozen
class RefitStats:
    """What one refit moved and how long it took (reported on the sender's rank 0)."""

    seconds: float
    bytes: int
    buckets: int
    tensors: int

    def as_metrics(self) -> dict[str, float]:
        """The metrics logged each step: ``timing/refit_s``, ``refit/bytes``, ``refit/buckets``
        and ``refit/gb_per_s``."""
        return {
            "timing/refit_s": self.seconds,
            "refit/bytes": float(self.bytes),
            "refit/buckets": float(self.buckets),
            "refit/gb_per_s": self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0,
        }


@attrs.define
class WeightSender:
    """Pushes a policy's buckets to engine workers; built by the driver, run by the policy.

    The driver creates it with the engine workers' actor handles (``receivers``: Ray actor
    handles of :class:`nrl_core.distributed.worker_group.WorkerGroup` actors whose worker
    implements :class:`~nrl_core.interfaces.WeightSync`) and passes it to every policy rank's ``push_weights``;
    each rank calls :meth:`send` with its bucket iterator.

    Args:
        receivers: one actor handle per engine (its driver-facing worker).
        transport: ``shm`` (CPU, same node), ``cuda_ipc`` (colocated GPUs) or ``nccl``
            (separate GPUs, after :func:`init_nccl_group`).
        name_map: renames policy parameters to engine names (None: same names).
        dtype: cast floating-point tensors to this dtype before sending (e.g. ``"bfloat16"``
            for a bf16 engine fed from float32 master weights: half the bytes).
        nccl_group: the group name for ``nccl``.
        nccl_per_tensor: broadcast each tensor on its own instead of the packed bucket (SGLang's
            ``update_weights_from_distributed`` receives that way).
        timeout_s: bound on each engine's answer per bucket.
        ipc_ranks: for ``cuda_ipc``, the policy ranks whose GPU hosts an engine (None: every
            rank). Only they share a CUDA IPC handle: a handle no engine opens keeps its block
            alive in torch's IPC bookkeeping, so each refit would strand a full copy of the
            weights on every other GPU until it runs out of memory.
    """

    receivers: list[Any]
    transport: str = "shm"
    name_map: NameMap | None = None
    dtype: str | None = None
    nccl_group: str = "nrl-refit"
    nccl_per_tensor: bool = False
    timeout_s: float = 600.0
    ipc_ranks: frozenset[int] | None = None

    def __attrs_post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise WeightSyncError(
                f"unknown weight-sync transport {self.transport!r}; use one of {TRANSPORTS}"
            )

    def _prepare(self, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.name_map is not None:
            bucket = self.name_map.apply(bucket)
        if self.dtype is not None:
            target = _dtype(self.dtype)
            bucket = {k: v.to(target) if v.is_floating_point() else v for k, v in bucket.items()}
        return bucket

    def _call_all(self, method: str, *args: Any) -> list:
        refs = [r.call.remote(method, args, {}) for r in self.receivers]
        return refs if method == "receive_bucket" else self._wait(refs)

    def _wait(self, refs: list) -> list:
        import ray

        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if pending:
            raise WeightSyncError(
                f"{len(pending)} engine(s) did not answer a weight update within "
                f"{self.timeout_s:g}s"
            )
        return ray.get(ready)

    def send(
        self,
        buckets: Iterable[dict[str, torch.Tensor]],
        *,
        rank: int = 0,
        gather_object=None,
    ) -> RefitStats | None:
        """Iterate ``buckets`` to the end (on every policy rank: it is a collective there) and
        deliver each to every receiver. Rank 0 talks to the engines and returns the
        :class:`RefitStats`; other ranks return None.

        ``gather_object(obj) -> list`` (all policy ranks' objects in rank order) is needed by
        ``cuda_ipc`` with several policy ranks, so that every GPU's handle reaches the engines.
        """
        started = time.perf_counter()
        lead = rank == 0
        if lead:
            self._call_all("begin_weight_update")
        total = count = tensors = 0
        for raw in buckets:
            bucket = self._prepare(raw)
            if not bucket:
                continue
            if self.transport == "shm":
                if lead:
                    total += self._send_shm(bucket)
            elif self.transport == "cuda_ipc":
                share = self.ipc_ranks is None or rank in self.ipc_ranks
                total += self._send_ipc(bucket, lead, gather_object, share)
            elif lead:
                total += self._send_nccl(bucket)
            count += 1
            tensors += len(bucket)
        if not lead:
            return None
        self._call_all("finish_weight_update")
        return RefitStats(time.perf_counter() - started, total, count, tensors)

    def _send_shm(self, bucket: dict[str, torch.Tensor]) -> int:
        from multiprocessing import shared_memory

        import torch

        meta = bucket_layout(bucket)
        shm = shared_memory.SharedMemory(
            create=True, size=max(1, meta.nbytes), name=f"nrl-{uuid.uuid4().hex[:16]}"
        )
        try:
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes)
            pack_bucket({k: v.cpu() for k, v in bucket.items()}, out=view)
            del view
            self._wait(self._call_all("receive_bucket", meta, SharedMemoryHandle(shm.name)))
        finally:
            shm.close()
            shm.unlink()
        return meta.payload_bytes

    def _send_ipc(
        self, bucket: dict[str, torch.Tensor], lead: bool, gather_object, share: bool = True
    ) -> int:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        if not share:
            # No engine on this rank's GPU: no packed copy, no handle; it still takes part in
            # the exchange and the barrier (collectives of every policy rank).
            meta = bucket_layout(bucket)
            handles = gather_object({}) if gather_object is not None else [{}]
            if lead:
                self._receive_ipc(meta, handles)
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
            self._receive_ipc(meta, handles)
        if gather_object is not None:
            gather_object(None)  # a barrier: no rank frees its buffer while engines read it
        torch.cuda.synchronize(flat.device)
        del flat
        return meta.payload_bytes

    def _receive_ipc(self, meta: BucketMeta, handles: list[dict[str, tuple]]) -> None:
        """Every engine loads the bucket from the copy on its own GPU (all ranks' handles)."""
        merged: dict[str, tuple] = {}
        for part in handles:
            merged.update(part)
        self._wait(self._call_all("receive_bucket", meta, CudaIpcHandle(merged)))

    def _send_nccl(self, bucket: dict[str, torch.Tensor]) -> int:
        pg = _NCCL_GROUPS.get(self.nccl_group)
        if pg is None:
            raise WeightSyncError(
                f"NCCL weight-sync group {self.nccl_group!r} is not initialised on the policy"
            )
        # Per tensor, the packed copy would only be thrown away: the layout is enough.
        flat, meta = (None, bucket_layout(bucket)) if self.nccl_per_tensor else pack_bucket(bucket)
        # Engines first post their receive (it blocks in the broadcast), then we send.
        refs = self._call_all("receive_bucket", meta, NcclBroadcastHandle(self.nccl_group))
        if flat is None:
            # In bucket order, as SGLang posts its receives (sglang/srt/model_executor/
            # model_runner_components/weight_updater.py:280-298).
            for tensor in bucket.values():
                pg.broadcast(tensor.contiguous(), 0).wait()
        else:
            pg.broadcast(flat, 0).wait()
        self._wait(refs)
        return meta.payload_bytes


def push_from_rank(
    sender: WeightSender, buckets: Iterable[dict[str, torch.Tensor]], *, rank: int
) -> RefitStats | None:
    """A policy rank's ``push_weights``: send ``buckets`` through ``sender`` from this rank.

    A collective over the policy's default ``torch.distributed`` group (gathering sharded
    tensors into buckets is one, and so is the exchange of every GPU's CUDA IPC handle): call
    on all ranks. Rank 0 talks to the engines and returns the :class:`RefitStats`; the others
    return None.
    """
    import torch.distributed as dist

    def gather(obj: Any) -> list:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return sender.send(buckets, rank=rank, gather_object=gather)


def total_bytes(metas: Sequence[BucketMeta]) -> int:
    """Payload bytes of several buckets."""
    return sum(m.payload_bytes for m in metas)


# ---------------------------------------------------------------------------------------------
# A reference endpoint


class StateDictEndpoint:
    """A Hugging Face model on CPU that can send its weights (like a policy) and receive
    buckets (like an engine): the reference both ends of a transport are tested against, and a
    template for a new engine's :class:`~nrl_core.interfaces.WeightSync`.

    Built as ``StateDictEndpoint(model_path, seed)``; a non-None ``seed`` re-initialises the
    weights randomly, so two endpoints start different.
    """

    def __init__(self, model_path: str, seed: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        self.updates = 0

    def push_weights(self, sender: WeightSender, bucket_bytes: int) -> RefitStats | None:
        """Send this model's state dict through ``sender`` (as a policy rank 0 would)."""
        items = ((k, v.detach()) for k, v in self.model.state_dict().items())
        return sender.send(iter_buckets(items, bucket_bytes))

    def begin_weight_update(self) -> None:
        self._seen: set[str] = set()

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        state = self.model.state_dict()

        def load(named: list) -> None:
            for name, tensor in named:
                if name not in state:
                    raise WeightSyncError(f"unknown parameter {name!r} in a weight bucket")
                state[name].copy_(tensor)
                self._seen.add(name)

        return receive_into(meta, handle, load)

    def finish_weight_update(self) -> None:
        self.updates += 1

    def digest(self) -> dict[str, str]:
        """sha256 of each tensor's bytes: equal digests mean bit-identical weights."""
        import hashlib

        import torch

        return {
            k: hashlib.sha256(
                v.detach().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for k, v in self.model.state_dict().items()
        }
