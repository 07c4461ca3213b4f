"""The shared-memory transport (``shm``): a bucket in a POSIX segment on ``/dev/shm``, for a
policy and an engine on the same node (CPU)."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
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
            self._shm = _attached(self.name)
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
        # The mapping stays for the next bucket: a sender reuses its segment (send_shm), and
        # mapping 126 MB afresh costs page faults on every page again. _attached closes it
        # when another segment comes.
        self._shm = None


_ATTACHED: dict[str, Any] = {}
"""The segment this process mapped last, by name (at most one; see :func:`_attached`)."""
_ATTACH_LOCK = threading.Lock()


def _attached(name: str):
    """The mapping of segment ``name``, kept from the last bucket when it is the same segment;
    the previous segment's mapping is closed when another comes (its sender grew or ended)."""
    with _ATTACH_LOCK:
        shm = _ATTACHED.get(name)
        if shm is not None:
            return shm
        for old in _ATTACHED.values():
            # A tensor view may still reference the mapping; it is then unmapped with the view.
            with contextlib.suppress(BufferError):
                old.close()
        _ATTACHED.clear()
        shm = _ATTACHED[name] = _attach_shm(name)
        return shm


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


_STAGING: list[Any] = []
"""This process's staging segment for :func:`send_shm` (none or one), reused by every bucket."""
_STAGING_LOCK = threading.Lock()


def _staging_segment(nbytes: int):
    """A segment of at least ``nbytes``: the last one when it is large enough, else a new one
    (the old one unlinked). Unlinked at this process's exit (:func:`release_staging`)."""
    from multiprocessing import shared_memory

    if _STAGING and _STAGING[0].size >= nbytes:
        return _STAGING[0]
    release_staging()
    shm = shared_memory.SharedMemory(
        create=True, size=max(1, nbytes), name=f"{segment_prefix()}{uuid.uuid4().hex[:16]}"
    )
    _STAGING.append(shm)
    return shm


def release_staging() -> None:
    """Unlink this process's staging segment (if any); the next bucket makes a new one."""
    while _STAGING:
        shm = _STAGING.pop()
        with contextlib.suppress(BufferError):
            shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


atexit.register(release_staging)


def send_shm(bucket: dict[str, torch.Tensor], post: Post, wait: Wait) -> int:
    """Pack ``bucket`` into this process's staging segment, have every engine load it
    (``post`` the request, ``wait`` for the answers: they copy what they keep). Returns the
    payload bytes.

    The segment is reused by every bucket and refit of this process (grown when a bucket does
    not fit) and unlinked at its exit: a fresh segment per bucket cost its pages' allocation
    and zeroing at each refit, about 0.1 CPU-s for the 126 MB of the realistic workload's
    31.5M float32 parameters against 0.012 s for the copy itself (docs/performance.md). A
    process killed before its exit handler (Ray kills its workers when a run stops) cannot
    unlink it; the run's prefix lets the local cluster's clean-up find the segment."""
    import torch

    meta = bucket_layout(bucket)
    with _STAGING_LOCK:  # one bucket in the segment at a time
        shm = _staging_segment(meta.nbytes)
        try:
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes)
            pack_bucket({k: v.cpu() for k, v in bucket.items()}, out=view)
            del view
            wait(post(meta, SharedMemoryHandle(shm.name)))
        except BaseException:
            # An engine may still read it (a timeout): the next bucket gets a new segment.
            release_staging()
            raise
    return meta.payload_bytes
