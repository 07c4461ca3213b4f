"""Worker groups: N Ray actors running one component class, one per rank, on placement bundles.

The driver talks to a group, never to single actors: ``run_all`` calls a method on every rank,
``run_sharded`` gives each data-parallel shard its item, ``run_one`` calls one rank. Every call
is bounded by the group's timeout, and a worker that raises or dies becomes a
:class:`~nrl_core.distributed.errors.WorkerError` naming the group, rank, node and log tail.

Rank layout: tensor-parallel ranks vary fastest, then context-parallel, then pipeline-parallel,
then data-parallel, so ``dp_rank = rank // (tp * cp * pp)`` and the first rank of DP shard ``d``
is ``d * tp * cp * pp``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nrl_core.distributed.cluster import ResourceNeed, check_resources, ray_resources
from nrl_core.distributed.errors import WorkerError, WorkerTimeoutError
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext

LOG_TAIL_LINES = 20
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@attrs.frozen
class Sharded:
    """An argument of :meth:`WorkerGroup.run_sharded` given per data-parallel shard, like its
    data: ``items[d]`` goes to the workers of DP shard ``d``."""

    items: Sequence[Any]


def _shard_of(value: Any, dp_rank: int) -> Any:
    return value.items[dp_rank] if isinstance(value, Sharded) else value


@attrs.frozen
class ParallelLayout:
    """Model-parallel sizes of a group; the data-parallel size follows from the worker count."""

    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp_size(self, num_workers: int) -> int:
        """The number of data-parallel shards of ``num_workers`` ranks."""
        if num_workers % self.model_parallel_size:
            raise NrlError(
                f"{num_workers} workers cannot be split into tp={self.tp} x pp={self.pp} x "
                f"cp={self.cp} groups; use a multiple of {self.model_parallel_size} workers"
            )
        return num_workers // self.model_parallel_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.model_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp


# ---------------------------------------------------------------------------------------------
# The actor


class _WorkerActor:
    """Hosts one rank: sets the torch.distributed variables, then builds the worker class.

    The class is imported from its target string here, inside the actor's interpreter (the
    plugin's venv), so the driver never imports the plugin's engine.
    """

    def __init__(self) -> None:
        self.worker: Any = None

    def describe(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "logs": [_fd_path(1), _fd_path(2)],
        }

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def setup(self, target: str, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        from nrl_core.registry import resolve_target

        os.environ.update(env)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        # The lead passes (options, context); the context must carry this worker's rank.
        args = tuple(_with_rank(a, rank, world_size) for a in args)
        kwargs = {k: _with_rank(v, rank, world_size) for k, v in kwargs.items()}
        cls = resolve_target(target, what="worker class")
        self.worker = cls(*args, **kwargs)

    def call(self, method: Method, args: tuple, kwargs: dict) -> Any:
        return _invoke(self.worker, method, args, kwargs)

    def call_sharded(self, method: Method, item: Any, args: tuple, kwargs: dict) -> Any:
        return _invoke(self.worker, method, (item, *args), kwargs)

    def close(self) -> None:
        close = getattr(self.worker, "shutdown", None)
        if callable(close):
            close()
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


Method = str | Callable[..., Any]
"""What a group call runs on each worker: the name of a worker method, or a function importable
in the actor (the core's per-rank code, e.g. :func:`nrl_core.training.train_on_rank`), called
as ``function(worker, *args)``."""


def _invoke(worker: Any, method: Method, args: tuple, kwargs: dict) -> Any:
    if callable(method):
        return method(worker, *args, **kwargs)
    return getattr(worker, method)(*args, **kwargs)


def _method_name(method: Method) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _with_rank(value: Any, rank: int, world_size: int) -> Any:
    if isinstance(value, ComponentContext):
        return attrs.evolve(value, rank=rank, world_size=world_size)
    return value


_RemoteWorker = ray.remote(max_restarts=0, max_task_retries=0)(_WorkerActor)


# ---------------------------------------------------------------------------------------------
# The driver side


def create_placement_group(
    num_bundles: int,
    num_cpus_per_bundle: float = 1,
    num_gpus_per_bundle: float = 0,
    *,
    name: str = "worker",
    timeout_s: float = 600,
    strategy: str = "PACK",
) -> PlacementGroup:
    """Reserve ``num_bundles`` bundles (CPU-only when no GPU is asked) and wait until ready.

    Groups that should share devices (colocation) pass the returned object as
    ``placement_group`` to each :meth:`WorkerGroup.start`, asking fractional resources that
    together fit in one bundle.
    """
    check_resources(
        [ResourceNeed(name, num_bundles, num_cpus_per_bundle, num_gpus_per_bundle)], ray_resources()
    )
    bundle: dict[str, float] = {"CPU": num_cpus_per_bundle}
    if num_gpus_per_bundle:
        bundle["GPU"] = num_gpus_per_bundle
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise WorkerTimeoutError(
            f"{name}: the cluster could not reserve {num_bundles} bundles of {bundle} within "
            f"{timeout_s:g}s; other jobs may hold the resources (see `ray status`)",
            group=name,
        )
    return pg


@attrs.define
class _WorkerInfo:
    rank: int
    node_ip: str | None = None
    pid: int | None = None
    logs: list[str | None] = attrs.field(factory=list)


class WorkerGroup:
    """A set of Ray actors, one per rank, running the same worker class. Use :meth:`start`."""

    def __init__(
        self,
        name: str,
        actors: list[Any],
        infos: list[_WorkerInfo],
        layout: ParallelLayout,
        timeout_s: float,
        placement_group: PlacementGroup,
        owns_placement_group: bool,
    ) -> None:
        self.name = name
        self.actors = actors
        self.infos = infos
        self.layout = layout
        self.timeout_s = timeout_s
        self.placement_group = placement_group
        self._owns_pg = owns_placement_group
        self.dp_size = layout.dp_size(len(actors))

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    @classmethod
    def start(
        cls,
        target: str,
        num_workers: int,
        args: tuple = (),
        kwargs: dict | None = None,
        name: str = "worker",
        env_vars: dict[str, str] | None = None,
        python: str | None = None,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        placement_group: PlacementGroup | None = None,
        layout: ParallelLayout | None = None,
        timeout_s: float = 600,
    ) -> WorkerGroup:
        """Start ``num_workers`` actors and build ``target(*args, **kwargs)`` in each.

        Resources are checked before any actor starts. ``python`` is the actors' interpreter
        (an actor venv, see :mod:`nrl_core.distributed.actor_env`); ``env_vars`` are set in
        each actor's environment.
        """
        layout = layout or ParallelLayout()
        layout.dp_size(num_workers)  # fails early on an impossible layout
        if num_workers < 1:
            raise NrlError(f"{name} needs at least one worker; got num_workers={num_workers}")
        owns_pg = placement_group is None
        if placement_group is None:
            placement_group = create_placement_group(
                num_workers,
                num_cpus_per_worker,
                num_gpus_per_worker,
                name=name,
                timeout_s=timeout_s,
            )
        elif placement_group.bundle_count < num_workers:
            raise NrlError(
                f"{name} has {num_workers} workers but the shared placement group "
                f"has only {placement_group.bundle_count} bundles; colocated groups "
                "need one bundle per worker"
            )
        runtime_env: dict[str, Any] = {}
        if env_vars:
            runtime_env["env_vars"] = dict(env_vars)
        if python:
            runtime_env["py_executable"] = python
        tag = uuid.uuid4().hex[:6]
        actors = [
            _RemoteWorker.options(
                name=f"nrl-{name}-{rank}-{tag}",
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                runtime_env=runtime_env or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(num_workers)
        ]
        infos = [_WorkerInfo(rank) for rank in range(num_workers)]
        group = cls(name, actors, infos, layout, timeout_s, placement_group, owns_pg)
        try:
            group._setup(target, args, kwargs or {})
        except BaseException:
            group.shutdown(timeout_s=5)
            raise
        return group

    def _setup(self, target: str, args: tuple, kwargs: dict) -> None:
        described = self._gather([a.describe.remote() for a in self.actors], "start")
        for info, desc in zip(self.infos, described, strict=True):
            info.node_ip, info.pid, info.logs = desc["node_ip"], desc["pid"], desc["logs"]
        port = self._gather([self.actors[0].free_port.remote()], "start", ranks=[0])[0]
        local_ranks: dict[str, int] = {}
        per_node = {
            d["node_id"]: sum(x["node_id"] == d["node_id"] for x in described) for d in described
        }
        # One object-store copy of the constructor arguments, however many workers read them.
        args_ref = ray.put(tuple(args))
        kwargs_ref = ray.put(dict(kwargs))
        refs = []
        for rank, (actor, desc) in enumerate(zip(self.actors, described, strict=True)):
            local_rank = local_ranks.get(desc["node_id"], 0)
            local_ranks[desc["node_id"]] = local_rank + 1
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.num_workers),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(per_node[desc["node_id"]]),
                "MASTER_ADDR": described[0]["node_ip"],
                "MASTER_PORT": str(port),
            }
            refs.append(actor.setup.remote(target, env, args_ref, kwargs_ref))
        self._gather(refs, f"construct {target}")

    # -- calls ------------------------------------------------------------------------------

    def run_all(self, method: Method, *args: Any, **kwargs: Any) -> list:
        """Call ``method(*args, **kwargs)`` on every worker; results in rank order."""
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)
        return self._gather(
            [a.call.remote(method, args_ref, kwargs_ref) for a in self.actors],
            _method_name(method),
        )

    def run_sharded(self, method: Method, data: Sequence[Any], *args: Any, **kwargs: Any) -> list:
        """Call ``method(data[dp_rank], *args, **kwargs)`` on every worker.

        ``data`` has one item per data-parallel shard; further arguments wrapped in
        :class:`Sharded` are split the same way, the others go to every worker. Returns the
        result of the first rank (tp = pp = cp rank 0) of each shard, in DP order.
        """
        sharded = [v for v in (*args, *kwargs.values()) if isinstance(v, Sharded)]
        for what in (data, *(v.items for v in sharded)):
            if len(what) != self.dp_size:
                raise NrlError(
                    f"{self.name}.{_method_name(method)}: got {len(what)} shards for dp_size="
                    f"{self.dp_size}; split the data into exactly dp_size items"
                )
        items = [ray.put(item) for item in data]
        if sharded:
            per_dp = [
                (
                    ray.put(tuple(_shard_of(v, d) for v in args)),
                    ray.put({k: _shard_of(v, d) for k, v in kwargs.items()}),
                )
                for d in range(self.dp_size)
            ]
        else:  # one object-store copy shared by every rank
            per_dp = [(ray.put(args), ray.put(kwargs))] * self.dp_size
        refs = [
            a.call_sharded.remote(
                method, items[self.layout.dp_rank(rank)], *per_dp[self.layout.dp_rank(rank)]
            )
            for rank, a in enumerate(self.actors)
        ]
        results = self._gather(refs, _method_name(method))
        step = self.layout.model_parallel_size
        return [results[d * step] for d in range(self.dp_size)]

    def run_one(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the worker of ``rank`` only."""
        if not 0 <= rank < self.num_workers:
            raise NrlError(f"{self.name} has ranks 0..{self.num_workers - 1}; got rank {rank}")
        ref = self.actors[rank].call.remote(method, args, kwargs)
        return self._gather([ref], _method_name(method), ranks=[rank])[0]

    def shutdown(self, timeout_s: float = 30) -> None:
        """Let workers clean up (``worker.shutdown()`` if defined), then kill the actors."""
        if not self.actors:
            return
        refs = [a.close.remote() for a in self.actors]
        # Dead actors cannot close; they are killed below anyway.
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []
        if self._owns_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)

    # -- waiting without hanging ----------------------------------------------------------

    def _gather(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """``ray.get`` of ``refs`` bounded by the timeout; the first failure raises."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[Any, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(rank_of[r] for r in pending)
                rank = late[0]
                raise WorkerTimeoutError(
                    f"{self.name} rank(s) {late} did not finish {what!r} within "
                    f"{self.timeout_s:g}s (first on node {self.infos[rank].node_ip}); raise "
                    f"cluster.worker_timeout_s if this is expected{self._log_suffix(rank)}",
                    group=self.name,
                    rank=rank,
                    node=self.infos[rank].node_ip,
                    log_tail=self._log_tail(rank),
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as exc:
                    raise self._worker_error(rank_of[ref], what, exc) from None
        return [results[r] for r in refs]

    def _worker_error(self, rank: int, what: str, exc: Exception) -> WorkerError:
        info = self.infos[rank]
        node = info.node_ip or "unknown node"
        who = f"{self.name} worker rank {rank} (node {node}, pid {info.pid or '?'})"
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            first = (str(cause).strip().splitlines() or [""])[0]
            detail = (
                f"raised {type(cause).__name__}: {first}"
                if first
                else f"raised {type(cause).__name__}"
            )
            trace = [
                ln for ln in _ANSI.sub("", str(exc)).strip().splitlines() if ln.strip(" ^~")
            ]  # drop colour codes and caret-only lines
            tail = "\n".join(trace[-LOG_TAIL_LINES:])
            message = f"{who} {detail} in {what!r}\n--- remote traceback (tail) ---\n{tail}"
        elif isinstance(exc, ray.exceptions.RuntimeEnvSetupError):
            first = (str(exc).strip().splitlines() or [""])[-1]
            message = f"{who} could not start its runtime environment (python/env_vars): {first}"
        elif isinstance(exc, ray.exceptions.RayActorError):
            message = (
                f"{who} died during {what!r} (the process exited or was killed; "
                "out of memory and os._exit are common causes)"
            )
        else:
            message = f"{who} failed in {what!r}: {type(exc).__name__}: {exc}"
        log_tail = self._log_tail(rank)
        return WorkerError(
            message + self._log_suffix(rank, log_tail),
            group=self.name,
            rank=rank,
            node=info.node_ip,
            log_tail=log_tail,
        )

    def _log_tail(self, rank: int) -> str:
        lines: list[str] = []
        for path in self.infos[rank].logs:
            if path and Path(path).is_file():
                try:
                    text = Path(path).read_text(errors="replace")
                except OSError:
                    continue
                lines += [
                    f"{Path(path).name[-4:]}| {line}"
                    for line in text.splitlines()[-LOG_TAIL_LINES:]
                ]
        return "\n".join(lines)

    def _log_suffix(self, rank: int, tail: str | None = None) -> str:
        tail = self._log_tail(rank) if tail is None else tail
        logs = [p for p in self.infos[rank].logs if p]
        where = f"\nworker logs: {', '.join(logs)}" if logs else ""
        return f"{where}\n--- worker log (tail) ---\n{tail}" if tail else where


class InProcessGroup:
    """One worker object in this process, behind the calls of :class:`WorkerGroup`.

    For single-process use and tests: the core's facades (:class:`nrl_core.policy.Policy`) then
    run the same per-rank code on a worker built directly, without Ray.
    """

    def __init__(self, worker: Any, name: str = "worker") -> None:
        self.worker = worker
        self.name = name
        self.layout = ParallelLayout()
        self.dp_size = 1
        self.num_workers = 1

    def run_all(self, method: Method, *args: Any, **kwargs: Any) -> list:
        return [_invoke(self.worker, method, args, kwargs)]

    def run_sharded(self, method: Method, data: Sequence[Any], *args: Any, **kwargs: Any) -> list:
        if len(data) != 1:
            raise NrlError(f"{self.name}: an in-process group takes 1 shard; got {len(data)}")
        args = tuple(_shard_of(a, 0) for a in args)
        kwargs = {k: _shard_of(v, 0) for k, v in kwargs.items()}
        return [_invoke(self.worker, method, (data[0], *args), kwargs)]

    def run_one(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Any:
        if rank != 0:
            raise NrlError(f"{self.name} has rank 0 only; got rank {rank}")
        return _invoke(self.worker, method, args, kwargs)

    def shutdown(self, timeout_s: float = 30) -> None:
        close = getattr(self.worker, "shutdown", None)
        if callable(close):
            close()
