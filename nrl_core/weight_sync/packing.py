"""Bucket packing: a bucket ``{name: tensor}`` as one flat ``uint8`` buffer plus its layout, and
back (bit-exact views of the same bytes)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from nrl_core.weight_sync.interface import BucketHandle, BucketMeta, TensorMeta, WeightSyncError

if TYPE_CHECKING:
    import torch

_ALIGN = 16
"""Byte alignment of every tensor inside a packed buffer, so that ``view(dtype)`` of any
element size (up to complex128) is legal and vectorised copies stay aligned."""


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


def total_bytes(metas: Sequence[BucketMeta]) -> int:
    """Payload bytes of several buckets."""
    return sum(m.payload_bytes for m in metas)
