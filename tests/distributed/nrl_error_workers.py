"""Workers and environments that fail on purpose, for the worker-error tests.

Imported inside Ray actors from their target strings (this folder is on the actors'
``PYTHONPATH``, see the ``worker_env`` fixture), as a plugin's classes would be.
"""

from __future__ import annotations

import json
import os
import time

from nrl_core.errors import ConfigError


class FailingWorker:
    """Raises a multi-line ``ValueError``, or a ``ConfigError`` (bad user input), on one rank."""

    def __init__(self, *args, **kwargs):
        self.rank = int(os.environ["RANK"])

    def crash(self, rank_to_fail: int) -> int:
        if self.rank == rank_to_fail:
            print(f"rank {self.rank} is about to crash", flush=True)
            raise ValueError(f"bad batch on rank {self.rank}\nsecond line of the message")
        return self.rank

    def bad_input(self) -> None:
        raise ConfigError("policy.lr must be > 0; set policy.optimizer.lr=1e-5")

    def pid(self) -> int:
        return os.getpid()


HANG_MARKER_VAR = "NRL_TEST_HANG_MARKER"
"""Where :class:`HangingEnvironment` writes its pid and the time its step started."""


class HangingEnvironment:
    """An environment whose ``step`` never returns (it sleeps for ``seconds``)."""

    def __init__(self, options=None, context=None, seconds: float = 600):
        self.seconds = seconds

    def step(self, conversations, metadata):
        print("hanging step started", flush=True)
        marker = os.environ.get(HANG_MARKER_VAR)
        if marker:
            with open(marker, "w") as handle:
                json.dump({"pid": os.getpid(), "started": time.time()}, handle)
        time.sleep(self.seconds)
        return []


class BrokenMetricsEnvironment:
    """Scores every sample 0, then raises in ``metrics`` (a call the per-sample shield of
    ``step`` does not cover): a worker error that ends the run."""

    def __init__(self, options=None, context=None):
        pass

    def step(self, conversations, metadata):
        from nrl_core.interfaces import EnvStep

        return [EnvStep(reward=0.0, terminated=True) for _ in conversations]

    def metrics(self, batch):
        raise ValueError("metrics table is corrupt\nsee the second line")


class MisconfiguredEnvironment:
    """An environment whose ``step`` reports bad user input (a ``ConfigError``)."""

    def __init__(self, options=None, context=None):
        pass

    def step(self, conversations, metadata):
        raise ConfigError("env.reference_file is missing; set it to a JSONL file")
