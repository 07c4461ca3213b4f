"""A sum all-reduce through shared memory for CPU ranks that share one host.

gloo, the CPU backend of ``torch.distributed``, moves every byte of an all-reduce through TCP,
loopback included. Between two ranks of the 2-core development machine
(``uv run python benchmarks/host_all_reduce.py [--numel N]``), a 12.8 MB sum took 5.5-8.2 ms
through gloo and 2.6-2.9 ms through shared memory; a 200 MB one 101-111 ms and 42-44 ms. No collective
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

The barriers go through one named pipe (FIFO) per rank, beside the buffers and unlinked with
them: arriving, a rank writes one byte into every peer's pipe, then reads one byte per peer
from its own. A barrier through gloo is a TCP round trip between processes, 1-2 ms on a busy
2-core machine; a pipe wakes the waiting rank in microseconds. The kernel's pipe lock also
orders memory: what a rank wrote into its buffer before its byte is visible to the peer that
read the byte, on any CPU architecture.

Where shared memory cannot serve (ranks on different hosts, tensors not on the CPU, no or too
small ``/dev/shm``), :class:`HostAllReduce` uses ``dist.all_reduce``; ranks always agree on the
path, through an all-reduce of a flag.
"""

from __future__ import annotations

import contextlib
import os
import select
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


def all_ranks_agree(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce of a flag; call it on
    all ranks together), so that ranks whose local checks differ take one decision."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class HostAllReduce:
    """Sum all-reduce over ``group``, through shared memory when every rank of the group runs
    on this host (see the module docstring): in place on one tensor (call the object), or
    over a list of tensors taken as one (:meth:`sum_coalesced`).

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
        self._own_pipe: int | None = None  # this rank's FIFO, read end
        self._peer_pipes: list[int] = []  # the other ranks' FIFOs, write ends
        self._poll = select.poll()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` by its sum over the group's ranks; returns it. Tensors that are
        not contiguous CPU tensors go through ``dist.all_reduce``."""
        if self.world_size == 1:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu" and tensor.is_contiguous() and self._use_shared(nbytes):
            flat = tensor.view(-1)
            self._reduce_shared([flat], flat)
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def sum_coalesced(self, tensors: Sequence[torch.Tensor], divide_by: int = 1) -> torch.Tensor:
        """The sum over the group's ranks of ``tensors`` flattened and concatenated (one dtype,
        on the CPU), divided by ``divide_by`` (1 or more: the average over the ranks with
        ``divide_by`` = the group's size), as a new 1-D tensor; ``tensors`` are left as they
        were. Through shared memory this costs no concatenation of its own: each tensor is
        copied straight into the buffer, and each rank divides only the slice it summed."""
        if self.world_size > 1 and tensors[0].device.type == "cpu":
            numel = sum(t.numel() for t in tensors)
            if self._use_shared(numel * tensors[0].element_size()):
                out = tensors[0].new_empty(numel)
                self._reduce_shared([t.reshape(-1) for t in tensors], out, divide_by)
                return out
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.world_size > 1:
            dist.all_reduce(flat, group=self.group)
        if divide_by != 1:
            flat.div_(divide_by)
        return flat

    def _use_shared(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of CPU data go through shared memory, setting up or growing the
        buffers first when needed (all ranks together)."""
        if self.shared is None or (self.shared and nbytes > self._capacity):
            self.shared = self._map_buffers(nbytes)
        return bool(self.shared)

    @property
    def _capacity(self) -> int:
        return self._buffers[0].shape[1] if self._buffers else 0

    def _map_buffers(self, nbytes: int) -> bool:
        """Create this rank's buffer file and pipe, map every rank's buffer and open every
        peer's pipe, unlink this rank's; whether every rank managed (else nothing stays open
        and the group uses gloo)."""
        # Room to grow, and a multiple of 64 bytes so that both halves of a buffer are aligned
        # for any dtype.
        capacity = -(-max(nbytes, 2 * self._capacity) // 64) * 64
        self._buffers = []
        self._close_pipes()
        # A name no other group uses, chosen by the group's first rank (sent as bytes: nothing
        # here unpickles what another process sent).
        token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
        dist.broadcast(token, group=self.group, group_src=0)
        name = bytes(token.tolist()).hex()
        paths = [self.shm_dir / f"nrl-all-reduce-{name}-{r}" for r in range(self.world_size)]
        pipes = [p.with_name(p.name + ".pipe") for p in paths]
        mine, my_pipe = paths[self.rank], pipes[self.rank]
        created = []
        try:
            fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            created.append(mine)
            try:
                # Reserve the pages now: a tmpfs that is too small (Docker's 64 MB default)
                # must fail here, not with SIGBUS in the middle of a step.
                os.posix_fallocate(fd, 0, 2 * capacity)
            finally:
                os.close(fd)
            os.mkfifo(my_pipe, 0o600)
            created.append(my_pipe)
            # Read and write: opening never waits for a writer, and reads never see an end of
            # file while this rank holds it.
            self._own_pipe = os.open(my_pipe, os.O_RDWR | os.O_NONBLOCK)
            ok = True
        except OSError:
            ok = False
        ok = all_ranks_agree(ok, self.group)
        if ok:
            try:
                # A peer's file exists here only when the peer shares this host's /dev/shm.
                buffers = [
                    torch.from_file(str(p), shared=True, size=2 * capacity, dtype=torch.uint8)
                    if p.is_file() and p.stat().st_size == 2 * capacity
                    else None
                    for p in paths
                ]
                # Every peer holds its own pipe open for reading, so these opens succeed now
                # (one at a time: what opened is closed if a later one fails).
                for r, pipe in enumerate(pipes):
                    if r != self.rank:
                        self._peer_pipes.append(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
                ok = all(b is not None for b in buffers)
            except (OSError, RuntimeError):
                ok = False
            # Also: every rank has opened every file before any unlink.
            ok = all_ranks_agree(ok, self.group)
            if ok:
                self._buffers = [b.view(2, capacity) for b in buffers]
                self._poll.register(self._own_pipe, select.POLLIN)
        for path in created:
            path.unlink(missing_ok=True)
        if not ok:
            self._close_pipes()
        return ok

    def _close_pipes(self) -> None:
        if self._own_pipe is not None:
            # Unregistering a descriptor the poll object does not hold raises KeyError.
            with contextlib.suppress(KeyError):
                self._poll.unregister(self._own_pipe)
            os.close(self._own_pipe)
        for fd in self._peer_pipes:
            os.close(fd)
        self._own_pipe, self._peer_pipes = None, []

    def __del__(self) -> None:
        # Descriptors only: the buffers are unmapped with their tensors.
        with contextlib.suppress(OSError, AttributeError):
            self._close_pipes()

    def _barrier(self) -> None:
        """Wait until every rank of the group has arrived (see the module docstring)."""
        for fd in self._peer_pipes:
            os.write(fd, b"\0")
        missing = self.world_size - 1
        timeout_ms = int(dist.default_pg_timeout.total_seconds() * 1000)
        while missing:
            if not self._poll.poll(timeout_ms):
                raise RuntimeError(
                    f"rank {self.rank} waited {dist.default_pg_timeout} for its peers at a "
                    "shared-memory all-reduce; a peer stopped"
                )
            try:
                missing -= len(os.read(self._own_pipe, missing))
            except BlockingIOError:  # woken without a byte left to read: wait again
                continue

    def _reduce_shared(
        self, pieces: Sequence[torch.Tensor], out: torch.Tensor, divide_by: int = 1
    ) -> None:
        """Sum the concatenation of the 1-D ``pieces`` over the ranks into the 1-D ``out``
        (which may be the only piece), divided by ``divide_by``."""
        nbytes = out.numel() * out.element_size()
        turn, self._turn = self._turn, self._turn ^ 1
        buffers = [b[turn, :nbytes].view(out.dtype) for b in self._buffers]
        bounds = [out.numel() * r // self.world_size for r in range(self.world_size + 1)]
        own = slice(bounds[self.rank], bounds[self.rank + 1])
        if len(pieces) == 1:
            buffers[self.rank].copy_(pieces[0])
        else:
            torch.cat(pieces, out=buffers[self.rank])
        self._barrier()  # every rank's tensor is in its buffer
        for r, buffer in enumerate(buffers):
            if r != self.rank:
                buffers[self.rank][own] += buffer[own]
        if divide_by != 1:
            buffers[self.rank][own].div_(divide_by)
        self._barrier()  # every slice is summed
        for r, buffer in enumerate(buffers):
            part = slice(bounds[r], bounds[r + 1])
            out[part].copy_(buffer[part])
