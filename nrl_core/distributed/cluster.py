"""The ``local`` and ``ray`` cluster components, and the resource feasibility check.

``local`` starts a Ray head inside this process (and always stops it: at exit, on Ctrl-C, on
SIGTERM, on error); ``ray`` joins a running cluster and never stops it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from nrl_core.distributed.errors import ClusterError, InsufficientResourcesError
from nrl_core.interfaces import ClusterResources

# Ray puts unix sockets under its temp dir and a socket path may not exceed 107 bytes, so the
# real temp dir stays short under /tmp and the run directory gets a symlink to it.
TEMP_DIR_PREFIX = "nrl-ray-"


@attrs.frozen
class ResourceNeed:
    """What one worker group asks for, for :func:`check_resources`."""

    name: str
    num_workers: int
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0

    @property
    def cpus(self) -> float:
        return self.num_workers * self.num_cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.num_workers * self.num_gpus_per_worker


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _plural(value: float, unit: str) -> str:
    return f"{_fmt(value)} {unit}{'' if value == 1 else 's'}"


def check_resources(needs: Sequence[ResourceNeed], resources: ClusterResources) -> None:
    """Raise :class:`InsufficientResourcesError` when ``needs`` cannot all be placed.

    Called before any actor starts, so an impossible request fails in a second with numbers
    instead of Ray waiting forever for resources that will never appear.
    """
    have = (
        f"the cluster has {_plural(resources.total_gpus, 'GPU')} and "
        f"{_plural(resources.total_cpus, 'CPU')}"
    )
    fix = (
        "lower num_workers / the per-worker resources, or run on a larger cluster "
        "(cluster.num_cpus, cluster.gpus_per_node, cluster.backend=ray)"
    )
    for need in needs:
        if need.gpus > resources.total_gpus:
            raise InsufficientResourcesError(
                f"{need.name} needs {_plural(need.gpus, 'GPU')}; {have}; {fix}"
            )
        if need.cpus > resources.total_cpus:
            raise InsufficientResourcesError(
                f"{need.name} needs {_plural(need.cpus, 'CPU')}; {have}; {fix}"
            )
        # One worker is one bundle, and a bundle never spans nodes.
        fits_somewhere = any(
            need.num_cpus_per_worker <= cpus and need.num_gpus_per_worker <= gpus
            for cpus, gpus in zip(resources.cpus_per_node, resources.gpus_per_node, strict=True)
        )
        if need.num_workers and not fits_somewhere:
            raise InsufficientResourcesError(
                f"one {need.name} worker needs {_plural(need.num_cpus_per_worker, 'CPU')} and "
                f"{_plural(need.num_gpus_per_worker, 'GPU')} on a single node; no node has that "
                f"({have}); {fix}"
            )
    total_cpus = sum(n.cpus for n in needs)
    total_gpus = sum(n.gpus for n in needs)
    if len(needs) > 1 and (total_gpus > resources.total_gpus or total_cpus > resources.total_cpus):
        names = " + ".join(n.name for n in needs)
        raise InsufficientResourcesError(
            f"{names} together need {_plural(total_gpus, 'GPU')} and "
            f"{_plural(total_cpus, 'CPU')}; {have}; {fix}"
        )


def ray_resources() -> ClusterResources:
    """The alive nodes' CPUs and GPUs of the Ray cluster this process is connected to."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return ClusterResources(
        num_nodes=len(nodes),
        cpus_per_node=[float(n["Resources"].get("CPU", 0)) for n in nodes],
        gpus_per_node=[float(n["Resources"].get("GPU", 0)) for n in nodes],
    )


def _cluster_config(context: Any) -> Any:
    config = getattr(context, "config", None)
    cluster = getattr(config, "cluster", None)
    if cluster is None:
        from nrl_core.config.schema import ClusterConfig

        cluster = ClusterConfig()
    return cluster


def _run_dir(context: Any) -> Path | None:
    logger = getattr(getattr(context, "config", None), "logger", None)
    if logger is None:
        return None
    return Path(logger.log_dir) / logger.run_name


class LocalCluster:
    """Starts a Ray head in this process; stops it when the run ends, however it ends.

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
        self.config = _cluster_config(context)
        self.log_dir = Path(log_dir) if log_dir is not None else _run_dir(context)
        self.temp_dir = (
            Path(temp_dir)
            if temp_dir is not None
            else Path(tempfile.gettempdir()) / f"{TEMP_DIR_PREFIX}{uuid.uuid4().hex[:8]}"
        )
        self._started = False
        self._previous_handlers: dict[int, Any] = {}

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
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        # address="local" ignores RAY_ADDRESS: this backend must never join someone's cluster.
        kwargs: dict[str, Any] = {
            "address": "local",
            "include_dashboard": self.config.dashboard,
            "_temp_dir": str(self.temp_dir),
            "log_to_driver": True,
        }
        if self.config.num_cpus is not None:
            kwargs["num_cpus"] = self.config.num_cpus
        if self.config.gpus_per_node is not None:
            kwargs["num_gpus"] = self.config.gpus_per_node
        atexit.register(self.shutdown)
        self._started = True
        try:
            ray.init(**kwargs)
        except Exception as exc:
            self.shutdown()
            raise ClusterError(
                f"could not start a local Ray head: {exc}; see the logs in {self.temp_dir}"
            ) from exc
        # After ray.init, which installs its own SIGTERM handler that skips our clean-up.
        self._install_signal_handlers()
        self._link_logs()
        return ray_resources()

    def shutdown(self) -> None:
        """Stop the Ray head this object started (idempotent)."""
        if self._started:
            import ray

            self._started = False
            ray.shutdown()
        self._restore_handlers()

    # -- clean-up on every exit path ------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.shutdown)
        for signum, handler in self._previous_handlers.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous_handlers.get(signum)
        self.shutdown()
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signum, frame)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    def _link_logs(self) -> None:
        if self.log_dir is None:
            return
        link = self.log_dir / "ray"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(self.temp_dir, target_is_directory=True)
        except OSError:
            pass  # a missing log link must not stop a run; the logs stay in temp_dir


def _enable_token_auth_if_available() -> None:
    """Use Ray's token auth when a token is at hand, as ``ray start`` and ``ray.init()`` do.

    Ray 2.5x+ enables token auth on clusters started while a token exists (~/.ray/auth_token),
    but a driver joining with an explicit address stays in "disabled" mode and is refused
    unless ``RAY_AUTH_MODE`` is set; an explicit ``RAY_AUTH_MODE`` is always respected.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # older Ray without token auth
        return
    # Best effort: ray.init reports a refused connection with its own message.
    with contextlib.suppress(Exception):
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class RayCluster:
    """Joins a running Ray cluster at ``cluster.address`` or ``$RAY_ADDRESS``; never stops it."""

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.options, self.context = options, context
        self.config = _cluster_config(context)
        self._connected = False

    @property
    def address(self) -> str | None:
        return self.config.address or os.environ.get("RAY_ADDRESS") or None

    def start(self) -> ClusterResources:
        """Connect this process to the cluster and return its resources."""
        import ray

        from nrl_core.distributed.actor_env import check_image_manifest

        check_image_manifest()
        address = self.address
        if address is None:
            raise ClusterError(
                "cluster.backend=ray needs cluster.address or RAY_ADDRESS; start "
                "a cluster with `ray start --head` or use cluster.backend=local"
            )
        _enable_token_auth_if_available()
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as exc:
            raise ClusterError(
                f"cannot connect to the Ray cluster at {address}: {exc}; check "
                "that `ray status --address ADDRESS` works from this node"
            ) from exc
        self._connected = True
        return ray_resources()

    def shutdown(self) -> None:
        """Disconnect this process; the cluster keeps running."""
        if self._connected:
            import ray

            self._connected = False
            ray.shutdown()  # on a connected driver this only disconnects
