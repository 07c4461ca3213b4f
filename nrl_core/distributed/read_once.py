"""Read a checkpoint once, give it to every rank: a streamed broadcast of named tensors.

Policy workers used to call ``from_pretrained(path, dtype=float32)`` on every rank, so a node of
8 ranks held 8 float32 copies of the whole model in host memory before sharding (about 1 TB for
Qwen3-30B-A3B, GPU review 3, M1). Here one rank reads, in the checkpoint's own dtype, and every
other rank receives the tensors one at a time and keeps only its own shard of each.

Which rank reads: rank ``src`` (0) of the group. One reader per group, not one per host: every
tensor then crosses each host's link once (NCCL's broadcast is a ring/tree), and on one node
(the case the memory problem is about) that is exactly one read per host. Its peak is the
checkpoint in its own dtype plus its own shard; every other rank's peak is its own shard plus
the one tensor in flight.

Protocol: a header (names, shapes, dtypes, by ``broadcast_object_list``), then one
``dist.broadcast`` per tensor, in header order. Tensors travel on the group's device: the CPU
with gloo, this rank's current CUDA device with NCCL (pass ``device``), so a GPU run copies each
tensor host-to-device once on the reader and never on a receiver.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist


def broadcast_named_tensors(
    source: Mapping[str, torch.Tensor] | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the reader's ``(name, tensor)`` pairs on every rank of ``group``, one at a time.

    A collective: iterate it to the end on every rank together.

    Args:
        source: on rank ``src`` (a rank of the default group), the tensors to send, in the
            order to send them; ignored (pass None) on every other rank.
        src: the reading rank, as a global rank.
        group: the process group (None: the default group).
        device: where the tensors travel and are yielded: ``cpu`` for gloo, the rank's CUDA
            device for NCCL.

    Yields each tensor in its source dtype; a receiver's tensor is a fresh buffer that the
    next step of the iteration no longer references, so a caller that keeps only a slice of
    it holds one full tensor at a time.
    """
    reader = dist.get_rank() == src
    header: list = [None]
    if reader:
        header[0] = [(name, tuple(t.shape), t.dtype) for name, t in source.items()]
    dist.broadcast_object_list(header, src=src, group=group)
    for name, shape, dtype in header[0]:
        if reader:
            tensor = source[name].detach().to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        yield name, tensor
        del tensor


def local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor ``full`` that ``target`` holds on this rank: all of it for a
    plain tensor, its shard for a DTensor (any placements its mesh uses: FSDP2, tensor
    parallel, both)."""
    if not hasattr(target, "device_mesh"):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # The library's own arithmetic (torch.distributed._state_dict_utils uses it the same way).
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, target.device_mesh, target.placements
    )
    return full[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]


class LoadReport(NamedTuple):
    """What :func:`load_stream_into` could not match."""

    unknown: set[str]
    """Names the stream delivered that the targets do not have."""
    missing: set[str]
    """Targets the stream never named (they keep whatever they held)."""


def load_stream_into(
    targets: Mapping[str, torch.Tensor], stream: Iterator[tuple[str, torch.Tensor]]
) -> LoadReport:
    """Copy each streamed tensor's local part into ``targets[name]`` (a parameter or buffer,
    plain or DTensor, already allocated), casting to the target's dtype shard by shard.

    Returns what did not match, for the caller to judge (a fresh head may be missing)."""
    unknown, seen = set(), set()
    with torch.no_grad():
        for name, full in stream:
            seen.add(name)
            target = targets.get(name)
            if target is None:
                unknown.add(name)
                continue
            local = target.to_local() if hasattr(target, "to_local") else target
            local.copy_(local_slice(full, target))
    return LoadReport(unknown, set(targets) - seen)
