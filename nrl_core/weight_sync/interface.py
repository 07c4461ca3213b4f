"""The refit interface: the layout of a bucket and the handle a transport gives a receiver, the
transports by name, the error and the figures one refit reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch

Transport = Literal["shm", "cuda_ipc", "nccl"]
TRANSPORTS: tuple[str, ...] = ("shm", "cuda_ipc", "nccl")


class WeightSyncError(NrlError):
    """A refit cannot run as configured (wrong transport for the placement, mismatched names)."""


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
        """This meta as plain data (see :mod:`nrl_core.weight_sync.wire`); :meth:`from_wire` reverses it."""
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
        Python objects (see :mod:`nrl_core.weight_sync.wire`); :meth:`from_wire` reverses it."""
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


class BucketHandle(Protocol):
    """What a receiver gets next to a :class:`BucketMeta`: a way to reach the bucket's bytes."""

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        """The flat ``uint8`` buffer of the bucket, on ``device`` when the transport allows.
        Valid until :meth:`close`."""
        ...

    def close(self) -> None:
        """Release what :meth:`open` mapped (never frees the sender's memory)."""
        ...


Post = Callable[[BucketMeta, BucketHandle], list]
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
