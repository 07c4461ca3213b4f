"""Reward models: the scalar head's scores, Bradley-Terry training through the policy, the
`reward_model` environment on an exported folder, and a few-step `nrl run rm` on CPU."""

from __future__ import annotations

import os

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


def rm_policy(model_path, lr=3e-3):
    """The core's policy facade over a single-process dtensor worker with an RM config."""
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.policy import Policy

    config = RMConfig(
        policy=PolicyConfig(
            model_name=str(model_path), train_micro_batch_size=4, max_total_sequence_length=64
        )
    )
    config.policy.optimizer.lr = lr
    worker = DTensorPolicyWorker(DTensorConfig(), ComponentContext(config=config, seed=3))
    return Policy.from_config(InProcessGroup(worker), config.policy)


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
    policy = rm_policy(tiny_model_path)
    assert policy.group.worker.scalar_head  # `auto` picks the scalar head for an RM config
    batch, _ = pairs(tokenizer)
    stats = global_batch_stats(batch, 64)
    assert stats.valid_sequences == 16
    loss_fn = BradleyTerryLoss()
    losses = [policy.train(batch, loss_fn)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0]

    # Export, then score held-out pairs with the environment: the same scores as the policy.
    policy.export_hf(str(tmp_path / "rm"))
    held_out, conversations = pairs(tokenizer, start=100, count=4)
    ours = sequence_scores(policy.get_logprobs(held_out), held_out)
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
def test_nrl_run_rm_on_cpu_decreases_the_loss(run_cli):
    records = run_cli("rm", "rm.max_num_steps=8", "rm.val_period=4")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    first, last = train[0]["train/loss"], train[-1]["train/loss"]
    assert {"timing/train_s", "timing/step_s", "train/accuracy"} <= train[0].keys()
    assert last < first
    val = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 4, 8]
    assert val[-1]["val/loss"] < val[0]["val/loss"]
