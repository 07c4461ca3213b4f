"""Atomic step checkpoints and resume.

``<checkpoint_dir>/step_N/`` is written under a temporary name and renamed when complete, so a
crash never leaves a half checkpoint that resume could pick. A folder counts as complete when it
holds ``trainer_state.json``, which is written last.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nrl_core.errors import ConfigError

STEP_PATTERN = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"


def step_of(path: Path) -> int | None:
    match = STEP_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Writes, finds and prunes the step checkpoints of one run.

    Args:
        root: ``checkpointing.checkpoint_dir``.
        keep_last: keep only the newest N complete checkpoints (None keeps all).
    """

    def __init__(self, root: str | Path, keep_last: int | None = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if step_of(p) is not None and (p / TRAINER_STATE).is_file()
        ]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def latest(self) -> Path | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def resume_from(self, resume: str) -> Path | None:
        """The checkpoint ``checkpointing.resume`` asks for: ``auto`` (newest, or none),
        ``never``, or a path to a ``step_N`` folder."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / TRAINER_STATE).is_file():
            raise ConfigError(
                f"checkpointing.resume={resume}: not a complete nrl checkpoint "
                f"(no {TRAINER_STATE}); use auto, never or a step_N folder"
            )
        return path

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: ``write(folder)`` fills it, then the trainer state is
        written and the folder renamed into place. Returns the final folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp_step_{step}_{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, **state}, indent=2))
            final = self.root / f"step_{step}"
            if final.exists():  # an older attempt at this step (e.g. before a crash)
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        for stale in self.root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last is None:
            return
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        return json.loads((path / TRAINER_STATE).read_text())
