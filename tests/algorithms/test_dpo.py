"""DPO: pair encoding, the DPO loss on real batches through the policy, and a few-step
`nrl run dpo` on CPU."""

from __future__ import annotations

import pytest
import torch

from nrl_core.algorithms.dpo import check_pair_layout
from nrl_core.algorithms.supervised import masked_batch
from nrl_core.chat_data import (
    PreferenceDataConfig,
    PreferenceDataset,
    encode_conversation,
)
from nrl_core.config.schema import DPOConfig, PolicyConfig
from nrl_core.errors import ConfigError
from nrl_core.losses.config import DPOLossConfig
from nrl_core.losses.preference import DPOLoss


def test_preference_rows_strip_a_repeated_prompt():
    dataset = PreferenceDataset(PreferenceDataConfig(), None)
    prompt = [{"role": "user", "content": "2+2="}]
    sample = dataset.to_sample(
        {
            "prompt": prompt,
            "chosen": [*prompt, {"role": "assistant", "content": "4"}],
            "rejected": "5",
        }
    )
    assert sample.messages == prompt
    assert sample.metadata["chosen"] == [{"role": "assistant", "content": "4"}]
    assert sample.metadata["rejected"] == [{"role": "assistant", "content": "5"}]
    shipped = PreferenceDataset(
        PreferenceDataConfig(path="nrl://recipes/data/preference_train.jsonl"), None
    ).load("train")
    assert len(shipped) == 384


def test_pair_layout_is_checked():
    config = DPOConfig(policy=PolicyConfig(train_global_batch_size=6, train_micro_batch_size=3))
    with pytest.raises(ConfigError, match="must be even"):
        check_pair_layout(config)
    config = DPOConfig(
        policy=PolicyConfig(num_workers=2, train_global_batch_size=6, train_micro_batch_size=2)
    )
    with pytest.raises(ConfigError, match="split evenly"):
        check_pair_layout(config)


def pair_batch(tokenizer, count=8):
    samples = PreferenceDataset(
        PreferenceDataConfig(path="nrl://recipes/data/preference_train.jsonl"), None
    ).load("train")[:count]
    rows = [
        encode_conversation(tokenizer, [*s.messages, *s.metadata[key]])
        for s in samples
        for key in ("chosen", "rejected")
    ]
    return masked_batch(rows, tokenizer.pad_token_id)


def test_dpo_steps_through_the_worker_raise_the_margin(tiny_model_path, make_policy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = make_policy(tiny_model_path, micro_batch_size=4, lr=3e-3)
    batch = pair_batch(tokenizer)
    batch["ref_logprobs"] = policy.get_logprobs(batch, reference=True)
    loss_fn = DPOLoss(DPOLossConfig(beta=0.1, sft_loss_weight=0.5))
    first = policy.train(batch, loss_fn)
    # Policy == reference before the first update: margin 0, loss log 2 (+ the SFT term).
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert first["preference_loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), rel=1e-5)
    assert first["loss"] == pytest.approx(first["preference_loss"] + 0.5 * first["sft_loss"])
    for _ in range(3):
        last = policy.train(batch, loss_fn)
    assert last["reward_margin"] > 0.05
    assert last["preference_loss"] < first["preference_loss"]
    assert last["preference_accuracy"] > 0.5


@pytest.mark.slow
def test_nrl_run_dpo_on_cpu_decreases_the_loss(run_cli):
    records = run_cli("dpo", "dpo.max_num_steps=8", "dpo.val_period=4")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference
    assert {"timing/logprobs_s", "timing/train_s", "timing/step_s"} <= train[0].keys()
    assert train[-1]["train/loss"] < train[0]["train/loss"] - 0.1
    val = [r for r in records if "val/preference_accuracy" in r]
    assert [r["step"] for r in val] == [0, 4, 8]
    assert val[-1]["val/reward_margin"] > val[0]["val/reward_margin"]
