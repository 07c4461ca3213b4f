"""The run's folders on disk: the lock that keeps a second run out, the resume point, and the
step checkpoints (what they hold, how a resumed run reads them back)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nrl_core.checkpoint import (
    CHECKPOINT_CONFIG,
    CRITIC_CHECKPOINT,
    POLICY_CHECKPOINT,
    TRAINER_STATE,
    CheckpointManager,
    check_same_run,
    read_state,
)
from nrl_core.config.loader import dump_config
from nrl_core.config.schema import RunConfig
from nrl_core.errors import ConfigError
from nrl_core.registry import Registry

RUN_LOCK = ".nrl.lock"
"""A live run holds an exclusive lock on this file of its run folder (it holds the pid), and
of its checkpoint folder when that lies elsewhere."""


class RunFolder:
    """The run folder (``logger.log_dir/logger.run_name``) and the checkpoint folder of one run.

    Args:
        config: the run config; registry: the plugins (a checkpoint holds the resolved config).
        algorithm: the algorithm running (a checkpoint of another one is not resumed).
        closers: the run's clean-up list (newest last), which the locks join.
    """

    def __init__(
        self,
        config: RunConfig,
        registry: Registry,
        *,
        algorithm: str,
        closers: list[Callable[[], None]],
    ) -> None:
        self.config = config
        self.registry = registry
        self.algorithm = algorithm
        self._closers = closers
        # Absolute in the driver: workers (other processes, possibly other nodes) write here.
        self.run_dir = Path(config.logger.log_dir).absolute() / config.logger.run_name
        checkpoint_dir = config.checkpointing.checkpoint_dir or self.run_dir / "checkpoints"
        self.checkpoints = CheckpointManager(
            Path(checkpoint_dir).absolute(),
            config.checkpointing.keep_last,
            metric=config.checkpointing.metric_name,
            higher_is_better=config.checkpointing.higher_is_better,
        )
        self.start_step = 0
        """The step the run continues from (0: a fresh run)."""
        self.resume_path: Path | None = None
        """The checkpoint the run continues from, if any."""
        self._locked: set[Path] = set()

    def lock(self, *, existing_only: bool = False) -> None:
        """Hold an exclusive lock on the run folder (and on the checkpoint folder when it lies
        outside) for the whole run: a second run on the same folder is refused in one line
        naming the holder, so two runs never prune or overwrite each other's checkpoints.

        With ``existing_only``, only the folders that already hold a lock file (a run has
        used them) are locked, creating nothing: what :meth:`find_resume_point` takes before
        reading checkpoints another live run may be writing. Locks already held are kept."""
        folders = [self.run_dir]
        if not self.checkpoints.root.is_relative_to(self.run_dir):
            folders.append(self.checkpoints.root)
        for folder in folders:
            if folder in self._locked or (existing_only and not (folder / RUN_LOCK).is_file()):
                continue
            handle = _hold_lock(folder)
            self._locked.add(folder)

            def release(handle: Any = handle, folder: Path = folder) -> None:
                handle.close()
                self._locked.discard(folder)

            self._closers.insert(0, release)

    def find_resume_point(self) -> None:
        """Pick the checkpoint to continue: the newest intact one for ``resume=auto`` (newer,
        damaged ones are named and skipped), only when it was written by this algorithm for
        this model."""
        ckpt = self.config.checkpointing
        if not ckpt.enabled:
            return
        # Before verifying: the checkpoints of a live run are being written and pruned, and
        # reading them would report them as damaged before the lock said whose they are.
        self.lock(existing_only=True)
        point = self.checkpoints.resume_from(ckpt.resume)
        for folder, problem in point.skipped:
            print(
                f"warning: checkpoint {folder} is damaged ({problem}); "
                + (
                    f"resuming from {point.path}"
                    if point.path
                    else "no older one is intact: starting fresh"
                ),
                file=sys.stderr,
            )
        if point.path is None:
            return
        check_same_run(point.path, self.algorithm, self.config.policy.model_name, ckpt.resume)
        self.resume_path = point.path
        self.start_step = read_state(point.path)["step"]

    @property
    def teacher_snapshot(self) -> Path:
        """Where a teacher trained by ``distill.teacher_warmup_steps`` is kept (beside the
        step checkpoints, so that a resumed run scores with the same teacher)."""
        return self.checkpoints.root / "teacher_after_warmup"

    def should_checkpoint(self, step: int, last: bool) -> bool:
        ckpt = self.config.checkpointing
        return ckpt.enabled and (last or (ckpt.save_period > 0 and step % ckpt.save_period == 0))

    def save_checkpoint(
        self,
        step: int,
        policy: Any,
        train_stream: Any,
        val: dict[str, float] | None = None,
        *,
        critic: Any = None,
    ) -> Path:
        """Save step ``step``: the policy's checkpoint (and the PPO ``critic``'s, with its
        optimizer, in :data:`CRITIC_CHECKPOINT`), the data stream's position, the random
        generators' states, the resolved config and ``val`` (the validation metrics of this
        step, which rank the checkpoints: ``checkpointing.metric_name``), as ``step_N`` of the
        checkpoint folder."""
        state: dict[str, Any] = {
            "data": train_stream.state() if train_stream else None,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state().tolist()},
        }
        if val:
            state["val"] = val

        def write(folder: Path) -> None:
            policy.save_checkpoint(str(folder / POLICY_CHECKPOINT))
            if critic is not None:
                critic.save_checkpoint(str(folder / CRITIC_CHECKPOINT))
            # A self-describing checkpoint: `nrl convert` rebuilds the policy from this copy.
            (folder / CHECKPOINT_CONFIG).write_text(dump_config(self.config, self.registry))

        return self.checkpoints.save(step, write, state)

    def restore(self, policy: Any, train_stream: Any, *, critic: Any = None) -> None:
        """Load the resume point into ``policy`` (and ``critic``), ``train_stream`` and the
        random generators."""
        state = read_state(self.resume_path)
        policy.load_checkpoint(str(self.resume_path / POLICY_CHECKPOINT))
        if critic is not None:
            if not (self.resume_path / CRITIC_CHECKPOINT).is_dir():
                raise ConfigError(
                    f"{self.resume_path} has no critic ({CRITIC_CHECKPOINT}/): it is not a PPO "
                    "checkpoint; resume from a PPO run's step_N, or checkpointing.resume=never"
                )
            critic.load_checkpoint(str(self.resume_path / CRITIC_CHECKPOINT))
        try:
            if state.get("data") and train_stream is not None:
                train_stream.load_state(state["data"])
            rng = state.get("rng") or {}
            if "python" in rng:
                version, internal, gauss = rng["python"]
                random.setstate((version, tuple(internal), gauss))
            if "torch" in rng:
                torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            # read_state checked the shapes; what is left is a state of another data setup.
            raise ConfigError(
                f"{self.resume_path / TRAINER_STATE} does not fit this run ({type(exc).__name__}: "
                f"{exc}); resume from another step_N, or checkpointing.resume=never"
            ) from None


def _hold_lock(folder: Path) -> Any:
    """An open handle holding an exclusive ``flock`` on ``folder``'s lock file, which holds
    this pid; closing the handle (or the process dying) releases it. A lock held by another
    process is a :class:`ConfigError` naming its pid."""
    import fcntl
    import os

    folder.mkdir(parents=True, exist_ok=True)
    handle = (folder / RUN_LOCK).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ConfigError(
            f"the folder {folder} is in use by another run (pid {holder}); give this run its "
            "own logger.run_name or logger.log_dir (and checkpointing.checkpoint_dir), or wait "
            "for that one"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
