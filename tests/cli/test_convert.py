"""`nrl convert`: a checkpoint written by `nrl run` becomes a Hugging Face folder whose
`from_pretrained` model gives the policy's own logprobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nrl_core.checkpoint import find_step_folder
from nrl_core.cli import build_parser
from nrl_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_convert_parses_the_documented_command_line():
    args = build_parser().parse_args(["convert", "ckpt/step_4", "--to", "hf", "out"])
    assert (args.checkpoint, args.to, args.out) == ("ckpt/step_4", "hf", "out")


def test_a_folder_without_checkpoint_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="not an nrl checkpoint"):
        find_step_folder(tmp_path)


# Prints the programs started while converting (Ray starts gcs_server, raylet and its
# workers; torch may ask ldconfig where its libraries are).
_CONVERT_AND_LIST_SPAWNED = """
import json, sys
spawned = []
events = ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork")
sys.addaudithook(lambda event, args: spawned.append(str(args[0])) if event in events else None)
from nrl_core.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "spawned": spawned}))
"""


def _convert_in_subprocess(*args: str) -> list[str]:
    """Run `nrl convert ARGS -q` in a fresh interpreter; the programs it started."""
    import json

    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    argv = [sys.executable, "-c", _CONVERT_AND_LIST_SPAWNED, "convert", *args, "-q"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    return [p for p in result["spawned"] if Path(p).name != "ldconfig"]


def _assert_same_folder(ours: Path, theirs: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (ours / name).read_text() == (theirs / name).read_text(), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_dtensor_checkpoint_converts_in_process_to_the_policys_own_export(lora_rank, tmp_path):
    """A dtensor checkpoint is converted by one worker in the `nrl convert` process, without
    Ray (no program is started), into the folder the policy itself exports."""
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.checkpoint import CHECKPOINT_CONFIG, POLICY_CHECKPOINT, CheckpointManager
    from nrl_core.config.loader import dump_config, resolve_config
    from nrl_core.interfaces import ComponentContext
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    overrides = [f"policy.dtensor.lora_rank={lora_rank}"]
    config = resolve_config("sft", None, overrides, registry, defaults=default_recipe("sft"))
    worker = DTensorPolicyWorker(config.policy.options_for(), ComponentContext(config, seed=1))
    with torch.no_grad():  # weights unlike the initial ones (the adapters' too)
        generator = torch.Generator().manual_seed(0)
        for param in worker.model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)

    def write(folder: Path) -> None:
        worker.save_checkpoint(str(folder / POLICY_CHECKPOINT))
        (folder / CHECKPOINT_CONFIG).write_text(dump_config(config, registry))

    CheckpointManager(tmp_path / "ckpt").save(3, write, {})
    worker.export_hf(str(tmp_path / "expected"))

    spawned = _convert_in_subprocess(str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"))
    assert spawned == []
    _assert_same_folder(tmp_path / "hf", tmp_path / "expected")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
@pytest.mark.parametrize("algorithm", ["sft", pytest.param("rm", marks=pytest.mark.slow)])
def test_lora_adapters_convert_to_a_peft_folder_with_the_policys_logits(
    algorithm, tmp_path, capsys
):
    """Issue 52: `nrl convert CKPT OUT --lora adapters` writes the adapters alone as a PEFT
    folder (safetensors, no pickle) that `PeftModel.from_pretrained(base, OUT)` loads with the
    policy's own logits (a reward model's: its score head, trained whole, travels with the
    adapters). The default (`merged`): test_dtensor_checkpoint_converts_in_process_to_the_policys_own_export."""
    import json

    from nrl_dtensor.worker import DTensorPolicyWorker
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.checkpoint import CHECKPOINT_CONFIG, POLICY_CHECKPOINT, CheckpointManager
    from nrl_core.config.loader import dump_config, resolve_config
    from nrl_core.interfaces import ComponentContext
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    overrides = ["policy.dtensor.lora_rank=4", "policy.dtensor.lora_alpha=8"]
    defaults = default_recipe(algorithm)
    config = resolve_config(algorithm, None, overrides, registry, defaults=defaults)
    worker = DTensorPolicyWorker(config.policy.options_for(), ComponentContext(config, seed=1))
    with torch.no_grad():  # trained-looking adapters: lora_B starts at zero
        generator = torch.Generator().manual_seed(0)
        for param in worker.model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)

    def write(folder: Path) -> None:
        worker.save_checkpoint(str(folder / POLICY_CHECKPOINT))
        (folder / CHECKPOINT_CONFIG).write_text(dump_config(config, registry))

    CheckpointManager(tmp_path / "ckpt").save(3, write, {})
    out = tmp_path / "adapters"
    rc, err = _convert(capsys, str(tmp_path / "ckpt"), str(out), "--lora", "adapters")
    assert rc == 0, err[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    settings = json.loads((out / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["peft_type"]) == (4, 8.0, "LORA")
    assert settings["base_model_name_or_path"] == worker.model_path
    assert settings["task_type"] == ("SEQ_CLS" if algorithm == "rm" else "CAUSAL_LM")

    input_ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    worker.model.eval()
    with torch.no_grad():
        ours = worker.model(input_ids=input_ids).logits
        if algorithm == "rm":
            base = AutoModelForSequenceClassification.from_pretrained(
                worker.model_path, num_labels=1, pad_token_id=worker.hf_config.pad_token_id
            )
        else:
            base = AutoModelForCausalLM.from_pretrained(worker.model_path)
        plain = base(input_ids=input_ids).logits
        theirs = PeftModel.from_pretrained(base, str(out)).eval()(input_ids=input_ids).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters change the logits...
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)  # ...and load exactly


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lora_adapters_of_a_policy_without_lora_is_one_line_exit_2(sft_step, tmp_path, capsys):
    rc, err = _convert(capsys, str(sft_step), str(tmp_path / "out"), "--lora", "adapters")
    _assert_one_error_line(rc, err, "--lora adapters: ")
    assert "policy.dtensor.lora_rank is 0" in err and "drop --lora" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sft_checkpoint_round_trip_gives_identical_logits(tmp_path):
    from nrl_dtensor.worker import DTensorPolicyWorker
    from transformers import AutoModelForCausalLM

    from nrl_core.chat_data import ChatDataConfig, ChatDataset, encode_conversation
    from nrl_core.checkpoint import saved_config
    from nrl_core.interfaces import ComponentContext
    from nrl_core.plugins import PluginHost

    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    nrl = [sys.executable, "-m", "nrl_core.cli"]
    config = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"
    # Two policy ranks (FSDP2 over gloo) write a sharded checkpoint.
    run = [*nrl, "run", "sft", "--config", str(config), "-q", f"logger.log_dir={tmp_path}"]
    run += [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "sft.max_num_steps=3"]
    run += ["sft.val_period=0", "policy.num_workers=2", "cluster.num_cpus=2"]
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # Converted in this process (the default), and by two policy ranks on Ray as trained:
    # the same folder.
    out = tmp_path / "hf"
    assert _convert_in_subprocess(str(tmp_path / "ckpt"), "--to", "hf", str(out)) == []
    on_ray = tmp_path / "hf-ray"
    ckpt = str(tmp_path / "ckpt")
    spawned = _convert_in_subprocess(ckpt, "--to", "hf", str(on_ray), "--num-workers", "2")
    assert any(Path(p).name == "raylet" for p in spawned)
    _assert_same_folder(out, on_ray)

    # The policy's logprobs: a fresh worker (single process) loading the same checkpoint.
    step = tmp_path / "ckpt" / "step_3"
    registry = PluginHost.discover().registry()
    algorithm, saved = saved_config(step, registry, None)
    assert algorithm == "sft"
    worker = DTensorPolicyWorker(saved.policy.options_for(), ComponentContext(config=saved))
    worker.load_checkpoint(str(step / "policy"))
    sample = ChatDataset(ChatDataConfig(path="nrl://recipes/data/chat_train.jsonl"), None)
    ids, _ = encode_conversation(worker.tokenizer, sample.load("train")[0].messages)
    input_ids = torch.tensor([ids])
    from nrl_core.data import Batch
    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.policy import Policy

    batch = Batch({"input_ids": input_ids, "lengths": torch.tensor([len(ids)])})
    ours = Policy.from_config(InProcessGroup(worker), saved.policy).get_logprobs(batch)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    theirs = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(theirs, ours[:, 1:], rtol=1e-5, atol=1e-5)
    # The export holds the trained weights, not the initial ones.
    initial = AutoModelForCausalLM.from_pretrained(worker.model_path)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(model.state_dict()[name], initial.state_dict()[name])


def _sft_checkpoint(folder: Path) -> Path:
    """A real dtensor checkpoint of the tiny model (the sft recipe) saved as step 2 under
    ``folder``; returns the step folder."""
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.checkpoint import CHECKPOINT_CONFIG, POLICY_CHECKPOINT, CheckpointManager
    from nrl_core.config.loader import dump_config, resolve_config
    from nrl_core.interfaces import ComponentContext
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    config = resolve_config("sft", None, [], registry, defaults=default_recipe("sft"))
    worker = DTensorPolicyWorker(config.policy.options_for(), ComponentContext(config, seed=1))

    def write(step: Path) -> None:
        worker.save_checkpoint(str(step / POLICY_CHECKPOINT))
        (step / CHECKPOINT_CONFIG).write_text(dump_config(config, registry))

    return CheckpointManager(folder).save(2, write, {})


def _planted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A real dtensor checkpoint whose saved config names a script inside it as
    `policy.actor_env` (and as `cluster.actor_env`), its manifest rewritten to match: what a
    checkpoint handed over by someone else may hold. Returns (step folder, marker file the
    script would create)."""
    import yaml

    from nrl_core.checkpoint import CHECKPOINT_CONFIG, write_manifest

    step = _sft_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    script = step / "python"
    script.write_text(f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    raw = yaml.safe_load((step / CHECKPOINT_CONFIG).read_text())
    raw["policy"]["actor_env"] = str(script)
    raw["cluster"]["actor_env"] = str(script)
    (step / CHECKPOINT_CONFIG).write_text(yaml.safe_dump(raw))
    write_manifest(step)
    return step, marker


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
def test_a_checkpoints_config_never_names_the_interpreter_convert_runs(tmp_path):
    """Issue 40: `nrl convert STEP OUT --num-workers 1` ran the script a checkpoint's
    config.yaml named as `policy.actor_env`. The saved config is data: the policy starts
    with this machine's interpreter, and one stderr line says what was ignored."""
    step, marker = _planted_checkpoint(tmp_path)
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    argv = [sys.executable, "-m", "nrl_core.cli", "convert", str(step), str(tmp_path / "hf")]
    argv += ["--num-workers", "1", "-q"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not marker.exists()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    notes = [line for line in done.stderr.splitlines() if line.startswith("warning: ignoring")]
    assert len(notes) == 1, done.stderr[-3000:]
    assert f"policy.actor_env={step / 'python'}" in notes[0]
    assert "cluster.actor_env" in notes[0] and "NRL_ACTOR_ENV" in notes[0]


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the shape of every pickle exploit."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
def test_a_pickle_planted_in_the_rank_state_is_one_line_exit_2(tmp_path, capsys):
    """Issue 40: `nrl convert` of a checkpoint whose `extra_rank0.pt` holds a pickle that
    runs code (manifest rewritten to match) blocked it but printed torch's multi-line
    UnpicklingError as a traceback. Now: one line naming the file and the global, exit 2."""
    import yaml

    from nrl_core.checkpoint import CHECKPOINT_CONFIG, POLICY_CHECKPOINT, write_manifest
    from nrl_core.cli import main

    step, _ = _planted_checkpoint(tmp_path)
    raw = yaml.safe_load((step / CHECKPOINT_CONFIG).read_text())
    raw["policy"].pop("actor_env")  # only the planted pickle: no warning line about these
    raw["cluster"].pop("actor_env")
    (step / CHECKPOINT_CONFIG).write_text(yaml.safe_dump(raw))
    marker = tmp_path / "PWNED"
    extra = step / POLICY_CHECKPOINT / "extra_rank0.pt"
    torch.save({"scheduler": _RunsCode(str(marker)), "rng": {}}, extra)
    write_manifest(step)
    capsys.readouterr()
    rc = main(["convert", str(step), str(tmp_path / "hf")])
    _, err = capsys.readouterr()
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert str(extra) in err and "io.open" in err, err


# -- OUT_DIR: never the user's files (issue 47) ------------------------------------------------


@pytest.fixture(scope="module")
def sft_step(tmp_path_factory) -> Path:
    """A real dtensor checkpoint of the tiny model (the sft recipe), converted in-process."""
    return _sft_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt")


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (links not followed): a file's bytes, a link's target, or
    "dir"."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = path.read_bytes()
    return found


def _user_folder(folder: Path) -> Path:
    """A folder of the user's own: a file, a stale config.json, a subfolder with a file."""
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    (folder / "config.json").write_text('{"stale": true}\n')
    (folder / "sub" / "keep.bin").write_bytes(os.urandom(64))
    return folder


def _convert(capsys, *argv: str) -> tuple[int, str]:
    from nrl_core.cli import main

    capsys.readouterr()
    rc = main(["convert", *argv])
    return rc, capsys.readouterr().err


def _assert_one_error_line(rc: int, err: str, text: str) -> None:
    assert rc == 2, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], err[-3000:]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_into_a_non_empty_folder_changes_nothing_and_exits_2(sft_step, tmp_path, capsys):
    """Issue 47: `nrl convert STEP OUT` replaced a non-empty OUT whole (its other files and
    subfolders gone) and exited 0. Now: one line, exit 2, every file there byte-identical."""
    out = _user_folder(tmp_path / "out")
    before = _snapshot(tmp_path)
    rc, err = _convert(capsys, str(sft_step), str(out))
    _assert_one_error_line(rc, err, f"OUT_DIR {out} is not empty (it holds config.json, notes")
    assert "--overwrite" in err
    assert _snapshot(tmp_path) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_into_the_working_folder_is_refused(sft_step, tmp_path, capsys, monkeypatch):
    """Issue 47: `nrl convert STEP .` would have wiped the working folder."""
    cwd = _user_folder(tmp_path / "cwd")
    monkeypatch.chdir(cwd)
    before = _snapshot(tmp_path)
    rc, err = _convert(capsys, str(sft_step), ".")
    _assert_one_error_line(rc, err, "OUT_DIR . is not empty")
    assert _snapshot(tmp_path) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("target_holds_files", [True, False])
def test_convert_through_a_symbolic_link_leaves_its_target_untouched(
    sft_step, tmp_path, capsys, target_holds_files
):
    """Issue 47: OUT_DIR a link to a folder elsewhere (full or empty): refused, the link and
    everything it points to left as they were."""
    outside = tmp_path / "outside"
    if target_holds_files:
        _user_folder(outside)
    else:
        outside.mkdir()
    (tmp_path / "work").mkdir()
    link = tmp_path / "work" / "hf"
    link.symlink_to(outside)
    before = _snapshot(tmp_path)
    rc, err = _convert(capsys, str(sft_step), str(link))
    _assert_one_error_line(rc, err, f"OUT_DIR {link} is a symbolic link (to {outside})")
    assert _snapshot(tmp_path) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overwrite_replaces_only_converts_own_files(sft_step, tmp_path, capsys):
    """Issue 47: with --overwrite the export's files replace those of the same name (the stale
    config.json); the user's other file and subfolder survive byte-identical, and no
    temporary folder is left beside OUT_DIR."""
    out = _user_folder(tmp_path / "out")
    before = _snapshot(out)
    rc, err = _convert(capsys, str(sft_step), str(out), "--overwrite")
    assert rc == 0, err[-3000:]
    after = _snapshot(out)
    for name in ("notes.txt", "sub", "sub/keep.bin"):
        assert after[name] == before[name], name
    assert (out / "model.safetensors").is_file()
    assert '"stale"' not in (out / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overwrite_through_a_link_fills_its_folder_and_keeps_the_link(sft_step, tmp_path, capsys):
    outside = _user_folder(tmp_path / "outside")
    link = tmp_path / "hf"
    link.symlink_to(outside)
    keep = outside / "sub" / "keep.bin"
    kept = keep.read_bytes()
    rc, err = _convert(capsys, str(sft_step), str(link), "--overwrite")
    assert rc == 0, err[-3000:]
    assert link.is_symlink() and os.readlink(link) == str(outside)
    assert (outside / "model.safetensors").is_file() and (outside / "notes.txt").is_file()
    assert keep.read_bytes() == kept


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_empty_existing_folder_is_written(sft_step, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _convert(capsys, str(sft_step), str(out))
    assert rc == 0, err[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overwrite_never_replaces_a_folder_of_the_users_with_a_file(sft_step, tmp_path, capsys):
    """With --overwrite, a folder of the user's named like a file of the export
    (`config.json/`) is said in one `error:` line (exit 2) and nothing in OUT_DIR is changed."""
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)
    (out / "config.json" / "theirs.txt").write_text("theirs\n")
    before = _snapshot(tmp_path)
    rc, err = _convert(capsys, str(sft_step), str(out), "--overwrite")
    # Found only once the export is written: after the loading's own progress lines.
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err[-3000:]
    assert f"nothing written to OUT_DIR {out}: {out / 'config.json'} is a folder" in errors[0]
    assert _snapshot(tmp_path) == before
