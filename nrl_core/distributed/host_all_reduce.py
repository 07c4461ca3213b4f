"""A sum all-reduce through shared memory for CPU ranks that share one host.

gloo, the CPU backend of ``torch.distributed``, moves every byte of an all-reduce through TCP,
loopback included. Between two ranks of the 2-core development machine
(``uv run python benchmarks/host_all_reduce.py [--numel N]``), a 12.8 MB sum took 5.5-8.2 ms
through gloo and 2.9 ms through shared memory; a 200 MB one 101 ms and 42 ms. No collective
library that PyTorch users install from a package index offers this on CPU (oneCCL's PyTorch
bindings ship from Intel's own index, for chosen torch builds), so the core keeps this small one.

How it works: every rank maps one file per rank under ``/dev/shm``; the files are unlinked as
soon as all ranks have mapped them, so a rank that dies later leaves nothing behind. A call
copies the rank's tensor into its own buffer; after a barrier, rank ``r`` sums slice ``r`` of
every buffer into its own; after a second barrier, every rank copies each rank's summed slice
into its tensor. Each slice is summed by one rank only, so all ranks receive the same bits
(with two ranks, exactly gloo's result). Two buffers per rank, used in turn, let a call return
without a third barrier: a rank writes a buffer again only two calls later, after a barrier that
every rank reaches only once it has finished reading that buffer.

Where shared memory cannot serve (ranks on different hosts, tensors not on the CPU, no or too
small ``/dev/shm``), :class:`HostAllReduce` uses ``dist.all_reduce``; ranks always agree on the
path, through an all-reduce of a flag.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


class HostAllReduce:
    """In-place sum all-reduce of one tensor over ``group``, through shared memory when every
    rank of the group runs on this host (see the module docstring).

    Call it on all ranks of the group together, with tensors of the same dtype and number of
    elements on every rank, as ``dist.all_reduce`` requires. Buffers grow to the largest tensor
    seen (a collective step); setting up happens on the first call.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, shm_dir: Path | None = None):
        self.group = group
        self.shm_dir = Path(shm_dir) if shm_dir is not None else SHM_DIR
        """Where the buffers live: a tmpfs shared by the host's processes."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.shared = None
        """Whether calls go through shared memory; decided (by all ranks together) on the
        first call, ``False`` from then on once refused."""
        self._buffers: list[torch.Tensor] = []  # per rank: (2, capacity) bytes
        self._turn = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` by its sum over the group's ranks; returns it. Tensors that are
        not contiguous CPU tensors go through ``dist.all_reduce``."""
        if self.world_size == 1:
            return tensor
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            nbytes = tensor.numel() * tensor.element_size()
            if self.shared is None or (self.shared and nbytes > self._capacity):
                self.shared = self._map_buffers(nbytes)
            if self.shared:
                self._reduce_shared(tensor)
                return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    @property
    def _capacity(self) -> int:
        return self._buffers[0].shape[1] if self._buffers else 0

    def _agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _map_buffers(self, nbytes: int) -> bool:
        """Create this rank's buffer file, map every rank's, unlink this rank's; whether every
        rank managed (else nothing stays mapped and the group uses gloo)."""
        # Room to grow, and a multiple of 64 bytes so that both halves of a buffer are aligned
        # for any dtype.
        capacity = -(-max(nbytes, 2 * self._capacity) // 64) * 64
        self._buffers = []
        # A name no other group uses, chosen by the group's first rank (sent as bytes: nothing
        # here unpickles what another process sent).
        token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
        dist.broadcast(token, group=self.group, group_src=0)
        name = bytes(token.tolist()).hex()
        paths = [self.shm_dir / f"nrl-all-reduce-{name}-{r}" for r in range(self.world_size)]
        mine = paths[self.rank]
        created = False
        try:
            fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            created = True
            try:
                # Reserve the pages now: a tmpfs that is too small (Docker's 64 MB default)
                # must fail here, not with SIGBUS in the middle of a step.
                os.posix_fallocate(fd, 0, 2 * capacity)
            finally:
                os.close(fd)
            ok = True
        except OSError:
            ok = False
        ok = self._agree(ok)
        if ok:
            try:
                # A peer's file exists here only when the peer shares this host's /dev/shm.
                buffers = [
                    torch.from_file(str(p), shared=True, size=2 * capacity, dtype=torch.uint8)
                    if p.is_file() and p.stat().st_size == 2 * capacity
                    else None
                    for p in paths
                ]
                ok = all(b is not None for b in buffers)
            except (OSError, RuntimeError):
                ok = False
            ok = self._agree(ok)  # also: every rank has mapped every file before any unlink
            if ok:
                self._buffers = [b.view(2, capacity) for b in buffers]
        if created:
            mine.unlink(missing_ok=True)
        return ok

    def _reduce_shared(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        nbytes = flat.numel() * flat.element_size()
        turn, self._turn = self._turn, self._turn ^ 1
        buffers = [b[turn, :nbytes].view(tensor.dtype) for b in self._buffers]
        bounds = [flat.numel() * r // self.world_size for r in range(self.world_size + 1)]
        own = slice(bounds[self.rank], bounds[self.rank + 1])
        buffers[self.rank].copy_(flat)
        dist.barrier(group=self.group)  # every rank's tensor is in its buffer
        for r, buffer in enumerate(buffers):
            if r != self.rank:
                buffers[self.rank][own] += buffer[own]
        dist.barrier(group=self.group)  # every slice is summed
        for r, buffer in enumerate(buffers):
            part = slice(bounds[r], bounds[r + 1])
            flat[part].copy_(buffer[part])
