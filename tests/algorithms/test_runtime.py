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
    first.folder.lock()
    assert (tmp_path / "run" / RUN_LOCK).read_text().strip() == str(os.getpid())
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()}\)"):
        second.folder.lock()
    session(tmp_path, "other").folder.lock()  # another run folder is free
    first.close()
    second.folder.lock()  # released with the first run
    second.close()


def test_an_explicit_checkpoint_folder_is_locked_too(tmp_path):
    shared = str(tmp_path / "shared-ckpt")
    first = session(tmp_path, "a", checkpoint_dir=shared)
    first.folder.lock()
    with pytest.raises(ConfigError, match=r"shared-ckpt is in use by another run"):
        session(tmp_path, "b", checkpoint_dir=shared).folder.lock()
    first.close()


def test_resume_auto_refuses_a_checkpoint_of_another_algorithm_before_anything_starts(
    tmp_path, capsys
):
    import time

    from nrl_core.checkpoint import CHECKPOINT_CONFIG, CheckpointManager
    from nrl_core.cli import main

    run_dir = tmp_path / "run"

    def write(folder):
        (folder / CHECKPOINT_CONFIG).write_text("sft: {}\npolicy: {model_name: tiny}\n")

    CheckpointManager(run_dir / "checkpoints").save(3, write, {})
    start = time.monotonic()
    code = main(["run", "grpo", "-q", f"logger.log_dir={tmp_path}", "logger.run_name=run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "written by `nrl run sft`" in err and "checkpointing.resume=never" in err
    assert time.monotonic() - start < 10
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # nothing else written


def test_a_live_runs_checkpoints_are_not_verified_by_a_second_run(tmp_path, capsys):
    """Issue 47: a second run sharing a live run's checkpoint_dir read (and called damaged)
    the checkpoints being written, three warnings before its lock error; the lock comes first."""
    from nrl_core.checkpoint import TRAINER_STATE, CheckpointManager

    shared = tmp_path / "shared-ckpt"
    first = session(tmp_path, "a", checkpoint_dir=str(shared))
    first.folder.lock()
    for step in (1, 2, 3):  # half-written, as the live run would have them mid-save
        folder = CheckpointManager(shared).save(step, lambda f: None, {})
        (folder / TRAINER_STATE).write_text('{"step": ')
    second = session(tmp_path, "b", checkpoint_dir=str(shared))
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"shared-ckpt is in use by another run"):
        second.folder.find_resume_point()
    assert capsys.readouterr().err == ""  # no "damaged checkpoint" warning
    assert not (tmp_path / "b").exists()  # nothing created for the refused run
    first.close()
    second.folder.find_resume_point()  # free now: the damaged ones are named, none resumed
    assert "damaged" in capsys.readouterr().err and second.folder.resume_path is None
    second.close()
