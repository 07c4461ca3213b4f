"""Step checkpoints: a manifest written last, verification, fallback to the newest intact one,
refusing another run's checkpoint, and atomic replacement of a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nrl_core.checkpoint import (
    CHECKPOINT_CONFIG,
    MANIFEST,
    TRAINER_STATE,
    CheckpointManager,
    check_same_run,
    find_step_folder,
    read_state,
    verify,
)
from nrl_core.errors import ConfigError


def writer(payload: bytes, config: str = "grpo: {}\npolicy: {model_name: tiny}\n"):
    def write(folder: Path) -> None:
        (folder / "policy").mkdir()
        (folder / "policy" / "shard.bin").write_bytes(payload)
        (folder / CHECKPOINT_CONFIG).write_text(config)

    return write


def saved(tmp_path: Path, *steps: int, keep_last: int | None = None) -> CheckpointManager:
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=keep_last)
    for step in steps:
        manager.save(step, writer(bytes(range(256)) * (step + 1)), {"data": None})
    return manager


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_size_and_hash(tmp_path):
    step = saved(tmp_path, 2).latest()
    manifest = json.loads((step / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [CHECKPOINT_CONFIG, "policy/shard.bin", TRAINER_STATE]
    assert manifest["files"]["policy/shard.bin"]["size"] == 3 * 256
    assert len(manifest["files"]["policy/shard.bin"]["sha256"]) == 64
    assert verify(step) is None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (flip_byte, "policy/shard.bin does not match its SHA-256"),
        (lambda p: p.write_bytes(p.read_bytes()[:10]), "policy/shard.bin has 10 bytes"),
        (Path.unlink, "policy/shard.bin is missing"),
    ],
)
def test_verify_names_the_damaged_file(tmp_path, damage, problem):
    step = saved(tmp_path, 2).latest()
    damage(step / "policy" / "shard.bin")
    assert problem in verify(step)


def test_a_corrupt_trainer_state_is_a_problem_not_a_traceback(tmp_path):
    step = saved(tmp_path, 2).latest()
    (step / MANIFEST).unlink()  # an older checkpoint: only the trainer state is checked
    (step / TRAINER_STATE).write_text('{"step": 2, "da')
    assert "is not valid JSON" in verify(step)
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_state(step)
    (step / TRAINER_STATE).write_text("[1, 2]")
    assert "holds no integer `step`" in verify(step)


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    manager = saved(tmp_path, 2, 4, 6)
    flip_byte(manager.root / "step_6" / "policy" / "shard.bin")
    (manager.root / "step_4" / TRAINER_STATE).write_text("{")
    point = manager.resume_from("auto")
    assert point.path == manager.root / "step_2"
    assert [folder.name for folder, _ in point.skipped] == ["step_6", "step_4"]
    # nrl convert / eval on the checkpoint folder take the same one.
    assert find_step_folder(manager.root) == manager.root / "step_2"


def test_an_explicit_damaged_checkpoint_is_refused_in_one_line(tmp_path):
    manager = saved(tmp_path, 2)
    flip_byte(manager.root / "step_2" / "policy" / "shard.bin")
    with pytest.raises(ConfigError, match=r"is damaged: policy/shard.bin does not match") as err:
        manager.resume_from(str(manager.root / "step_2"))
    assert "\n" not in str(err.value)
    # nrl convert / eval given that step folder.
    with pytest.raises(ConfigError, match=r"step_2 is damaged: policy/shard.bin does not match"):
        find_step_folder(manager.root / "step_2" / "policy")


def test_the_critic_folder_of_a_ppo_checkpoint_is_refused_in_one_line(tmp_path):
    # nrl convert / eval read a policy; a critic's value head is none (issue 49).
    manager = saved(tmp_path, 2)
    critic = manager.root / "step_2" / "critic"
    critic.mkdir()
    with pytest.raises(ConfigError, match=r"critic is a PPO critic \(a value head") as err:
        find_step_folder(critic)
    assert "\n" not in str(err.value) and str(err.value).endswith(
        f"pass {manager.root / 'step_2'} for the policy"
    )
    assert find_step_folder(manager.root / "step_2") == manager.root / "step_2"


def test_a_checkpoint_of_another_algorithm_or_model_is_not_continued(tmp_path):
    step = saved(tmp_path, 2).latest()
    check_same_run(step, "grpo", "tiny")
    with pytest.raises(
        ConfigError, match=r"written by `nrl run grpo`.*`nrl run sft`.*resume=never"
    ):
        check_same_run(step, "sft", "tiny")
    with pytest.raises(
        ConfigError, match=r"policy.model_name=tiny, but .*model_name=/models/other"
    ):
        check_same_run(step, "grpo", "/models/other")


def test_replacing_a_step_keeps_the_old_one_when_the_new_write_fails(tmp_path):
    manager = saved(tmp_path, 2)
    before = (manager.root / "step_2" / "policy" / "shard.bin").read_bytes()

    def broken(folder: Path) -> None:
        (folder / "policy").mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, broken, {})
    assert (manager.root / "step_2" / "policy" / "shard.bin").read_bytes() == before
    assert verify(manager.root / "step_2") is None
    assert [p.name for p in manager.root.iterdir()] == ["step_2"]  # no temporary left behind

    manager.save(2, writer(b"new"), {})
    assert (manager.root / "step_2" / "policy" / "shard.bin").read_bytes() == b"new"
    assert [p.name for p in manager.root.iterdir()] == ["step_2"]


def test_keep_last_prunes_the_oldest(tmp_path):
    manager = saved(tmp_path, 1, 2, 3, keep_last=2)
    assert [p.name for p in manager.complete()] == ["step_2", "step_3"]


def test_a_saved_config_is_data_and_names_no_interpreter_cluster_or_other_file(tmp_path):
    """Issue 40: what runs is never chosen by a checkpoint. Every `actor_env` of its saved
    config, and its cluster, logger and checkpointing sections, are dropped (this machine's
    defaults apply); a `defaults:` entry (another file to read) is refused in one line."""
    from nrl_core.algorithms.evaluate import resolve_eval_config, with_checkpoint_policy
    from nrl_core.checkpoint import saved_config
    from nrl_core.config.loader import dump_config, resolve_config
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    overrides = [
        "policy.actor_env=/ckpt/python",
        "generation.actor_env=/ckpt/python",
        "env.actor_env=/ckpt/python",
        "cluster.actor_env=/ckpt/python",
        "cluster.backend=ray",
        "cluster.address=10.0.0.1:6379",
        "logger.log_dir=/elsewhere",
    ]
    planted = dump_config(resolve_config("grpo", None, overrides, registry), registry)
    manager = CheckpointManager(tmp_path / "ckpt")

    def write(folder: Path) -> None:
        writer(b"weights", planted)(folder)
        (folder / "policy" / ".metadata").write_bytes(b"")  # a dtensor checkpoint's marker

    step = manager.save(4, write, {})

    algorithm, config = saved_config(step, registry)
    assert algorithm == "grpo"
    for section in ("policy", "generation", "env", "agent", "data", "cluster"):
        assert getattr(config, section).actor_env is None, section
    assert (config.cluster.backend, config.cluster.address) == ("auto", None)  # the default
    assert config.logger.log_dir != "/elsewhere"
    assert config.policy.model_name == resolve_config("grpo").policy.model_name  # the model: kept

    # nrl eval takes only the model from it (already so before issue 40: pinned here).
    evaluated = with_checkpoint_policy(resolve_eval_config(None, [], registry), step, registry)
    assert evaluated.policy.actor_env is None and evaluated.cluster.actor_env is None

    with_defaults = manager.save(5, writer(b"weights", "defaults: /etc/other.yaml\n" + planted), {})
    with pytest.raises(ConfigError, match=r"names `defaults:`.*--config") as err:
        saved_config(with_defaults, registry)
    assert "\n" not in str(err.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
def test_a_checkpoint_with_nan_weights_fails_verification_and_is_skipped(tmp_path):
    """Issue 40: an all-NaN step passed the manifest check; resume picked it and `nrl convert`
    exported it. Verification now reads the weights: the NaN step is damaged, the intact one
    before it is taken."""
    import torch
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.checkpoint import POLICY_CHECKPOINT
    from nrl_core.config.loader import resolve_config
    from nrl_core.interfaces import ComponentContext
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    config = resolve_config("sft", None, [], registry, defaults=default_recipe("sft"))
    worker = DTensorPolicyWorker(config.policy.options_for(), ComponentContext(config, seed=1))
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, lambda f: worker.save_checkpoint(str(f / POLICY_CHECKPOINT)), {})
    with torch.no_grad():
        next(iter(worker.model.parameters())).view(-1)[3] = float("nan")
    nan_step = manager.save(2, lambda f: worker.save_checkpoint(str(f / POLICY_CHECKPOINT)), {})

    problem = verify(nan_step)
    assert problem is not None and "non-finite values (NaN or infinity in model." in problem
    point = manager.newest_good()
    assert point.path == manager.root / "step_1" and point.skipped[0][0] == nan_step
    with pytest.raises(ConfigError, match=r"step_2 is damaged: policy/ holds non-finite"):
        find_step_folder(nan_step)


def test_a_checkpoint_whose_manifest_was_deleted_is_used_with_one_warning(tmp_path, capsys):
    """Issue 47: deleting manifest.json turned verification off in silence."""
    manager = saved(tmp_path, 2, 4)
    step = manager.root / "step_4"
    (step / MANIFEST).unlink()
    capsys.readouterr()
    assert manager.resume_from("auto").path == step
    assert find_step_folder(manager.root) == step  # again (nrl convert): no second warning
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"warning: checkpoint {step} has no {MANIFEST}")
    assert "unverified" in err
    # An intact checkpoint, with its manifest, is used without a word.
    assert manager.resume_from(str(manager.root / "step_2")).path == manager.root / "step_2"
    assert capsys.readouterr().err == ""


def test_a_trainer_state_with_unknown_keys_or_over_the_limit_is_refused(tmp_path):
    """Issue 47: a 330 MB trainer_state.json with keys nrl never writes was accepted."""
    from nrl_core.checkpoint import MAX_TRAINER_STATE_BYTES

    step = saved(tmp_path, 2).latest()
    state = json.loads((step / TRAINER_STATE).read_text())
    (step / TRAINER_STATE).write_text(json.dumps({**state, "extra": 1}))
    with pytest.raises(ConfigError, match=r"unknown key 'extra' \(a trainer state holds data"):
        read_state(step)
    (step / TRAINER_STATE).write_text(json.dumps({**state, "rng": {"numpy": [1]}}))
    with pytest.raises(ConfigError, match=r"unknown key 'rng\.numpy'"):
        read_state(step)
    (step / TRAINER_STATE).write_text(json.dumps(state))
    with (step / TRAINER_STATE).open("r+b") as handle:
        handle.truncate(MAX_TRAINER_STATE_BYTES + 1)  # sparse; refused by its size alone
    with pytest.raises(ConfigError, match=r"is 4 MiB, over the 4 MiB a trainer state may be"):
        read_state(step)
    assert MAX_TRAINER_STATE_BYTES == 4 << 20  # the limit docs/checkpoints.md gives


def test_the_best_checkpoint_by_metric_survives_pruning_and_is_what_eval_takes(tmp_path, capsys):
    """Issue 53: a run whose validation peaked before its end kept only its newest
    checkpoints, and `nrl eval` of the folder took the newest. The best by
    ``checkpointing.metric_name`` now survives ``keep_last`` and is what a checkpoint folder
    means to `nrl eval`; a damaged best falls back to the newest intact one."""
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2, metric="val/accuracy")
    accuracy = {1: 0.5, 2: 0.9, 3: None, 4: 0.6, 5: 0.65, 6: 0.9, 7: 0.7}
    for step, value in accuracy.items():
        state = {"data": None} | ({"val": {"val/accuracy": value}} if value else {})
        manager.save(step, writer(bytes([step]) * 64), state)
        if step == 5:
            # step_2 is the best so far, older than the newest two, and kept.
            assert [p.name for p in manager.complete()] == ["step_2", "step_4", "step_5"]
    # The newest of equals (0.9 at steps 2 and 6) is the best; step_2 now goes.
    assert [p.name for p in manager.complete()] == ["step_6", "step_7"]
    assert manager.best() == (manager.root / "step_6", 0.9)
    assert find_step_folder(manager.root, "val/accuracy") == manager.root / "step_6"
    assert "step_6: the best val/accuracy (0.9)" in capsys.readouterr().err
    assert find_step_folder(manager.root) == manager.root / "step_7"  # no metric: the newest
    lower = CheckpointManager(manager.root, metric="val/accuracy", higher_is_better=False)
    assert lower.best() == (manager.root / "step_7", 0.7)
    flip_byte(manager.root / "step_6" / "policy" / "shard.bin")
    assert find_step_folder(manager.root, "val/accuracy") == manager.root / "step_7"


def test_a_trainer_state_whose_val_is_not_finite_numbers_is_refused(tmp_path):
    manager = saved(tmp_path, 1)
    path = manager.latest() / TRAINER_STATE
    for val in ({"val/accuracy": "0.9"}, {"val/accuracy": True}, ["val/accuracy"]):
        path.write_text(json.dumps({"step": 1, "val": val}))
        with pytest.raises(ConfigError, match="`val` must map validation metric names"):
            read_state(manager.latest())
    path.write_text('{"step": 1, "val": {"val/accuracy": NaN}}')
    with pytest.raises(ConfigError, match="`val` must map"):
        read_state(manager.latest())
