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

    out = tmp_path / "hf"
    convert = [*nrl, "convert", str(tmp_path / "ckpt"), "--to", "hf", str(out), "-q"]
    done = subprocess.run(convert, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

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
