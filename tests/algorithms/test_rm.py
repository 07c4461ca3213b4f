"""Reward models: the scalar head's scores, Bradley-Terry training through the worker, the
`reward_model` environment on an exported folder, and a few-step `nrl run rm` on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nrl_core.chat_data import PreferenceDataConfig, PreferenceDataset, encode_conversation
from nrl_core.config.schema import PolicyConfig, RMConfig
from nrl_core.data import Batch, pad_sequences
from nrl_core.interfaces import ComponentContext
from nrl_core.policy import global_batch_stats
from nrl_core.reward_model import (
    BradleyTerryLoss,
    RewardModelEnvConfig,
    RewardModelEnvironment,
    last_token_mask,
    sequence_scores,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model_path():
    """The cached tiny model (built once per machine) rather than a fresh build per session."""
    from nrl_core.testing.tiny import tiny_model_path as cached

    return cached()


def rm_worker(model_path, lr=3e-3):
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    config = RMConfig(
        policy=PolicyConfig(
            model_name=str(model_path), train_micro_batch_size=4, max_total_sequence_length=64
        )
    )
    config.policy.optimizer.lr = lr
    return DTensorPolicyWorker(DTensorConfig(), ComponentContext(config=config, seed=3))


def pairs(tokenizer, start=0, count=8):
    samples = PreferenceDataset(
        PreferenceDataConfig(path="nrl://recipes/data/preference_train.jsonl"), None
    ).load("train")[start : start + count]
    conversations = [
        [*s.messages, *s.metadata[key]] for s in samples for key in ("chosen", "rejected")
    ]
    ids = [encode_conversation(tokenizer, c)[0] for c in conversations]
    lengths = [len(i) for i in ids]
    input_ids = pad_sequences(ids, pad_value=tokenizer.pad_token_id)
    batch = Batch(
        {
            "input_ids": input_ids,
            "lengths": torch.tensor(lengths),
            "loss_mask": torch.tensor(last_token_mask(lengths, input_ids.shape[1])),
        }
    )
    return batch, conversations


def test_rm_training_and_the_reward_model_environment(tiny_model_path, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    assert "WORLD_SIZE" not in os.environ
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    worker = rm_worker(tiny_model_path)
    assert worker.scalar_head  # `auto` picks the scalar head for an RM config
    batch, _ = pairs(tokenizer)
    stats = global_batch_stats(batch, 64)
    assert stats.valid_sequences == 16
    loss_fn = BradleyTerryLoss()
    losses = [worker.train(batch, loss_fn, stats)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0]

    # Export, then score held-out pairs with the environment: the same scores as the worker.
    worker.export_hf(str(tmp_path / "rm"))
    held_out, conversations = pairs(tokenizer, start=100, count=4)
    ours = sequence_scores(worker.get_logprobs(held_out), held_out)
    env = RewardModelEnvironment(RewardModelEnvConfig(path=str(tmp_path / "rm"), batch_size=3))
    steps = env.step(conversations, [{}] * len(conversations))
    torch.testing.assert_close(torch.tensor([s.reward for s in steps]), ours, atol=1e-4, rtol=1e-4)
    # ... and Hugging Face's own pooling (last non-pad token) agrees, row by row.
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        pooled = hf(input_ids=held_out["input_ids"]).logits[:, 0]
    torch.testing.assert_close(pooled, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_nrl_run_rm_on_cpu_decreases_the_loss(tmp_path):
    records = run_cli("rm", tmp_path, "rm.max_num_steps=8", "rm.val_period=4")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    first, last = train[0]["train/loss"], train[-1]["train/loss"]
    assert last < first
    val = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 4, 8]
    assert val[-1]["val/loss"] < val[0]["val/loss"]


def run_cli(algorithm: str, tmp_path: Path, *overrides: str) -> list[dict]:
    """`nrl run ALGO --config examples/configs/ALGO_tiny_cpu.yaml` in a subprocess; returns
    the metrics records."""
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    args = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        algorithm,
        "--config",
        str(REPO / "examples" / "configs" / f"{algorithm}_tiny_cpu.yaml"),
        f"logger.log_dir={tmp_path}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "cluster.num_cpus=2",
        *overrides,
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / f"{algorithm}-tiny-cpu"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
