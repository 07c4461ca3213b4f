"""A pool of spawned ranks for policy-plugin tests: N processes forming one ``torch.distributed``
world, with the calling API of the core's ``WorkerGroup``.

``SpawnPool`` starts N ``torch.multiprocessing`` (spawn) processes once, with the environment
of a torch.distributed job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), and
``SpawnPool.start(target=..., num_workers=N, args=(options, context), name=...)`` builds one
instance per process with the same API as
:class:`~nrl_core.distributed.worker_group.WorkerGroup`: ``run_all``, ``run_sharded``,
``shutdown``. Processes are reused across groups because importing torch and transformers costs
~15 s per process on the CI machine. For plugins whose models need ``torch.distributed`` in
every process that builds one (Megatron-Core); the targets are imported in the spawned ranks,
which inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import socket
import traceback
from collections.abc import Iterator, Sequence

CALL_TIMEOUT_S = 180


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_world(rank: int, world_size: int, store: str | os.PathLike) -> Iterator[None]:
    """This process as rank ``rank`` (0 to ``world_size`` - 1) of a gloo ``torch.distributed``
    world that meets through the file ``store`` (a new path per world: a test's ``tmp_path``),
    for the body of the ``with``: the shape of a ``torch.multiprocessing.spawn`` target. One
    torch thread per rank (the ranks share the cores). When the body ends without an error the
    ranks meet once more before the group is destroyed: a rank that closes its connections
    while another still finishes the last collective aborts that one ("terminate called
    without an active exception", SIGABRT: once in a CI run). The barrier is gloo's own even
    where the body replaced ``dist.barrier``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    barrier = dist.barrier
    try:
        yield
        barrier()
    finally:
        dist.destroy_process_group()


def _serve(rank: int, world_size: int, port: int, conn, preload: Sequence[str] = ()) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    for module in preload:  # pay the imports while the parent does other work
        with contextlib.suppress(ImportError):  # an optional package (megatron-core) may be missing
            importlib.import_module(module)

    instances: dict[str, object] = {}
    while True:
        op, key, payload = conn.recv()
        try:
            if op == "exit":
                conn.send(("ok", None))
                return
            if op == "start":
                module, attr = payload[0].split(":")
                instances[key] = getattr(importlib.import_module(module), attr)(*payload[1])
                result = None
            elif op == "stop":
                instances.pop(key, None)
                result = None
            else:
                method, args = payload
                # A method name, or a core per-rank function called as fn(worker, *args).
                if callable(method):
                    result = method(instances[key], *args)
                else:
                    result = getattr(instances[key], method)(*args)
                if inspect.isgenerator(result):
                    result = list(result)
            conn.send(("ok", result))
        except Exception:  # the parent re-raises it with the remote traceback
            conn.send(("error", traceback.format_exc()))


def _nothing(_worker: object) -> None:
    """What the ranks :meth:`SpawnGroup.run_one` does not call run (module level: pickled by
    reference)."""


class SpawnPool:
    """N spawned processes forming one torch.distributed world (see the module docstring)."""

    def __init__(self, num_workers: int, preload: Sequence[str] = ("transformers",)) -> None:
        """Start ``num_workers`` ranks; each imports the modules of ``preload`` first (those
        it cannot find are left out: an optional backend may be missing)."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port()
        self.num_workers = num_workers
        self.conns, self.procs = [], []
        for rank in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(rank, num_workers, port, child, tuple(preload)), daemon=True
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._groups = 0

    def _call(self, op: str, key: str, payloads: list) -> list:
        for conn, payload in zip(self.conns, payloads, strict=True):
            conn.send((op, key, payload))
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(CALL_TIMEOUT_S):
                raise TimeoutError(f"rank {rank} did not answer {op} {payloads[rank]!r:.200}")
            status, value = conn.recv()
            # Read every rank's answer before raising, so none is left for the next call.
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def start(
        self,
        target: str,
        num_workers: int,
        args: tuple = (),
        name: str = "group",
        tp: int = 1,
        pp: int = 1,
    ) -> SpawnGroup:
        """Build ``target(*args)`` in every process; same signature as ``WorkerGroup.start``
        (``tp``: tensor-parallel peers, adjacent ranks, share a data-parallel shard; ``pp``:
        pipeline stages, laid out as :class:`~nrl_core.distributed.worker_group.ParallelLayout`
        does)."""
        assert num_workers == self.num_workers, "the pool's size is fixed"
        self._groups += 1
        key = f"{name}-{self._groups}"
        self._call("start", key, [(target, args)] * self.num_workers)
        return SpawnGroup(self, key, tp, pp)

    def close(self) -> None:
        """Stop the processes."""
        for conn in self.conns:
            conn.send(("exit", "", None))
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


class SpawnGroup:
    """One worker instance per pool process; the WorkerGroup calling API."""

    def __init__(self, pool: SpawnPool, key: str, tp: int = 1, pp: int = 1) -> None:
        from nrl_core.distributed.worker_group import ParallelLayout

        self.pool, self.key, self.tp = pool, key, tp
        self.layout = ParallelLayout(tp=tp, pp=pp)
        self.dp_size = self.layout.dp_size(pool.num_workers)

    def run_all(self, method, *args) -> list:
        """Call ``method(*args)`` on every rank; return the per-rank results."""
        return self.pool._call("call", self.key, [(method, args)] * self.pool.num_workers)

    def run_one(self, rank: int, method, *args):
        """Call ``method(*args)`` on ``rank`` only (the others answer with nothing), like
        ``WorkerGroup.run_one``."""
        payloads = [
            (method, args) if r == rank else (_nothing, ()) for r in range(self.pool.num_workers)
        ]
        return self.pool._call("call", self.key, payloads)[rank]

    def run_sharded(self, method, items: list, *args) -> list:
        """Call ``method(items[dp_rank], *args)`` on every rank; like ``WorkerGroup``, return
        the result of each data-parallel shard's ``result_rank`` (its first tensor-parallel
        rank in the last pipeline stage)."""
        assert len(items) == self.dp_size, (len(items), self.dp_size)
        n = self.pool.num_workers
        payloads = [(method, (items[self.layout.dp_rank(r, n)], *args)) for r in range(n)]
        results = self.pool._call("call", self.key, payloads)
        return [results[self.layout.result_rank(d, n)] for d in range(self.dp_size)]

    def shutdown(self) -> None:
        """Drop the instances (the processes stay for the next group)."""
        self.pool._call("stop", self.key, [None] * self.pool.num_workers)
