"""Ray's own output routed to the run log (``<run dir>/nrl.log``) instead of the console, while a
run without ``-v`` holds a cluster: its ``ray`` logger and the worker lines it forwards."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any


class RayOutputToRunLog:
    """From creation until :meth:`remove`, what Ray prints in this process goes to the run log
    (:mod:`nrl_core.run_log`) instead of the console: the records of its ``ray`` logger below
    ERROR ("Started a local Ray instance", the token-auth notice; errors are printed too) and
    every line it forwards from the cluster (the workers' stdout and stderr, with their
    ``(nrl-policy-0 pid=...)`` prefix, the raylet's and GCS's warnings, its error messages).

    Ray prints all forwarded lines through one function, ``print_worker_logs`` (the worker
    output and the error messages alike, deduplicated before); it is replaced while this is in
    effect. A Ray without it: :attr:`forwarding` is False and the caller asks ``ray.init`` for
    ``log_to_driver=False`` (the lines then stay in Ray's worker logs, whose tail a worker error
    still copies to the run log). A worker error is reported as before either way: one line
    naming the run log (:class:`~nrl_core.distributed.errors.WorkerError`).

    Args:
        env: variables set in this process's environment meanwhile (a value already set wins),
            which the workers of a Ray head started meanwhile inherit.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        import ray._private.worker as ray_worker

        from nrl_core.run_log import RunLogHandler

        self._module = ray_worker
        self._set_env = [name for name in (env or {}) if name not in os.environ]
        for name in self._set_env:
            os.environ[name] = env[name]  # type: ignore[index]
        self._logger = logging.getLogger("ray")
        self._levels = [(handler, handler.level) for handler in self._logger.handlers]
        for handler, level in self._levels:
            handler.setLevel(max(level, logging.ERROR))
        self._handler = RunLogHandler()
        self._logger.addHandler(self._handler)
        self._printer = getattr(ray_worker, "print_worker_logs", None)
        self.forwarding = callable(self._printer)
        """Forwarded lines reach the run log (else ``log_to_driver=False`` keeps them out)."""
        if self.forwarding:
            ray_worker.print_worker_logs = _worker_lines_to_run_log

    def remove(self) -> None:
        """Print Ray's output on the console again (idempotent)."""
        if self._handler is None:
            return
        self._logger.removeHandler(self._handler)
        self._handler = None
        for handler, level in self._levels:
            handler.setLevel(level)
        if self.forwarding:
            self._module.print_worker_logs = self._printer
        for name in self._set_env:
            os.environ.pop(name, None)


def _worker_lines_to_run_log(data: dict, print_file: Any = None, ignore_prefix: bool = False):
    """``ray._private.worker.print_worker_logs``'s stand-in: the lines of ``data`` (one batch
    Ray forwards: ``lines``, ``pid``, ``actor_name`` / ``task_name``, ``ip``) to the run log,
    after the prefix Ray would print."""
    from nrl_core.run_log import log_output

    pid = data.get("pid")
    lines = data.get("lines") or []
    if pid == "autoscaler":
        # Its status table every 5 s: only the events among them, as Ray would print.
        import ray._private.worker as ray_worker

        try:
            lines = list(ray_worker.filter_autoscaler_events(lines))
        except Exception:  # never stop Ray's log thread: the events are dropped instead
            lines = []
    if pid in ("raylet", "autoscaler", "gcs_server"):
        source = f"({pid})"
    else:
        name = data.get("actor_name") or data.get("task_name")
        ip = data.get("ip")
        where = "" if ip in (None, data.get("localhost")) else f", ip={ip}"
        source = f"({name + ' ' if name else ''}pid={pid}{where})"
    log_output(source, lines)
