"""The ``inprocess`` cluster: the policy rank, its generation and the environments run in the
driver process, without Ray.

A 1-rank CPU run spends most of its start-up on Ray (a head, then one actor process per worker,
each importing torch again). This cluster starts nothing: every worker group of the run is built
in this process (:class:`InProcessWorkerGroup`) and called directly. What a Ray actor gets from
being its own process, each in-process worker gets around every call, so that the run computes
exactly what the Ray path computes:

* its own random state: torch's CPU generator, Python's :mod:`random` and numpy's (a fresh
  process's at first; the worker's seeding never touches the driver's, nor the reverse);
* its own environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... as the Ray path
  sets them; the torch.distributed rendezvous listens on loopback only, as there);
* its own torch thread count (what Ray gives an actor: ``OMP_NUM_THREADS`` = the worker's CPUs,
  at least 1, unless the environment or the caller's ``env_vars`` set it);
* copies of the arguments and results (Ray pickles them; a worker never sees the driver's
  objects, nor the driver the worker's);
* a bound on environment steps (``env.step_timeout_s``): the step runs in a thread and a late
  one fails the run naming the key. The policy's calls are not bounded
  (``cluster.worker_timeout_s`` does not apply: a call cannot be interrupted in-process);
* its output (Python-level ``print`` and warnings) in the run log, like a Ray worker's, unless
  ``-v``.

``cluster.backend=auto`` (the default) picks this cluster where it is exact
(:func:`hosting_problem` says nothing), else ``local``. An explicit ``cluster.backend=inprocess``
with a layout it cannot host is refused before anything starts (:func:`check_inprocess`).

This module stays light: Ray and torch are imported only when a group starts.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from nrl_core.distributed import hosting_here
from nrl_core.distributed.errors import ClusterError, WorkerError, WorkerTimeoutError
from nrl_core.errors import ConfigError, NrlError
from nrl_core.run_log import RunLogWriter

INPROCESS = "inprocess"
AUTO = "auto"
LOOPBACK = "127.0.0.1"
# One worker call at a time: the swaps of random state, environment and threads are
# process-wide (``nrl serve`` calls the policy from its server thread).
_CALL_LOCK = threading.RLock()


def active() -> InProcessCluster | None:
    """The in-process cluster this process runs, or None (a Ray cluster, or none)."""
    return hosting_here.active()  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Which runs it hosts


def hosting_problem(config: Any, registry: Any) -> str | None:
    """Why the in-process cluster cannot run ``config`` exactly as Ray would (None: it can).

    It hosts one policy rank on a machine without GPUs, with generation inside the policy
    worker (``generation.backend=torch``, colocated), no teacher (``nrl run distill``: a second
    torch.distributed world) nor critic (``nrl run ppo``: likewise), no asynchronous GRPO (separate engines), no agent that calls the
    policy endpoint from its own process, and components run by this interpreter (no
    ``actor_env`` naming another one).
    """
    from nrl_core.distributed.actor_env import actor_env_setting

    policy = getattr(config, "policy", None)
    if policy is not None and policy.num_workers != 1:
        return f"policy.num_workers={policy.num_workers}: it hosts exactly one policy rank"
    if getattr(config, "teacher", None) is not None:
        return "a distillation teacher is a second torch.distributed world (nrl run distill)"
    if getattr(config, "critic", None) is not None:
        return "a PPO critic is a second torch.distributed world (nrl run ppo)"
    generation = getattr(config, "generation", None)
    if generation is not None:
        from nrl_core.generation import runs_in_policy_workers

        spec = registry.get("generation", generation.backend, key="generation.backend")
        if not runs_in_policy_workers(spec, generation):
            return (
                f"generation.backend={generation.backend} starts separate engines; only "
                "generation inside the policy worker (torch, colocated) runs in-process"
            )
    grpo = getattr(config, "grpo", None)
    if grpo is not None and getattr(getattr(grpo, "async_", None), "enabled", False):
        return "grpo.async.enabled=true needs separate generation engines"
    agent = getattr(config, "agent", None)
    if agent is not None:
        from nrl_core.agents import BUILTIN_AGENT

        data = getattr(config, "data", None)
        named = {agent.name} | {t.agent for t in getattr(data, "tasks", None) or () if t.agent}
        driving = sorted(named - {BUILTIN_AGENT})
        if driving:
            return f"agent {driving[0]} calls the policy endpoint over HTTP from its own process"
    cluster = getattr(config, "cluster", None)
    for key in ("policy", "generation", "env", "agent", "teacher", "critic", "cluster"):
        section = getattr(config, key, None)
        setting = actor_env_setting(
            getattr(section, "actor_env", None), getattr(cluster, "actor_env", None)
        )
        if setting not in ("venv", "auto", "system"):
            return (
                f"{key}.actor_env={setting} names another interpreter; in-process every "
                "component runs in this one"
            )
    from nrl_core.distributed.devices import machine_has_gpus

    if (getattr(cluster, "gpus_per_node", None) or 0) > 0 or machine_has_gpus():
        return "this machine has GPUs; the in-process cluster runs on CPU only"
    return None


def cluster_backend(config: Any, registry: Any) -> str:
    """The cluster backend a run uses: ``cluster.backend``, with ``auto`` resolved to
    ``inprocess`` where :func:`hosting_problem` finds nothing, else ``local``."""
    backend = config.cluster.backend
    if backend != AUTO:
        return backend
    return INPROCESS if hosting_problem(config, registry) is None else "local"


def check_inprocess(config: Any, registry: Any) -> None:
    """Refuse ``cluster.backend=inprocess`` for a run it cannot host, in one line
    (:class:`ConfigError`, before anything starts)."""
    cluster = getattr(config, "cluster", None)
    if cluster is None or cluster.backend != INPROCESS:
        return
    problem = hosting_problem(config, registry)
    if problem is not None:
        raise ConfigError(
            f"cluster.backend=inprocess cannot host this run: {problem}; use "
            "cluster.backend=local (or auto, which picks it)"
        )


# ---------------------------------------------------------------------------------------------
# The cluster


class InProcessCluster:
    """The ``inprocess`` cluster component (built as ``InProcessCluster(options, context)``).

    :meth:`start` reports this machine's CPUs (``cluster.num_cpus`` if set) and no GPU, and
    from then on every worker group starts in this process (see
    :meth:`nrl_core.distributed.worker_group.WorkerGroup.start`). SIGTERM exits with code 143
    after the run's clean-up, as on the local cluster (Ctrl-C: 130).
    """

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.options, self.context = options, context
        self.console_output = True
        """Whether the workers' Python output reaches the console; False sends it to the run
        log (set by the run: ``nrl run`` without ``-v``)."""
        self._previous: Any = None

    def start(self) -> Any:
        from nrl_core.interfaces import ClusterResources

        if active() not in (None, self):
            raise ClusterError("an in-process cluster is already running in this process")
        config = getattr(self.context, "config", None)
        from nrl_core.distributed.resources import cpu_count

        cpus = getattr(getattr(config, "cluster", None), "num_cpus", None) or cpu_count()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _on_sigterm)
        hosting_here.set_active(self)
        return ClusterResources(num_nodes=1, cpus_per_node=[float(cpus)], gpus_per_node=[0.0])

    def shutdown(self) -> None:
        """Forget this cluster (idempotent); the groups were shut down by the run before."""
        if active() is self:
            hosting_here.set_active(None)
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def start_worker_group(self, target: str, num_workers: int, *args: Any, **kwargs: Any) -> Any:
        """``WorkerGroup.start`` while this cluster is active: an :class:`InProcessWorkerGroup`."""
        return InProcessWorkerGroup.start(target, num_workers, *args, **kwargs)


class _Terminated(SystemExit):
    """The SIGTERM handler's exit: unlike a worker's own ``sys.exit``, it ends the run."""


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: unwind like Ctrl-C does (the run closes its components), exit code 143."""
    raise _Terminated(128 + signum)


# ---------------------------------------------------------------------------------------------
# Worker groups


@attrs.define
class _WorkerInfo:
    """As the Ray group's: where a rank runs (here: this process)."""

    rank: int
    node_ip: str = LOOPBACK
    pid: int = attrs.field(factory=os.getpid)
    logs: list[str | None] = attrs.field(factory=list)


@attrs.define
class _Slot:
    """One in-process worker and what would be its own process's state."""

    rank: int
    env: dict[str, str]
    threads: int
    torch_rng: Any = None
    python_rng: Any = None
    numpy_rng: Any = None
    worker: Any = None


class InProcessWorkerGroup:
    """The worker group of the in-process cluster: the calls of
    :class:`~nrl_core.distributed.worker_group.WorkerGroup` on worker objects built here.
    Built by :meth:`start` (what ``WorkerGroup.start`` returns while :func:`active`)."""

    def __init__(self, name: str, layout: Any, timeout_s: float) -> None:
        self.name = name
        self.layout = layout
        self.timeout_s = timeout_s
        self.slots: list[_Slot] = []
        self.infos: list[_WorkerInfo] = []
        self.is_local = True
        self.master_addr = LOOPBACK
        self.call_timeouts: dict[str, tuple[float, str]] = {}
        self.dp_size = 1
        self._store: Any = None

    @property
    def num_workers(self) -> int:
        return len(self.slots)

    @property
    def worker(self) -> Any:
        """Rank 0's worker object."""
        return self.slots[0].worker

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
        placement_group: Any = None,
        layout: Any = None,
        timeout_s: float = 600,
        rendezvous: bool = True,
    ) -> InProcessWorkerGroup:
        """Build ``target(*args, **kwargs)`` ``num_workers`` times in this process, each with
        the environment a Ray actor of that rank would get (see the module's docstring;
        ``rendezvous`` as for :meth:`WorkerGroup.start`)."""
        from nrl_core.distributed.worker_actor import _serve_store
        from nrl_core.distributed.worker_group import ParallelLayout
        from nrl_core.registry import resolve_target

        layout = layout or ParallelLayout()
        if num_workers < 1:
            raise NrlError(f"{name} needs at least one worker; got num_workers={num_workers}")
        if num_gpus_per_worker:
            raise ClusterError(f"{name} asks for GPUs; the in-process cluster runs on CPU only")
        if python and os.path.realpath(python) != os.path.realpath(sys.executable):
            raise ClusterError(
                f"{name} would run in {python}; the in-process cluster runs every component in "
                "this interpreter: unset its actor_env, or use cluster.backend=local"
            )
        group = cls(name, layout, timeout_s)
        group.dp_size = layout.dp_size(num_workers)
        served = _serve_store(LOOPBACK) if rendezvous else None
        port = None
        if served is not None:
            group._store, port = served
        elif rendezvous:
            import socket

            with socket.socket() as sock:
                sock.bind((LOOPBACK, 0))
                port = sock.getsockname()[1]
        cluster = active()
        quiet = cluster is not None and not cluster.console_output
        for rank in range(num_workers):
            env = {
                **(env_vars or {}),
                "RANK": str(rank),
                "WORLD_SIZE": str(num_workers),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(num_workers),
            }
            if rendezvous:
                env.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
            if served is not None:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            if quiet:
                from nrl_core.distributed.cluster import QUIET_WORKER_ENV

                env.update({k: v for k, v in QUIET_WORKER_ENV.items() if k not in os.environ})
            # The caller's OMP_NUM_THREADS (the policy's threads per rank) reaches a Ray actor
            # through its environment, as here; the user's own setting wins over both.
            threads = int(
                os.environ.get("OMP_NUM_THREADS") or env.get("OMP_NUM_THREADS") or 0
            ) or max(math.floor(num_cpus_per_worker), 1)
            group.slots.append(_Slot(rank, env, threads, *_fresh_random_state()))
            group.infos.append(_WorkerInfo(rank))
        try:
            for slot in group.slots:
                ctor_args, ctor_kwargs = copy.deepcopy((tuple(args), dict(kwargs or {})))
                ctor_args = tuple(_with_rank(a, slot.rank, num_workers) for a in ctor_args)
                ctor_kwargs = {
                    k: _with_rank(v, slot.rank, num_workers) for k, v in ctor_kwargs.items()
                }

                def build(ctor_args=ctor_args, ctor_kwargs=ctor_kwargs):
                    cls_ = resolve_target(target, what="worker class")
                    return cls_(*ctor_args, **ctor_kwargs)

                slot.worker = group._call(slot, build, f"construct {target}", copy_io=False)
        except BaseException:
            group.shutdown(timeout_s=0)
            raise
        return group

    # -- calls (as WorkerGroup's) -----------------------------------------------------------

    def run_all(self, method: Any, *args: Any, **kwargs: Any) -> list:
        """Call ``method(*args, **kwargs)`` on every worker; results in rank order."""
        return [self._invoke(slot, method, args, kwargs) for slot in self.slots]

    def run_sharded(self, method: Any, data: Sequence[Any], *args: Any, **kwargs: Any) -> list:
        """``method(data[dp_rank], *args, **kwargs)`` on every worker (arguments wrapped in
        ``Sharded`` split alike); each shard's result from its result rank, in DP order."""
        from nrl_core.distributed.worker_actor import _shard_of, check_shard_counts

        check_shard_counts(self.name, method, data, args, kwargs, self.dp_size)
        results = []
        for slot in self.slots:
            d = self.layout.dp_rank(slot.rank, self.num_workers)
            results.append(
                self._invoke(
                    slot,
                    method,
                    (data[d], *(_shard_of(a, d) for a in args)),
                    {k: _shard_of(v, d) for k, v in kwargs.items()},
                )
            )
        return [results[self.layout.result_rank(d, self.num_workers)] for d in range(self.dp_size)]

    def run_one(self, rank: int, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the worker of ``rank`` only."""
        if not 0 <= rank < self.num_workers:
            raise NrlError(f"{self.name} has ranks 0..{self.num_workers - 1}; got rank {rank}")
        return self._invoke(self.slots[rank], method, args, kwargs)

    def set_call_timeout(self, method: str, seconds: float, key: str) -> None:
        """Bound later calls of ``method`` by ``seconds`` (run in a thread; a late call fails
        naming ``key``), as :meth:`WorkerGroup.set_call_timeout`."""
        self.call_timeouts[method] = (float(seconds), key)

    def dead_rank_error(self, what: str, timeout_s: float = 10) -> WorkerError | None:
        """Always None: an in-process worker cannot die without the driver (see
        :meth:`WorkerGroup.dead_rank_error`)."""
        return None

    def shutdown(self, timeout_s: float = 30) -> None:
        """``worker.shutdown()`` where defined (not after a timed-out call: ``timeout_s=0``),
        and the torch.distributed group a worker formed."""
        slots, self.slots = self.slots, []
        if timeout_s > 0:
            for slot in slots:
                close = getattr(slot.worker, "shutdown", None)
                if callable(close):
                    with contextlib.suppress(Exception):
                        self._call(slot, lambda close=close: close(), "shutdown", copy_io=False)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._store = None

    # -- one call, as if in the worker's own process ----------------------------------------

    def _invoke(self, slot: _Slot, method: Any, args: tuple, kwargs: dict) -> Any:
        from nrl_core.distributed.worker_actor import _invoke, _method_name

        what = _method_name(method)
        return self._call(
            slot, lambda *a, **k: _invoke(slot.worker, method, a, k), what, args, kwargs
        )

    def _call(
        self,
        slot: _Slot,
        function: Callable[..., Any],
        what: str,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        copy_io: bool = True,
    ) -> Any:
        kwargs = kwargs or {}
        if copy_io:
            args, kwargs = copy.deepcopy((args, kwargs))
        timeout = self.call_timeouts.get(what)
        with _CALL_LOCK, _as_worker(slot, self._output_source(slot)):
            try:
                if timeout is None:
                    result = function(*args, **kwargs) if copy_io else function()
                else:
                    result = self._bounded(slot, function, what, args, kwargs, *timeout)
            except (WorkerError, _Terminated):
                raise
            except (Exception, SystemExit) as exc:
                # A worker's sys.exit() would end a Ray actor, not the driver: here too it is
                # this worker's failure, one line naming it, not the silent end of the run.
                raise self._error(slot, what, exc) from None
        return copy.deepcopy(result) if copy_io else result

    def _bounded(self, slot, function, what, args, kwargs, seconds: float, key: str) -> Any:
        """``function`` in a daemon thread, waited for ``seconds``: a late call is a
        :class:`WorkerTimeoutError` naming ``key`` (the thread is left behind; the run ends)."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = function(*args, **kwargs)
            except BaseException as exc:  # handed to the caller below
                outcome["error"] = exc

        thread = threading.Thread(target=run, name=f"nrl-{self.name}-{slot.rank}", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise WorkerTimeoutError(
                f"{self.name} rank {slot.rank} did not finish {what} within {seconds:g}s; raise "
                f"{key} if this is expected",
                group=self.name,
                rank=slot.rank,
                node=LOOPBACK,
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    def _output_source(self, slot: _Slot) -> str | None:
        cluster = active()
        if cluster is None or cluster.console_output:
            return None
        return f"({self.name} rank {slot.rank}, in process)"

    def _error(self, slot: _Slot, what: str, exc: BaseException) -> WorkerError:
        """The one-line error of a worker's failure, as the Ray group words it; the traceback
        goes to the run log."""
        from nrl_core.run_log import log_failure

        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        exit_code = exc.exit_code if isinstance(exc, NrlError) else None
        if isinstance(exc, NrlError):
            detail = f"failed in {what}: {first}"
        else:
            name = type(exc).__name__
            detail = f"failed in {what}: {name}: {first}" if first else f"failed in {what}: {name}"
        summary = f"{self.name} rank {slot.rank} {detail}"
        trace = "".join(traceback.format_exception(exc))
        run_log = log_failure(
            summary, f"group {self.name}, rank {slot.rank}, in process\n--- traceback ---\n{trace}"
        )
        suffix = f" (full traceback: {run_log})" if run_log else " (-v prints the traceback)"
        return WorkerError(
            summary + suffix,
            group=self.name,
            rank=slot.rank,
            node=LOOPBACK,
            remote_traceback=trace,
            log_file=str(run_log) if run_log else None,
            exit_code=exit_code,
        )


def _with_rank(value: Any, rank: int, world_size: int) -> Any:
    from nrl_core.interfaces import ComponentContext

    if isinstance(value, ComponentContext):
        return attrs.evolve(value, rank=rank, world_size=world_size)
    return value


def _fresh_random_state() -> tuple[Any, Any, Any]:
    """The random state of a fresh process: torch's default seed, Python's and numpy's from
    the OS's entropy (numpy's only once numpy is imported)."""
    import torch

    numpy = sys.modules.get("numpy")
    return (
        torch.Generator().get_state(),
        random.Random().getstate(),
        numpy.random.RandomState().get_state() if numpy is not None else None,
    )


@contextlib.contextmanager
def _as_worker(slot: _Slot, output_source: str | None):
    """Swap in ``slot``'s random state, environment variables and torch threads (and send
    Python output to the run log when ``output_source`` is set); swap back after, keeping
    the worker's state for its next call."""
    import torch

    numpy = sys.modules.get("numpy")
    saved_env = {key: os.environ.get(key) for key in slot.env}
    saved = (
        torch.get_rng_state(),
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
        torch.get_num_threads(),
    )
    os.environ.update(slot.env)
    torch.set_rng_state(slot.torch_rng)
    random.setstate(slot.python_rng)
    if numpy is not None:
        if slot.numpy_rng is None:  # numpy was imported since the worker was built
            slot.numpy_rng = numpy.random.RandomState().get_state()
        numpy.random.set_state(slot.numpy_rng)
    if torch.get_num_threads() != slot.threads:
        torch.set_num_threads(slot.threads)
    redirect = RunLogWriter(output_source) if output_source else None
    try:
        if redirect is None:
            yield
        else:
            with contextlib.redirect_stdout(redirect), contextlib.redirect_stderr(redirect):
                yield
    finally:
        if redirect is not None:
            redirect.flush()
        slot.torch_rng = torch.get_rng_state()
        slot.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            slot.numpy_rng = numpy.random.get_state()
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if numpy is not None and saved[2] is not None:
            numpy.random.set_state(saved[2])
        if torch.get_num_threads() != saved[3]:
            torch.set_num_threads(saved[3])
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
