"""User-facing errors of the distributed runtime (all :class:`~nrl_core.errors.NrlError`)."""

from __future__ import annotations

from nrl_core.errors import NrlError


class ClusterError(NrlError):
    """Ray could not be started or reached."""


class InsufficientResourcesError(NrlError):
    """A worker group asks for more CPUs or GPUs than the cluster has."""

    exit_code = 2


class WorkerError(NrlError):
    """A worker of a group raised, died, or could not start."""

    def __init__(
        self,
        message: str,
        *,
        group: str = "",
        rank: int | None = None,
        node: str | None = None,
        log_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.group, self.rank, self.node, self.log_tail = group, rank, node, log_tail

    def __reduce__(self):
        # Keeps the keyword-only attributes when the error crosses a process boundary.
        return (
            _rebuild_worker_error,
            (type(self), self.args[0], self.group, self.rank, self.node, self.log_tail),
        )


class WorkerTimeoutError(WorkerError):
    """A worker call did not finish within the group's timeout."""


class ActorEnvError(NrlError):
    """An actor virtualenv could not be built, or is broken."""


class ImageMismatchError(NrlError):
    """The container image was built from a different pyproject.toml/uv.lock than the checkout."""

    exit_code = 2


def _rebuild_worker_error(cls, message, group, rank, node, log_tail):
    return cls(message, group=group, rank=rank, node=node, log_tail=log_tail)
