"""User-facing errors of the distributed runtime (all :class:`~nrl_core.errors.NrlError`)."""

from __future__ import annotations

from nrl_core.errors import NrlError


class ClusterError(NrlError):
    """Ray could not be started or reached."""


class InsufficientResourcesError(NrlError):
    """A worker group asks for more CPUs or GPUs than the cluster has."""

    exit_code = 2


class WorkerError(NrlError):
    """A worker of a group raised, died, or could not start.

    ``str()`` is one line: the group, the rank, what failed, and where the full story is (the
    run log, or the worker's Ray log outside a run). The detail stays on the error.

    Attributes:
        group: the worker group's name (``policy``, ``env-<name>``, ``generation-<backend>``).
        rank: the failing rank (the first one, when several did not finish in time).
        node: the node IP of that rank, when known.
        log_tail: the last lines of the rank's Ray worker log (stdout/stderr).
        remote_traceback: the traceback the worker raised, as text ("" when it died instead).
        log_file: the file holding the full detail: the run log (``<run dir>/nrl.log``) when
            a run is open, else the worker's Ray log; None when neither is known.
        exit_code: 1, or the exit code of the worker's own nrl error (2 for a
            :class:`~nrl_core.errors.ConfigError` raised by a component: bad user input).
    """

    def __init__(
        self,
        message: str,
        *,
        group: str = "",
        rank: int | None = None,
        node: str | None = None,
        log_tail: str = "",
        remote_traceback: str = "",
        log_file: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.group, self.rank, self.node, self.log_tail = group, rank, node, log_tail
        self.remote_traceback, self.log_file = remote_traceback, log_file
        if exit_code is not None:
            self.exit_code = exit_code

    def __reduce__(self):
        # Keeps the keyword-only attributes when the error crosses a process boundary.
        return (
            _rebuild_worker_error,
            (
                type(self),
                self.args[0],
                {
                    "group": self.group,
                    "rank": self.rank,
                    "node": self.node,
                    "log_tail": self.log_tail,
                    "remote_traceback": self.remote_traceback,
                    "log_file": self.log_file,
                    "exit_code": self.exit_code,
                },
            ),
        )


class WorkerTimeoutError(WorkerError):
    """A worker call did not finish within the group's timeout."""


class ActorEnvError(NrlError):
    """An actor virtualenv could not be built, or is broken."""


class BuildToolMissingError(ActorEnvError):
    """An actor virtualenv needs a tool this machine lacks to build a package (nvcc)."""

    exit_code = 2


class ImageMismatchError(NrlError):
    """The container image was built from a different pyproject.toml/uv.lock than the checkout."""

    exit_code = 2


def _rebuild_worker_error(cls, message, attributes):
    return cls(message, **attributes)


class EngineReplacedError(NrlError):
    """A generate call failed because a generation engine died, and a new engine was started
    in its place (``grpo.async.replace_dead_engines``): the call's prompts are to be generated
    again once the engines are refitted (their ``holds_weights`` is False until then)."""
