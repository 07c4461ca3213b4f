"""The shared-memory transport (``shm``): a bucket in a POSIX segment on ``/dev/shm``, for a
policy and an engine on the same node (CPU)."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.weight_sync.interface import BucketMeta, Post, Wait, WeightSyncError
from nrl_core.weight_sync.packing import bucket_layout, pack_bucket

if TYPE_CHECKING:
    import torch

SEGMENT_PREFIX_VAR = "NRL_SHM_PREFIX"
"""Names the segments of one run (``nrl-<run id>-``): the local cluster sets it for every
process of its Ray head, so that what a process killed mid-refit leaves is found and unlinked
after the run (:class:`nrl_core.distributed.reaper.SegmentLedger`)."""


def segment_prefix() -> str:
    """This run's segment name prefix (``nrl-`` outside a local cluster)."""
    prefix = os.environ.get(SEGMENT_PREFIX_VAR, "")
    ok = prefix.startswith("nrl-") and "/" not in prefix and len(prefix) <= 64
    return prefix if ok else "nrl-"


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


def send_shm(bucket: dict[str, torch.Tensor], post: Post, wait: Wait) -> int:
    """Pack ``bucket`` into a fresh segment, have every engine load it (``post`` the request,
    ``wait`` for the answers), then unlink the segment. Returns the payload bytes.

    A process killed before the ``finally`` (its run stopped by a signal while a refit is in
    flight: Ray kills its workers) cannot unlink; the run's prefix lets the local cluster's
    clean-up find the segment."""
    from multiprocessing import shared_memory

    import torch

    meta = bucket_layout(bucket)
    shm = shared_memory.SharedMemory(
        create=True, size=max(1, meta.nbytes), name=f"{segment_prefix()}{uuid.uuid4().hex[:16]}"
    )
    try:
        view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes)
        pack_bucket({k: v.cpu() for k, v in bucket.items()}, out=view)
        del view
        wait(post(meta, SharedMemoryHandle(shm.name)))
    finally:
        shm.close()
        shm.unlink()
    return meta.payload_bytes
