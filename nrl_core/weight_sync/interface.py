"""The refit interface: what a transport hands a receiver, the transports by name, the
error and the figures one refit reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch

    from nrl_core.weight_sync.packing import BucketMeta

Transport = Literal["shm", "cuda_ipc", "nccl"]
TRANSPORTS: tuple[str, ...] = ("shm", "cuda_ipc", "nccl")


class WeightSyncError(NrlError):
    """A refit cannot run as configured (wrong transport for the placement, mismatched names)."""


class BucketHandle(Protocol):
    """What a receiver gets next to a :class:`BucketMeta`: a way to reach the bucket's bytes."""

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        """The flat ``uint8`` buffer of the bucket, on ``device`` when the transport allows.
        Valid until :meth:`close`."""
        ...

    def close(self) -> None:
        """Release what :meth:`open` mapped (never frees the sender's memory)."""
        ...


Post = Callable[["BucketMeta", BucketHandle], list]
"""How a transport's sending side asks every engine to receive one bucket: called with the
bucket's meta and handle, it returns the pending answers, which :data:`Wait` awaits."""

Wait = Callable[[list], list]
"""Awaits the answers a :data:`Post` returned (bounded; a :class:`WeightSyncError` on timeout)."""


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
