"""Worker groups: N Ray actors running one component class, one per rank, on placement bundles.

The driver talks to a group, never to single actors: ``run_all`` calls a method on every rank,
``run_sharded`` gives each data-parallel shard its item, ``run_one`` calls one rank. Every call
is bounded by the group's timeout (or the method's own, :meth:`WorkerGroup.set_call_timeout`),
and a worker that raises, dies or hangs becomes a one-line
:class:`~nrl_core.distributed.errors.WorkerError` naming the group, rank and the file with the
full traceback (the run log, :mod:`nrl_core.run_log`).

Rank layout (Megatron-Core's default order, ``tp-cp-ep-dp-pp``): tensor-parallel ranks vary
fastest, then context-parallel, then data-parallel, then pipeline stages, so a stage is a block
of ``tp * cp * dp`` consecutive ranks and ``dp_rank = rank // (tp * cp) % dp``. Without pipeline
stages the first rank of DP shard ``d`` is ``d * tp * cp``. Expert parallelism takes no ranks of
its own: a MoE layer's experts are split over ``ep`` of the ``dp * cp`` ranks of a stage that
hold the same dense weights (as in Megatron-Core), so it changes neither the shards nor who
returns them. Each shard's result comes from one rank, :meth:`ParallelLayout.result_rank`: the
first tp/cp rank of the shard in the last pipeline stage (where the logits are). Megatron-Core
0.16.1 requires this pp-last order for pipeline and expert parallelism together
(``parallel_state.initialize_model_parallel``: "When not using pp-last rank ordering, the data
parallel size of the attention and moe layers must be the same").

What runs inside each actor is :mod:`nrl_core.distributed.worker_actor` (:class:`Sharded` is
re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nrl_core.distributed.cluster import ResourceNeed, check_resources, ray_resources
from nrl_core.distributed.errors import WorkerError, WorkerTimeoutError
from nrl_core.distributed.worker_actor import (
    LOOPBACK,
    Method,
    Sharded,  # noqa: F401  (re-exported: callers import it from here)
    _invoke,
    _loopback_env,
    _method_name,
    _shard_of,
    _WorkerActor,
    check_shard_counts,
    venv_environment,
)
from nrl_core.errors import NrlError

LOG_TAIL_LINES = 20
DEFAULT_TIMEOUT_KEY = "cluster.worker_timeout_s"
"""The config key named when a call exceeds the group's own timeout."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines Ray writes into every worker log to route output (":job_id:01000000"): not the worker's.
_RAY_MARKER = re.compile(r"^:(job_id|actor_name|task_name):")


@attrs.frozen
class ParallelLayout:
    """Model-parallel sizes of a group; the data-parallel size follows from the worker count."""

    tp: int = 1
    """Tensor-parallel size (>= 1)."""
    pp: int = 1
    """Pipeline-parallel size: stages, each holding a slice of the layers (>= 1)."""
    cp: int = 1
    """Context-parallel size (>= 1)."""
    ep: int = 1
    """Expert-parallel size (>= 1): over how many of the ``dp * cp`` ranks that share the dense
    weights a mixture of experts' experts are split; must divide ``dp * cp``."""

    @property
    def model_parallel_size(self) -> int:
        """The ranks one data shard spans (``tp * cp * pp``; experts take no ranks of their own)."""
        return self.tp * self.pp * self.cp

    def dp_size(self, num_workers: int) -> int:
        """The number of data-parallel shards of ``num_workers`` ranks; raises
        :class:`~nrl_core.errors.NrlError` for a layout the ranks cannot hold."""
        sizes = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        if num_workers < 1 or any(v < 1 for v in sizes.values()):
            got = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise NrlError(
                f"parallel sizes and the worker count must be >= 1; got {got}, "
                f"num_workers={num_workers}"
            )
        if num_workers % self.model_parallel_size:
            raise NrlError(
                f"{num_workers} workers cannot be split into tp={self.tp} x pp={self.pp} x "
                f"cp={self.cp} groups; use a multiple of {self.model_parallel_size} workers"
            )
        dp = num_workers // self.model_parallel_size
        if (dp * self.cp) % self.ep:
            raise NrlError(
                f"ep={self.ep} must divide the {dp * self.cp} data x context parallel ranks "
                f"of {num_workers} workers (tp={self.tp} x pp={self.pp}); lower ep or use a "
                f"multiple of {self.ep * self.model_parallel_size // math.gcd(self.ep, self.cp)}"
                " workers"
            )
        return dp

    def _stage_size(self, num_workers: int) -> int:
        # The ranks of one pipeline stage: tp * cp * dp.
        return self.tp * self.cp * self.dp_size(num_workers)

    def dp_rank(self, rank: int, num_workers: int) -> int:
        """The data shard rank ``rank`` (of ``num_workers``) works on."""
        return rank // (self.tp * self.cp) % self.dp_size(num_workers)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def pp_rank(self, rank: int, num_workers: int) -> int:
        """The pipeline stage of ``rank`` (0 holds the embeddings, ``pp - 1`` the logits)."""
        return rank // self._stage_size(num_workers)

    def ep_rank(self, rank: int, num_workers: int) -> int:
        """Which slice of the experts ``rank`` holds: the ``dp * cp`` ranks of one tp rank in
        one stage take consecutive slices in rank order."""
        return rank % self._stage_size(num_workers) // self.tp % self.ep

    def result_rank(self, dp_rank: int, num_workers: int) -> int:
        """The one rank whose result stands for data shard ``dp_rank``: its first tensor and
        context rank in the last pipeline stage, which computes the logits (and so the
        logprobs and the loss); the others' results are not read."""
        last_stage = (self.pp - 1) * self._stage_size(num_workers)
        return last_stage + dp_rank * self.tp * self.cp


@functools.cache
def _remote_worker(group: str, rank: int) -> Any:
    """The Ray actor class of ``group``'s rank ``rank``: :class:`_WorkerActor` under the name
    ``nrl-<group>-<rank>``, which Ray makes the process title (``ray::nrl-policy-0``, and
    ``ray::nrl-policy-0.call`` while it runs a call) and the prefix of its forwarded output, so
    ``ps``, ``top`` and the run log say which rank of which component a process is."""
    named = type(f"nrl-{group}-{rank}", (_WorkerActor,), {"__module__": _WorkerActor.__module__})
    return ray.remote(max_restarts=0, max_task_retries=0)(named)


# ---------------------------------------------------------------------------------------------
# The driver side


def _spawn(name: str, rank: int, options: dict[str, Any], pg: PlacementGroup) -> Any:
    """A new actor for ``name``'s rank ``rank`` on bundle ``rank`` of ``pg`` (a fresh Ray
    name each time: a replaced rank's old name may still be taken)."""
    return (
        _remote_worker(name, rank)
        .options(
            name=f"nrl-{name}-{rank}-{uuid.uuid4().hex[:6]}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank
            ),
            **options,
        )
        .remote()
    )


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
        self.is_local = False
        """Every rank runs on the driver's node (known once the group started)."""
        self.master_addr: str | None = None
        """Where rank 0's rendezvous listens: 127.0.0.1 for a local group, else its node IP."""
        self.call_timeouts: dict[str, tuple[float, str]] = {}
        """Per-method (timeout in seconds, config key naming it); see :meth:`set_call_timeout`."""
        # What start() made the actors with, for replace_rank.
        self._spawn_options: dict[str, Any] = {}
        self._target: tuple[str, tuple, dict] | None = None
        self._envs: list[dict[str, str]] = []

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
        rendezvous: bool = True,
        max_concurrency: int = 1,
    ) -> WorkerGroup:
        """Start ``num_workers`` actors and build ``target(*args, **kwargs)`` in each.

        Resources are checked before any actor starts. ``python`` is the actors' interpreter
        (an actor venv, see :mod:`nrl_core.distributed.actor_env`); ``env_vars`` are set in
        each actor's environment. ``rendezvous=False`` for workers that never form a
        ``torch.distributed`` group (environments, agents): no store and no ``MASTER_*``
        variables, so their actors never import torch for it (about 1.5 CPU-s each).
        ``max_concurrency`` (>= 1): calls each actor runs at once, on threads of its own (Ray's
        threaded actors) when above 1; the target must then be safe to call from several
        threads (engines that take a refit while they generate). The in-process backend runs
        calls in the caller's thread and ignores it.
        """
        from nrl_core.distributed import hosting_here

        here = hosting_here.active()
        if here is not None:  # cluster.backend=inprocess: no actor, no Ray
            return here.start_worker_group(  # type: ignore[no-any-return]
                target, num_workers, args, kwargs, name=name, env_vars=env_vars, python=python,
                num_cpus_per_worker=num_cpus_per_worker, num_gpus_per_worker=num_gpus_per_worker,
                placement_group=placement_group, layout=layout, timeout_s=timeout_s,
                rendezvous=rendezvous,
            )  # fmt: skip
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
        env = {**venv_environment(python), **(env_vars or {})} if python else dict(env_vars or {})
        if env:
            runtime_env["env_vars"] = env
        if python:
            runtime_env["py_executable"] = python
        options = {
            "max_concurrency": max_concurrency,
            "num_cpus": num_cpus_per_worker,
            "num_gpus": num_gpus_per_worker,
            "runtime_env": runtime_env or None,
        }
        actors = [_spawn(name, rank, options, placement_group) for rank in range(num_workers)]
        infos = [_WorkerInfo(rank) for rank in range(num_workers)]
        group = cls(name, actors, infos, layout, timeout_s, placement_group, owns_pg)
        group._spawn_options = options
        group._target = (target, tuple(args), dict(kwargs or {}))
        try:
            group._setup(target, args, kwargs or {}, rendezvous=rendezvous)
        except BaseException:
            group.shutdown(timeout_s=5)
            raise
        return group

    def _setup(self, target: str, args: tuple, kwargs: dict, *, rendezvous: bool = True) -> None:
        described = self._gather([a.describe.remote() for a in self.actors], "start")
        for info, desc in zip(self.infos, described, strict=True):
            info.node_ip, info.pid, info.logs = desc["node_ip"], desc["pid"], desc["logs"]
        driver_node = ray.get_runtime_context().get_node_id()
        # Every rank on the driver's node: nothing needs to reach rank 0 from the network, so
        # the rendezvous store and gloo listen on loopback only (torch's store would listen on
        # every interface, unauthenticated).
        self.is_local = all(d["node_id"] == driver_node for d in described)
        self.master_addr = LOOPBACK if self.is_local else described[0]["node_ip"]
        port = None
        if self.is_local and rendezvous:
            port = self._gather([self.actors[0].host_store.remote(LOOPBACK)], "start", ranks=[0])[0]
        hosted = port is not None
        if port is None and rendezvous:
            host = LOOPBACK if self.is_local else ""
            port = self._gather([self.actors[0].free_port.remote(host)], "start", ranks=[0])[0]
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
            }
            if rendezvous:
                env.update(MASTER_ADDR=self.master_addr, MASTER_PORT=str(port))
            if hosted:  # the ranks are clients of rank 0's loopback store (see _serve_store)
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            if self.is_local:
                env.update(_loopback_env())
            self._envs.append(env)
            refs.append(actor.setup.remote(target, env, args_ref, kwargs_ref))
        self._gather(refs, f"construct {target}")

    def replace_rank(self, rank: int) -> None:
        """Start a new actor in place of ``rank``'s (dead) one: the same worker class and
        arguments, interpreter, environment, resources and placement bundle, as
        :meth:`start` made it. The old actor is killed first (its bundle share frees up).
        What the rank held (weights, state) is gone: the caller restores it (an engine's
        refit). Raises :class:`WorkerError` when the new actor cannot start."""
        if self._target is None:
            raise NrlError(f"{self.name} was not started by WorkerGroup.start: cannot replace")
        with contextlib.suppress(Exception):
            ray.kill(self.actors[rank], no_restart=True)
        actor = _spawn(self.name, rank, self._spawn_options, self.placement_group)
        self.actors[rank] = actor
        what = f"restart rank {rank}"
        desc = self._gather([actor.describe.remote()], what, ranks=[rank])[0]
        info = self.infos[rank]
        info.node_ip, info.pid, info.logs = desc["node_ip"], desc["pid"], desc["logs"]
        target, args, kwargs = self._target
        ref = actor.setup.remote(target, self._envs[rank], ray.put(args), ray.put(kwargs))
        self._gather([ref], f"construct {target}", ranks=[rank])

    def close_workers(self) -> None:
        """Close every rank's worker as :meth:`shutdown` does (``worker.shutdown()`` where
        defined, then its ``torch.distributed`` group) but keep the actors, for
        :meth:`rebuild`. Raises :class:`WorkerError` when a rank is dead or its close fails."""
        self._gather([a.close.remote() for a in self.actors], "close")

    def rebuild(
        self,
        target: str,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        layout: ParallelLayout | None = None,
        rendezvous: bool = True,
    ) -> None:
        """Build ``target(*args, **kwargs)`` in this group's actors instead of its workers:
        the workers are closed (:meth:`close_workers`), then set up as :meth:`start` sets them
        up, with a new rendezvous, in the same processes. For test suites that build many
        short-lived groups: an actor's start-up (an interpreter importing torch and the plugin)
        costs several CPU-seconds, more than most such tests compute. The actors keep their
        interpreter, resources and environment variables, and whatever an old worker left in
        its process (module state, threads it did not stop). Raises :class:`WorkerError` when
        a rank is dead or a worker cannot be built."""
        self.close_workers()
        layout = layout or ParallelLayout()
        self.dp_size = layout.dp_size(self.num_workers)  # fails early on an impossible layout
        self.layout = layout
        self.call_timeouts = {}
        self._envs = []
        self._target = (target, tuple(args), dict(kwargs or {}))
        self._setup(target, args, kwargs or {}, rendezvous=rendezvous)

    # -- calls ------------------------------------------------------------------------------

    # Calls pass their arguments inline, not through ray.put: an explicit put costs about a
    # millisecond per object however small (2-3 ms per call of a 2-rank group, measured), while
    # Ray itself moves any argument over its inline limit (100 KB) to the object store. Only a
    # large argument shared by every rank is then stored once per rank instead of once.

    def run_all(self, method: Method, *args: Any, **kwargs: Any) -> list:
        """Call ``method(*args, **kwargs)`` on every worker; results in rank order."""
        return self._gather(
            [a.call.remote(method, args, kwargs) for a in self.actors], _method_name(method)
        )

    def run_sharded(self, method: Method, data: Sequence[Any], *args: Any, **kwargs: Any) -> list:
        """Call ``method(data[dp_rank], *args, **kwargs)`` on every worker.

        ``data`` has one item per data-parallel shard; further arguments wrapped in
        :class:`Sharded` are split the same way, the others go to every worker. Returns the
        result of each shard's :meth:`ParallelLayout.result_rank` (tp = cp rank 0 of the
        last pipeline stage), in DP order.
        """
        check_shard_counts(self.name, method, data, args, kwargs, self.dp_size)
        per_dp = [
            (
                tuple(_shard_of(v, d) for v in args),
                {k: _shard_of(v, d) for k, v in kwargs.items()},
            )
            for d in range(self.dp_size)
        ]
        dp_ranks = [self.layout.dp_rank(r, self.num_workers) for r in range(self.num_workers)]
        refs = [
            a.call_sharded.remote(method, data[dp_ranks[rank]], *per_dp[dp_ranks[rank]])
            for rank, a in enumerate(self.actors)
        ]
        results = self._gather(refs, _method_name(method))
        return [results[self.layout.result_rank(d, self.num_workers)] for d in range(self.dp_size)]

    def run_one(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the worker of ``rank`` only."""
        if not 0 <= rank < self.num_workers:
            raise NrlError(f"{self.name} has ranks 0..{self.num_workers - 1}; got rank {rank}")
        ref = self.actors[rank].call.remote(method, args, kwargs)
        return self._gather([ref], _method_name(method), ranks=[rank])[0]

    def dead_rank_error(self, what: str, timeout_s: float = 10) -> WorkerError | None:
        """The one-line error of the first rank whose actor is dead (``died in {what}``, its
        pid and cause), or None when every rank answers. For a failure seen by another group
        first: a policy rank whose refit could not reach an engine reports only that the
        engine's actor died, not which one, nor why."""
        refs = [actor.describe.remote() for actor in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                return self._worker_error(rank, what, exc)
            except Exception:  # alive but busy (a timeout) or failing otherwise: not dead
                continue
        return None

    def shutdown(self, timeout_s: float = 30) -> None:
        """Let workers clean up (``worker.shutdown()`` if defined), then kill the actors.

        Once Ray itself is stopped (a Ctrl-C or SIGTERM stops it at once) the actors are gone
        with it and no Ray call is made: any would start a second, fresh Ray instance."""
        if not self.actors:
            return
        if not ray.is_initialized():
            self.actors = []
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

    def set_call_timeout(self, method: str, seconds: float, key: str) -> None:
        """Bound every later call of ``method`` by ``seconds`` instead of the group's timeout;
        a call that takes longer fails naming ``key``, the config key that sets it (e.g. an
        environment's ``step`` by ``env.step_timeout_s``)."""
        self.call_timeouts[method] = (float(seconds), key)

    def _timeout_of(self, what: str) -> tuple[float, str]:
        return self.call_timeouts.get(what, (self.timeout_s, DEFAULT_TIMEOUT_KEY))

    def _gather(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """``ray.get`` of ``refs`` bounded by the timeout of ``what`` (see
        :meth:`set_call_timeout`); the first failure raises a one-line
        :class:`~nrl_core.distributed.errors.WorkerError`."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[Any, Any] = {}
        pending = list(refs)
        timeout_s, key = self._timeout_of(what)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted({rank_of[r] for r in pending})
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
                summary = (
                    f"{self.name} {who} did not finish {what} within {timeout_s:g}s; raise {key} "
                    "if this is expected"
                )
                raise self._error(WorkerTimeoutError, summary, late[0])
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as exc:
                    raise self._worker_error(rank_of[ref], what, exc) from None
        return [results[r] for r in refs]

    def _worker_error(self, rank: int, what: str, exc: Exception) -> WorkerError:
        """The one-line error of ``rank``'s failure in ``what``; the detail goes to the run log."""
        exit_code = None
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            first = _first_line(cause)
            if isinstance(cause, NrlError):
                # A component's own user-facing error (a ConfigError: bad user input) keeps its
                # message and its exit code.
                detail = f"failed in {what}: {first}"
                exit_code = cause.exit_code
            else:
                name = type(cause).__name__
                detail = (
                    f"failed in {what}: {name}: {first}" if first else f"failed in {what}: {name}"
                )
            # Without colour codes and caret-only lines, which only make sense on a terminal.
            trace = "\n".join(
                ln for ln in _ANSI.sub("", str(exc)).strip().splitlines() if ln.strip(" ^~")
            )
        elif isinstance(exc, ray.exceptions.RuntimeEnvSetupError):
            last = (str(exc).strip().splitlines() or [""])[-1]
            detail = f"could not start its runtime environment (python/env_vars): {last}"
            trace = str(exc)
        elif isinstance(exc, ray.exceptions.RayActorError):
            pid = self.infos[rank].pid or "?"
            detail = f"died in {what} (pid {pid}): {_death_cause(exc, self._log_tail(rank))}"
            trace = ""
        else:
            detail = f"failed in {what}: {type(exc).__name__}: {_first_line(exc)}"
            trace = "".join(traceback.format_exception(exc))
        return self._error(WorkerError, f"{self.name} rank {rank} {detail}", rank, trace, exit_code)

    def _error(
        self,
        cls: type[WorkerError],
        summary: str,
        rank: int,
        trace: str = "",
        exit_code: int | None = None,
    ) -> WorkerError:
        """``cls`` with the one-line ``summary`` plus where the detail is: the run log (where
        the detail is written now) or, outside a run, the rank's Ray worker log."""
        from nrl_core.run_log import log_failure

        info = self.infos[rank]
        tail = self._log_tail(rank)
        logs = [p for p in info.logs if p]
        parts = [
            f"group {self.name}, rank {rank}, node {info.node_ip or '?'}, pid {info.pid or '?'}, "
            f"worker logs: {', '.join(logs) or 'unknown'}"
        ]
        if trace:
            parts.append(f"--- remote traceback ---\n{trace}")
        if tail:
            parts.append(f"--- worker log (last {LOG_TAIL_LINES} lines) ---\n{tail}")
        run_log = log_failure(summary, "\n".join(parts))
        log_file = str(run_log) if run_log else (logs[-1] if logs else None)
        return cls(
            summary + self._log_suffix(rank, run_log, bool(trace)),
            group=self.name,
            rank=rank,
            node=info.node_ip,
            log_tail=tail,
            remote_traceback=trace,
            log_file=log_file,
            exit_code=exit_code,
        )

    def _log_tail(self, rank: int) -> str:
        """The last lines of ``rank``'s Ray worker logs (stdout, stderr), each line prefixed
        with the end of its file's name (``.out|``, ``.err|``)."""
        lines: list[str] = []
        for path in self.infos[rank].logs:
            if path and Path(path).is_file():
                try:
                    text = Path(path).read_text(errors="replace")
                except OSError:
                    continue
                own = [ln for ln in text.splitlines() if not _RAY_MARKER.match(ln)]
                lines += [f"{Path(path).name[-4:]}| {line}" for line in own[-LOG_TAIL_LINES:]]
        return "\n".join(lines)

    def _log_suffix(self, rank: int, run_log: Path | None, has_trace: bool) -> str:
        """Where the rest is, in parentheses: the run log, else the worker's Ray log (whose
        traceback ``nrl -v`` prints, from the error's attributes)."""
        if run_log is not None:
            return f" (full traceback: {run_log})" if has_trace else f" (details: {run_log})"
        logs = [p for p in self.infos[rank].logs if p]
        where = f"worker log: {logs[-1]}" if logs else ""
        if has_trace:
            where = f"{where}; -v prints the traceback" if where else "-v prints the traceback"
        return f" ({where})" if where else ""


_FATAL = re.compile(r"Fatal Python error: (.+)")


def _death_cause(exc: BaseException, log_tail: str) -> str:
    """Why an actor's process died, as far as anyone can tell: Ray names ``ray.kill`` and a
    SIGTERM; a crash (SIGSEGV, SIGABRT, SIGBUS...) leaves Python's fatal-error line in the
    worker's log; a SIGKILL, the out-of-memory killer or ``os._exit`` leave nothing (the raylet
    sees the connection close, never the exit status)."""
    text = str(exc)
    if "ray.kill" in text:
        return "it was stopped by ray.kill"
    if "receives a SIGTERM" in text:
        return "its process was terminated (SIGTERM)"
    crash = _FATAL.findall(log_tail)
    if crash:
        return f"its process crashed ({crash[-1].strip()})"
    return (
        "its process was killed or exited without a word (SIGKILL, the out-of-memory killer "
        "or os._exit: no exit status reaches Ray)"
    )


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message ("" when it has none)."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")


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
