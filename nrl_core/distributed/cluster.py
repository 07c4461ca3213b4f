"""The ``local`` cluster component (the ``ray`` one, which joins a running cluster, is
:mod:`~nrl_core.distributed.ray_cluster`; the resource feasibility check
:mod:`~nrl_core.distributed.resources`; the routing of Ray's output
:mod:`~nrl_core.distributed.ray_output`; all re-exported here).

``local`` starts a Ray head inside this process (and always stops it: at exit, on Ctrl-C, on
SIGTERM, on error); ``ray`` joins a running cluster and never stops it.

Both print what Ray prints (its INFO lines, the workers' output it forwards) unless told
otherwise (:attr:`LocalCluster.console_output`): ``nrl run`` without ``-v`` sends it to the run
log, ``<run dir>/nrl.log``, and keeps the console for the run's own lines.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from nrl_core.distributed.errors import ClusterError
from nrl_core.distributed.ray_cluster import RayCluster, cluster_section
from nrl_core.distributed.ray_output import RayOutputToRunLog
from nrl_core.distributed.resources import ResourceNeed, check_resources, ray_resources
from nrl_core.interfaces import ClusterResources

__all__ = [
    "LocalCluster",
    "RayCluster",
    "RayOutputToRunLog",
    "ResourceNeed",
    "check_resources",
    "ray_resources",
]

# Ray puts unix sockets under its temp dir and a socket path may not exceed 107 bytes, so the
# real temp dir stays short under /tmp and the run directory gets a symlink to it.
TEMP_DIR_PREFIX = "nrl-ray-"
START_ATTEMPTS = 3
"""Start-ups of the local Ray head always tried before a run gives up; more while the time
limit (:func:`start_timeout_s`) lasts, up to :data:`MAX_START_ATTEMPTS`."""
MAX_START_ATTEMPTS = 20
"""At most this many start-ups (one takes 30-60 s on a busy 2-core machine)."""
START_TIMEOUT_ENV = "NRL_RAY_START_TIMEOUT_S"
"""Environment variable that sets the start-up's time limit, in seconds."""
BASE_START_TIMEOUT_S = 60.0
"""The start-up's limit on an idle machine. A local head starts in 3-8 s idle on 2 cores and in
35-60 s beside 10 busy processes (load average 13-28); see :func:`start_timeout_s`."""
MAX_START_TIMEOUT_S = 600.0
RAYLET_ENV: Mapping[str, str] = {
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_worker_niceness": "0",
}
"""Set while a local head starts (its raylet reads them; a value already set wins).

* No prestarted workers: the raylet would start one idle Python worker per CPU, at start-up
  and for the first driver, for tasks of the default runtime environment; nrl starts actors
  only, each with a runtime environment of its own, so those workers never run anything: 0.8
  CPU-s of every run on 2 CPUs (measured with a cgroup's CPU accounting of `nrl run grpo`, 2
  ranks).
* Workers at the driver's priority: Ray starts them at niceness 15, so that its own daemons
  stay responsive on a node the workers saturate. In a local run the actors are the run's
  work (the in-process backend computes at the driver's priority), and at 15 (the kernel's
  weight 36 against 1024 at 0) they get little CPU beside any busy process of normal priority
  (`top`: the policy actor at 6%, the other process at 194%): the MoE router-replay
  run of plugins/nrl-vllm (two 1-step GRPO runs on vLLM's CPU engine) took 400 s beside one
  process training a small MLP on torch's two threads (as long as that process ran), 87 s
  at niceness 0, 58 s alone (2 cores, 2026-11-30)."""
QUIET_WORKER_ENV: Mapping[str, str] = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""Set for the workers of a local cluster whose output goes to the run log: Hugging Face's
progress bars ("Loading weights") would only fill it with carriage returns. A value already
set in the environment wins."""


@contextlib.contextmanager
def _set_missing(variables: Mapping[str, str]) -> Iterator[None]:
    """Set those of ``variables`` the environment lacks, for the ``with`` block only."""
    added = [name for name in variables if name not in os.environ]
    os.environ.update({name: variables[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def start_timeout_s(load: float | None = None, cpus: int | None = None) -> float:
    """How long starting the local Ray head may take, all attempts together:
    :data:`BASE_START_TIMEOUT_S` on an idle machine, times the load per CPU on a busy one (a
    start-up is a dozen processes - GCS, raylet, its agents, the log monitor - that all
    compete for the CPUs), at most :data:`MAX_START_TIMEOUT_S`; ``$NRL_RAY_START_TIMEOUT_S``
    sets it outright.

    Ray's own wait for its raylet is a fixed 30 s (``ray/_private/node.py``, not configurable
    in Ray 2.60): :meth:`LocalCluster.start` lets the raylet take this long instead, and stops
    waiting at once when the raylet has died (see :func:`raylet_failure`).
    """
    configured = os.environ.get(START_TIMEOUT_ENV)
    if configured:
        try:
            value = float(configured)
        except ValueError:
            raise ClusterError(
                f"{START_TIMEOUT_ENV}={configured!r} is not a number of seconds"
            ) from None
        if value <= 0:
            raise ClusterError(f"{START_TIMEOUT_ENV} must be > 0, got {configured}")
        return value
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    cpus = cpus or os.cpu_count() or 1
    return min(MAX_START_TIMEOUT_S, BASE_START_TIMEOUT_S * max(1.0, load / cpus))


_received_signal: int | None = None


def received_signal() -> int | None:
    """The SIGINT / SIGTERM a cluster's handler stopped this process for (None: none came).

    Ray calls Python's signal handlers from inside its waits (``ray.get``/``ray.wait``, its
    ``check_signals``) and turns the ``SystemExit(128 + signum)`` the handler raises there into
    ``SystemExit(1)`` (its ``check_status``): the CLI reads the signal from here to exit with
    the right code all the same."""
    return _received_signal


_RAYLET_FATAL = ("Check failed", "An unexpected system state has occurred")


def raylet_failure(temp_dir: str | os.PathLike) -> str | None:
    """Why the raylet of the newest session under ``temp_dir`` died at start-up (its fatal
    log line, shortened), or None while it has not. On a busy machine this is usually
    ``Timed out waiting for file .../metrics_agent_port_...``: the raylet gives its agents a
    fixed ~15 s to start (Ray 2.60; ``RAY_raylet_start_wait_time_s`` does not change it,
    measured)."""
    log = Path(temp_dir) / "session_latest" / "logs" / "raylet.out"
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - 65536))
            tail = file.read().decode(errors="replace")
    except OSError:
        return None
    for line in tail.splitlines():
        if any(marker in line for marker in _RAYLET_FATAL):
            reason = line.split("Check failed:", 1)[-1].split("]", 1)[-1].strip()
            if "Timed out waiting for file" in reason:
                name = Path(reason.rsplit(" ", 1)[-1]).name.rsplit("_", 1)[0]
                return f"Ray's raylet gave up waiting for its agents ({name} file)"
            return f"Ray's raylet died at start-up: {reason[:200]}"
    return None


class _RayletDied(Exception):
    """The raylet died during start-up (raised through Ray's wait loop, which only catches
    RuntimeError)."""


@contextlib.contextmanager
def _patient_raylet_wait(temp_dir: Path, deadline: float):
    """Within ``ray.init``: let the raylet register until ``deadline`` (``time.monotonic``)
    rather than Ray's fixed 30 s, and stop at once when it died.

    Ray polls ``ray._private.services.get_node`` until the node is registered; the wrapper
    polls on its own until the deadline and raises :class:`_RayletDied` as soon as the
    raylet's log shows it died. Restored on exit."""
    from ray._private import services

    original = services.get_node

    def get_node(*args: Any, **kwargs: Any) -> Any:
        while True:
            _raise_pending_signal()  # a safe point: the driver has not connected yet
            try:
                return original(*args, **kwargs)
            except RuntimeError:
                failure = raylet_failure(temp_dir)
                if failure is not None:
                    raise _RayletDied(failure) from None
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


class _SignalDuringStart(BaseException):
    """A Ctrl-C or SIGTERM that arrived while the local head started, raised at a safe point
    (a BaseException, so that no ``except Exception`` in Ray swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_pending_signals: list[int] = []


def _raise_pending_signal() -> None:
    """At a safe point of the start-up: raise the Ctrl-C / SIGTERM that arrived meanwhile."""
    if _pending_signals:
        raise _SignalDuringStart(_pending_signals[0])


@contextlib.contextmanager
def _signals_stop_the_start(cluster: LocalCluster):
    """While the local head starts, a Ctrl-C or SIGTERM stops the start-up cleanly (exit 130 /
    143, one line, no process or temp folder left) through
    :meth:`LocalCluster._stopped_while_starting`.

    The handler only records the signal; it is acted on at safe points
    (:func:`_raise_pending_signal`: between steps, while Ray waits for its raylet, and once
    ``ray.init`` returned). An exception raised by the handler wherever Python happened to
    be could interrupt Ray's driver half-way through connecting its core worker (C++): the
    driver then died of SIGSEGV in ``_raylet.so`` at exit, leaving the temp folder (issue 47:
    2 of 4 Ctrl-C's; 1 of 20 in a loop of tries at 3.5-8 s into ``ray.init``).

    ``ray.init`` installs SIGTERM handlers of its own midway (one calls ``sys.exit(15)``, one
    kills its processes and calls ``sys.exit(1)``): exit 15 with no message and the temp
    folder left. Ray installs them through ``ray._private.utils.set_sigterm_handler``, which
    is made a no-op meanwhile, so this handler stays until the cluster installs its own."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    from ray._private import utils as ray_utils

    def defer(signum: int, frame: Any) -> None:
        _pending_signals.append(signum)

    _pending_signals.clear()
    original = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, defer)
    try:
        yield
        _raise_pending_signal()
    except _SignalDuringStart as stop:
        ray_utils.set_sigterm_handler = original
        # A second signal meanwhile must not cut the clean-up short.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        cluster._stopped_while_starting(stop.signum)
    finally:
        ray_utils.set_sigterm_handler = original
        _pending_signals.clear()


def _run_dir(context: Any) -> Path | None:
    logger = getattr(getattr(context, "config", None), "logger", None)
    if logger is None:
        return None
    return Path(logger.log_dir) / logger.run_name


class LocalCluster:
    """Starts a Ray head in this process; stops it when the run ends, however it ends.

    Ray's temp folder (its logs, sockets and object spill files) is removed with it, together
    with the run folder's ``ray`` link to it, unless the run failed and
    :attr:`keep_temp_on_failure` is set (``nrl run -v``): then one line on stderr says where
    the logs are. A watcher process (:mod:`nrl_core.distributed.reaper`) does the same when
    this process dies without shutting down (``kill -9``), and stops the Ray agents that would
    otherwise linger for a minute. On every exit path the shared-memory segments that the run's
    processes left in ``/dev/shm`` are unlinked (a refit bucket of a policy rank killed
    mid-refit, the message queues of a stopped vLLM or SGLang engine; see
    :class:`~nrl_core.distributed.reaper.SegmentLedger`).

    Args:
        options: unused (the cluster component registers no options class).
        context: its ``config.cluster`` gives ``num_cpus``, ``gpus_per_node`` and ``dashboard``.
        log_dir: where a ``ray`` symlink to Ray's session logs is made (default: the run
            directory ``logger.log_dir/logger.run_name`` when the config has one).
        temp_dir: Ray's temp dir (default: a fresh, short ``/tmp/nrl-ray-<id>``).
    """

    def __init__(
        self,
        options: Any = None,
        context: Any = None,
        *,
        log_dir: str | os.PathLike | None = None,
        temp_dir: str | os.PathLike | None = None,
    ) -> None:
        self.options, self.context = options, context
        self.config = cluster_section(context)
        self.log_dir = Path(log_dir) if log_dir is not None else _run_dir(context)
        self.temp_dir = (
            Path(temp_dir)
            if temp_dir is not None
            else Path(tempfile.gettempdir()) / f"{TEMP_DIR_PREFIX}{uuid.uuid4().hex[:8]}"
        )
        self._keep_temp_on_failure = False
        self.console_output = True
        """Print Ray's INFO lines and the workers' output here, as Ray does; False (``nrl run``
        without ``-v``): write them to the run log instead (see :class:`RayOutputToRunLog`).
        Read by :meth:`start`."""
        self._output: RayOutputToRunLog | None = None
        self.failed = False
        """Set when the run failed (by :class:`~nrl_core.algorithms.runtime.RunSession`, or by
        a Ctrl-C / SIGTERM): with :attr:`keep_temp_on_failure`, the temp folder is kept."""
        self._started = False  # this object's ray.init is in effect
        self._temp_pending = False  # the temp folder exists and is not yet removed or kept
        self._reaper: subprocess.Popen | None = None
        self._processes: dict[int, int] = {}  # Ray's processes when it was stopped
        self._previous_handlers: dict[int, Any] = {}
        self.segment_prefix = f"nrl-{uuid.uuid4().hex[:8]}-"
        """Names this run's shared-memory segments (set as ``NRL_SHM_PREFIX`` for Ray's
        processes), so that the clean-up finds them all."""
        self._previous_prefix: str | None = None

    @property
    def ray_link(self) -> Path | None:
        """The run folder's ``ray`` symlink to :attr:`temp_dir` (None without a run folder)."""
        return None if self.log_dir is None else self.log_dir / "ray"

    @property
    def keep_temp_on_failure(self) -> bool:
        """Keep Ray's temp folder when the run fails, or when this process is killed
        (``nrl run -v`` sets it); otherwise it is always removed."""
        return self._keep_temp_on_failure

    @keep_temp_on_failure.setter
    def keep_temp_on_failure(self, keep: bool) -> None:
        self._keep_temp_on_failure = bool(keep)
        self._tell_reaper(b"keep" if keep else b"remove")

    def start(self) -> ClusterResources:
        """Start the Ray head and return its resources."""
        import ray

        from nrl_core.distributed.actor_env import check_image_manifest

        check_image_manifest()
        if ray.is_initialized():
            raise ClusterError(
                "Ray is already initialised in this process; call "
                "ray.shutdown() first or use cluster.backend=ray to join it"
            )
        if len(str(self.temp_dir)) > 60:
            raise ClusterError(
                f"Ray temp dir {self.temp_dir} is too long for unix sockets; "
                "use a path under 60 characters such as /tmp/nrl-ray"
            )
        # Ours to restore at shutdown: ray.init installs a SIGTERM handler of its own.
        self._previous_handlers = {
            signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)
        }
        # From before the temp folder exists: a Ctrl-C at any moment of the start-up
        # leaves nothing behind.
        with _signals_stop_the_start(self):
            # Never remove a folder we did not make.
            self._temp_pending = not self.temp_dir.exists()
            self.temp_dir.mkdir(parents=True, exist_ok=True)
            if not self.console_output:
                # Before ray.init: its own lines, and the workers' (which inherit the
                # environment).
                self._output = RayOutputToRunLog(QUIET_WORKER_ENV)
            # address="local" ignores RAY_ADDRESS: this backend must never join someone's
            # cluster.
            kwargs: dict[str, Any] = {
                "address": "local",
                "include_dashboard": self.config.dashboard,
                "_temp_dir": str(self.temp_dir),
                "log_to_driver": self._output is None or self._output.forwarding,
            }
            if self.config.num_cpus is not None:
                kwargs["num_cpus"] = self.config.num_cpus
            if self.config.gpus_per_node is not None:
                kwargs["num_gpus"] = self.config.gpus_per_node
            self._start_reaper()
            # Before ray.init: Ray's processes inherit this process's environment.
            from nrl_core.weight_sync.shm import SEGMENT_PREFIX_VAR

            self._previous_prefix = os.environ.get(SEGMENT_PREFIX_VAR)
            os.environ[SEGMENT_PREFIX_VAR] = self.segment_prefix
            atexit.register(self.shutdown)
            _raise_pending_signal()
            self._start_with_retries(ray, kwargs)
            # After ray.init, which installs its own SIGTERM handler that skips our clean-up.
            self._install_signal_handlers()
        self._link_logs()
        return ray_resources()

    def _start_with_retries(self, ray: Any, kwargs: dict[str, Any]) -> None:
        """``ray.init`` until it works: at least :data:`START_ATTEMPTS` times, and again while
        the start-up's limit (:func:`start_timeout_s`, which grows with the load) lasts, up to
        :data:`MAX_START_ATTEMPTS`; between attempts the failed one's processes are stopped.
        When none starts: one line saying why and what to try, and Ray's temp folder is
        removed unless :attr:`keep_temp_on_failure` (``-v``)."""
        failures: list[str] = []
        started = time.monotonic()
        deadline = started + start_timeout_s()
        attempt = 0
        while True:
            _raise_pending_signal()
            attempt += 1
            self._started = True
            try:
                # The raylet may take until the deadline, at least BASE_START_TIMEOUT_S.
                wait_until = max(deadline, time.monotonic() + BASE_START_TIMEOUT_S)
                with _patient_raylet_wait(self.temp_dir, wait_until), _set_missing(RAYLET_ENV):
                    ray.init(**kwargs)
                return
            except Exception as exc:
                reason = raylet_failure(self.temp_dir) or _one_line(exc)
                failures.append(reason)
                self._stop_attempt(ray)  # before the next one starts, or the clean-up
                more = attempt < START_ATTEMPTS or time.monotonic() < deadline
                if not _worth_retrying(exc) or not more or attempt >= MAX_START_ATTEMPTS:
                    break
                left = max(0.0, deadline - time.monotonic())
                print(
                    f"warning: the local Ray head did not start ({reason}{_load_note()}); "
                    f"trying again (attempt {attempt + 1}, {left:.0f} s of the start-up's "
                    "limit left)",
                    file=sys.stderr,
                )
        self.failed = True
        keep = self.keep_temp_on_failure
        if self._output is not None:
            self._output.remove()
            self._output = None
        self._shutdown(keep_temp=keep, say=False)
        where = f"Ray's logs are in {self.temp_dir}" if keep else "rerun with -v to keep Ray's logs"
        longer = f"{START_TIMEOUT_ENV}={max(1200, round(2 * start_timeout_s()))} to keep trying"
        raise ClusterError(
            f"could not start a local Ray head ({len(failures)} attempt"
            f"{'s' if len(failures) > 1 else ''} in {time.monotonic() - started:.0f} s"
            f"{_load_note()}): {failures[-1]}. Try: run it when the machine is less busy, "
            f"{longer} longer, or start Ray once yourself (`ray start --head`, retried until "
            f"it starts) and run with cluster.backend=ray; {where}"
        )

    def _stopped_while_starting(self, signum: int) -> None:
        """A Ctrl-C / SIGTERM arrived within ``ray.init``: stop what it started, remove the
        temp folder (kept with ``-v``), say so in one line, and exit 130 / 143."""
        import ray

        self._stop_attempt(ray)
        self.failed = True
        keep, ours = self.keep_temp_on_failure, self._temp_pending
        watcher = self._reaper.pid if self._reaper is not None else None
        self._shutdown(keep_temp=keep, say=True)
        if ours and not keep:
            self._remove_temp_dir_once_quiet(watcher)
        name = signal.Signals(signum).name
        print(
            f"stopped by {name} while the local Ray head was starting; its processes are stopped",
            file=sys.stderr,
        )
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    def _remove_temp_dir_once_quiet(
        self, watcher: int | None, settle_s: float = 1.0, limit_s: float = 15.0
    ) -> None:
        """Remove the temp folder for good after a start was stopped midway: a Ctrl-C from the
        terminal reaches Ray's processes too, and an agent whose raylet died with it is
        nobody's child (:meth:`_stop_attempt` does not find it) and may still write its log
        into the folder just removed, later the busier the machine is. Every process still
        naming the folder is stopped, then the folder removed, until it has stayed removed with
        no such process for ``settle_s`` (at most ``limit_s``)."""
        from nrl_core.distributed.reaper import kill, processes_naming, remove_temp_dir

        deadline = time.monotonic() + limit_s
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            stray: dict[int, int] = {}
            with contextlib.suppress(OSError):  # no /proc: nothing to find
                stray = processes_naming(str(self.temp_dir), exclude=watcher)
            kill(stray)
            if os.path.lexists(self.temp_dir):
                remove_temp_dir(str(self.temp_dir))
                quiet_since = None
            elif stray:
                quiet_since = None
            else:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= settle_s:
                    return
            time.sleep(0.1)

    def _stop_attempt(self, ray: Any) -> None:
        """Stop what a failed ``ray.init`` left running (its GCS, raylet, agents), found by
        their command lines naming :attr:`temp_dir`; the temp folder and the run-log output
        stay for the next attempt."""
        from nrl_core.distributed.reaper import kill, session_processes

        self._started = False
        processes: dict[int, int] = {}
        with contextlib.suppress(OSError):  # no /proc: nothing to find
            watcher = self._reaper.pid if self._reaper is not None else None
            processes = session_processes(os.getpid(), str(self.temp_dir), watcher)
        with contextlib.suppress(Exception):  # a half-started Ray may fail to stop cleanly
            if ray.is_initialized():
                ray.shutdown()
        kill(processes, grace_s=2)

    def shutdown(self, *, keep_temp: bool | None = None) -> None:
        """Stop the Ray head this object started, then remove its temp folder and the run
        folder's ``ray`` link (idempotent).

        Args:
            keep_temp: keep the temp folder (and say where, on stderr) instead; default:
                when the run :attr:`failed` and :attr:`keep_temp_on_failure` is set.
        """
        if keep_temp is None:
            keep_temp = self.failed and self.keep_temp_on_failure
        self._shutdown(keep_temp=keep_temp, say=True)

    def _shutdown(self, *, keep_temp: bool, say: bool) -> None:
        """Stop Ray and remove the temp folder; a Ctrl-C / SIGTERM meanwhile (after the run's
        summary, say) is acted on once the clean-up is done: interrupting it half-way left an
        empty ``session_*`` folder (issue 47)."""
        deferred: list[int] = []
        main = threading.current_thread() is threading.main_thread()
        before = {}
        if main:
            for signum in (signal.SIGINT, signal.SIGTERM):
                before[signum] = signal.getsignal(signum)
                signal.signal(signum, lambda signum, frame: deferred.append(signum))
        try:
            self._clean_up(keep_temp=keep_temp, say=say)
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            self._restore_handlers()
        if deferred:
            global _received_signal
            _received_signal = deferred[0]
            if deferred[0] == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + deferred[0])

    def _clean_up(self, *, keep_temp: bool, say: bool) -> None:
        self._stop_ray()
        self._restore_prefix()
        from nrl_core.distributed.reaper import kill, remove_temp_dir

        # Ray's agents and workers exit on their own once the raylet is gone; give them a
        # moment (files they still write would reappear), then make sure: the watcher
        # unlinks the run's shared memory once they are dead (_stop_reaper).
        kill(self._processes, grace_s=5)
        if not self._temp_pending:
            self._stop_reaper()
            return
        self._temp_pending = False
        if keep_temp:
            self._stop_reaper()
            if say:
                print(f"Ray's logs of this run are kept in {self.temp_dir}", file=sys.stderr)
            return
        link = self.ray_link
        remove_temp_dir(str(self.temp_dir), str(link) if link is not None else None)
        self._stop_reaper()

    # -- clean-up on every exit path ------------------------------------------------------

    def _stop_ray(self) -> None:
        """``ray.shutdown()`` once, and only for the head this object started."""
        if not self._started:
            return
        import ray

        from nrl_core.distributed.reaper import mapped_segments, session_processes

        self._started = False
        # Found now: once the raylet is gone its agents and workers are nobody's children.
        with contextlib.suppress(OSError):  # no /proc: nothing to wait for
            watcher = self._reaper.pid if self._reaper is not None else None
            self._processes = session_processes(os.getpid(), str(self.temp_dir), watcher)
            # What they map at the last moment (an engine's queue made since the watcher's
            # last look), for the watcher to unlink once they are dead.
            for name, inode in mapped_segments(self._processes).items():
                self._tell_reaper(f"seen {name} {inode}".encode())
        try:
            if ray.is_initialized():
                ray.shutdown()  # flushes the last forwarded lines: still to the run log
        finally:
            if self._output is not None:
                self._output.remove()
                self._output = None

    def _start_reaper(self) -> None:
        """Start the watcher that cleans up if this process dies without :meth:`shutdown`."""
        from nrl_core.distributed import reaper

        link = self.ray_link
        owned = "owned" if self._temp_pending else "borrowed"
        command = [sys.executable, "-I", "-S", reaper.__file__, str(self.temp_dir)]
        command += [str(link or ""), self.segment_prefix, owned]
        try:
            self._reaper = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C must not stop it first
            )
        except OSError:  # best effort: the run itself does not need it
            self._reaper = None
            return
        if self._keep_temp_on_failure:
            self._tell_reaper(b"keep")

    def _restore_prefix(self) -> None:
        from nrl_core.weight_sync.shm import SEGMENT_PREFIX_VAR

        if os.environ.get(SEGMENT_PREFIX_VAR) != self.segment_prefix:
            return  # never set (or another cluster's since)
        if self._previous_prefix is None:
            os.environ.pop(SEGMENT_PREFIX_VAR, None)
        else:
            os.environ[SEGMENT_PREFIX_VAR] = self._previous_prefix

    def _tell_reaper(self, command: bytes) -> None:
        if self._reaper is None or self._reaper.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._reaper.stdin.write(command + b"\n")
            self._reaper.stdin.flush()

    def _stop_reaper(self) -> None:
        if self._reaper is None:
            return
        reaper, self._reaper = self._reaper, None
        with contextlib.suppress(OSError, ValueError):
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
        try:
            reaper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.shutdown)
        for signum, handler in self._previous_handlers.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Ctrl-C / SIGTERM: stop Ray at once, then unwind (KeyboardInterrupt: exit code 130;
        SystemExit(128 + signum) for SIGTERM); the temp folder goes with :meth:`shutdown`."""
        global _received_signal
        _received_signal = signum
        previous = self._previous_handlers.get(signum)
        self.failed = True
        self._stop_ray()
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    def _link_logs(self) -> None:
        link = self.ray_link
        if link is None:
            return
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(self.temp_dir, target_is_directory=True)
        except OSError:
            pass  # a missing log link must not stop a run; the logs stay in temp_dir


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _worth_retrying(exc: BaseException) -> bool:
    """A start-up that timed out or whose raylet died may start next time; a bad argument or
    a missing binary will not."""
    return not isinstance(exc, TypeError | ValueError | FileNotFoundError | PermissionError)


def _load_note() -> str:
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    return f"; load average {load:.0f} on {os.cpu_count() or 1} CPUs"
