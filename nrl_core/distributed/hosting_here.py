"""Whether this process hosts the run's workers itself (``cluster.backend=inprocess``).

A tiny module below :mod:`~nrl_core.distributed.actor_env` and
:mod:`~nrl_core.distributed.worker_group`: both ask it where a component runs, and neither
imports the in-process cluster (:mod:`~nrl_core.distributed.inprocess`, which builds on them).
"""

from __future__ import annotations

from typing import Any, Protocol


class HostingCluster(Protocol):
    """A cluster that builds worker groups in this process (the in-process cluster)."""

    def start_worker_group(self, target: str, num_workers: int, *args: Any, **kwargs: Any) -> Any:
        """What ``WorkerGroup.start`` returns while this cluster is active."""
        ...


_ACTIVE: HostingCluster | None = None


def active() -> HostingCluster | None:
    """The cluster hosting this run's workers in this process, or None (Ray, or no run)."""
    return _ACTIVE


def set_active(cluster: HostingCluster | None) -> None:
    """Record (or, with None, forget) the cluster that hosts the workers in this process."""
    global _ACTIVE
    _ACTIVE = cluster
