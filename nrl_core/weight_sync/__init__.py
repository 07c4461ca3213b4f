"""Weight sync ("refit"): moving a policy's current weights into a generation engine.

Kept apart from generation: an engine only has to *receive* buckets (see
:class:`~nrl_core.interfaces.WeightSync`); the policy plugin only has to *yield* its full state dict in
size-bounded buckets with the engine's parameter names (Hugging Face names, in the weight layout
the engine declares it loads: :mod:`.layout`). Everything in between lives in this package and is
engine-independent; every public name is re-exported here, so ``from nrl_core.weight_sync import
X`` is the way to use it:

* **interface** (:mod:`.interface`): a bucket's layout (:class:`BucketMeta`), the per-bucket
  :class:`BucketHandle`, the transports by name, :class:`WeightSyncError` and the
  :class:`RefitStats` one refit reports.
* **packing** (:mod:`.packing`): a bucket ``{name: tensor}`` becomes one flat ``uint8`` buffer plus
  a :class:`BucketMeta` (name, dtype, shape, byte offset of each tensor). One buffer per bucket
  means one IPC handle, one broadcast or one shared-memory segment per bucket instead of one per
  tensor. :func:`unpack_bucket` reverses it bit-exactly (views of the same bytes);
  :func:`receive_into` is what every engine's ``receive_bucket`` calls. :class:`NameMap`
  (:mod:`.names`) renames the policy's parameters to the engine's.
* **layout** (:mod:`.layout`): :func:`in_layout` turns a policy's stream of transformers
  in-memory tensors into the layout the engine declares it loads (:data:`CHECKPOINT`, the
  published per-expert files, for vLLM and SGLang; :data:`IN_MEMORY` for nrl's torch engine).
* **transports**, one module each, each with a small picklable *handle* that the sender creates
  per bucket and the receiver turns back into the flat buffer with :meth:`BucketHandle.open`,
  and the sending side that creates it:

  - :mod:`.shm`, :class:`SharedMemoryHandle`: a POSIX shared-memory segment (``/dev/shm``);
    CPU, same node. Used by the tests and by CPU runs; it is the only transport that has run
    in this repository.
  - :mod:`.cuda_ipc`, :class:`CudaIpcHandle`: CUDA IPC handles of the sender's GPU buffer, one
    per GPU (UUID), for engines colocated on the trainer's GPUs. GPU-only; has not run.
  - :mod:`.nccl`, :class:`NcclBroadcastHandle`: a broadcast from trainer rank 0 over an NCCL
    group spanning that rank and every engine rank (:func:`init_nccl_group`), for engines on
    their own GPUs. GPU-only; has not run.

* **wire form** (:mod:`.wire`): :func:`handle_to_wire` / :func:`handle_from_wire`, the messages
  as plain data for RPC layers that carry no Python objects (vLLM's msgpack).
* **sending** (:mod:`.sender`): :class:`WeightSender` runs inside the policy workers
  (``push_weights``), iterates the policy's buckets on every rank, and calls each engine's
  ``receive_bucket`` through Ray. It returns a :class:`RefitStats` (seconds, bytes, buckets) that
  the driver logs as ``timing/refit_s`` and ``refit/bytes``. :func:`push_from_rank`
  (:mod:`.gather`) is a policy rank's ``push_weights`` with the gather between ranks.
* **reference endpoint** (:mod:`.reference`): :class:`StateDictEndpoint`, a CPU model that both
  sends and receives, against which the transports are tested.

Nothing here imports an engine; torch is imported lazily so that ``nrl --help`` stays fast.
"""

from nrl_core.weight_sync.cuda_ipc import CudaIpcHandle
from nrl_core.weight_sync.gather import push_from_rank
from nrl_core.weight_sync.interface import (
    TRANSPORTS,
    BucketHandle,
    BucketMeta,
    RefitStats,
    TensorMeta,
    Transport,
    WeightSyncError,
)
from nrl_core.weight_sync.layout import (
    CHECKPOINT,
    IN_MEMORY,
    WEIGHT_LAYOUTS,
    hf_skeleton,
    in_layout,
)
from nrl_core.weight_sync.names import NameMap
from nrl_core.weight_sync.nccl import (
    _NCCL_GROUPS as _NCCL_GROUPS,  # the process's refit groups (tests/test_nccl_group.py)
)
from nrl_core.weight_sync.nccl import (
    NcclBroadcastHandle,
    destroy_nccl_group,
    init_nccl_group,
)
from nrl_core.weight_sync.packing import (
    bucket_layout,
    iter_buckets,
    pack_bucket,
    receive_into,
    total_bytes,
    unpack_bucket,
)
from nrl_core.weight_sync.reference import StateDictEndpoint
from nrl_core.weight_sync.sender import WeightSender
from nrl_core.weight_sync.shm import SharedMemoryHandle
from nrl_core.weight_sync.wire import CUDA_IPC_ARGS, handle_from_wire, handle_to_wire

__all__ = [
    "CHECKPOINT",
    "CUDA_IPC_ARGS",
    "IN_MEMORY",
    "TRANSPORTS",
    "WEIGHT_LAYOUTS",
    "BucketHandle",
    "BucketMeta",
    "CudaIpcHandle",
    "NameMap",
    "NcclBroadcastHandle",
    "RefitStats",
    "SharedMemoryHandle",
    "StateDictEndpoint",
    "TensorMeta",
    "Transport",
    "WeightSender",
    "WeightSyncError",
    "bucket_layout",
    "destroy_nccl_group",
    "handle_from_wire",
    "handle_to_wire",
    "hf_skeleton",
    "in_layout",
    "init_nccl_group",
    "iter_buckets",
    "pack_bucket",
    "push_from_rank",
    "receive_into",
    "total_bytes",
    "unpack_bucket",
]
