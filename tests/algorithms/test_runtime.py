"""The run session's folders: checkpoints inside the run folder, one live run per folder."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from nrl_core.algorithms.runtime import RUN_LOCK, RunSession
from nrl_core.config.schema import CheckpointingConfig, GRPOConfig, LoggerConfig
from nrl_core.errors import ConfigError


def session(tmp_path, run_name="run", **checkpointing) -> RunSession:
    config = GRPOConfig(
        logger=LoggerConfig(log_dir=str(tmp_path), run_name=run_name),
        checkpointing=CheckpointingConfig(**checkpointing),
    )
    return RunSession(config, None, algorithm="grpo", console=Console(quiet=True))


def test_checkpoints_default_to_the_run_folder(tmp_path):
    assert session(tmp_path, "a").checkpoints.root == tmp_path / "a" / "checkpoints"
    assert session(tmp_path, "b").checkpoints.root == tmp_path / "b" / "checkpoints"
    explicit = session(tmp_path, checkpoint_dir=str(tmp_path / "elsewhere"))
    assert explicit.checkpoints.root == tmp_path / "elsewhere"


def test_a_live_run_folder_is_refused_to_a_second_run(tmp_path):
    first, second = session(tmp_path), session(tmp_path)
    first._lock_run_dir()
    assert (tmp_path / "run" / RUN_LOCK).read_text().strip() == str(os.getpid())
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()}\)"):
        second._lock_run_dir()
    session(tmp_path, "other")._lock_run_dir()  # another run folder is free
    first.close()
    second._lock_run_dir()  # released with the first run
    second.close()
