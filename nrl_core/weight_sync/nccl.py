"""The NCCL transport (``nccl``): a broadcast from the policy's rank 0 over a stand-alone group
that every engine rank joins, for engines on their own GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.weight_sync.interface import BucketMeta, Post, Wait, WeightSyncError
from nrl_core.weight_sync.packing import bucket_layout, pack_bucket

if TYPE_CHECKING:
    import torch


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


def send_nccl(
    bucket: dict[str, torch.Tensor], post: Post, wait: Wait, group: str, per_tensor: bool = False
) -> int:
    """Broadcast ``bucket`` from the policy's rank 0 over the group ``group`` once every engine
    has posted its receive; ``per_tensor`` sends each tensor on its own instead of the packed
    bucket (SGLang receives that way). Returns the payload bytes."""
    pg = _NCCL_GROUPS.get(group)
    if pg is None:
        raise WeightSyncError(f"NCCL weight-sync group {group!r} is not initialised on the policy")
    # Per tensor, the packed copy would only be thrown away: the layout is enough.
    flat, meta = (None, bucket_layout(bucket)) if per_tensor else pack_bucket(bucket)
    # Engines first post their receive (it blocks in the broadcast), then we send.
    refs = post(meta, NcclBroadcastHandle(group))
    if flat is None:
        # In bucket order, as SGLang posts its receives (sglang/srt/model_executor/
        # model_runner_components/weight_updater.py:280-298).
        for tensor in bucket.values():
            pg.broadcast(tensor.contiguous(), 0).wait()
    else:
        pg.broadcast(flat, 0).wait()
    wait(refs)
    return meta.payload_bytes
