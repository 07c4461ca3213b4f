"""SFT: the assistant-only loss mask, chat data mapping, micro-batch invariance, LoRA, and a
few-step `nrl run sft` on CPU."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nrl_core.algorithms.supervised import masked_batch
from nrl_core.chat_data import ChatDataConfig, ChatDataError, ChatDataset, encode_conversation
from nrl_core.losses.nll import NLLLoss

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "2+3="},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "+4="},
    {"role": "assistant", "content": "9"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_loss_mask_covers_exactly_the_assistant_messages(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    # The ids are exactly the chat template's rendering of the whole conversation.
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == full
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "5<|eos|>9<|eos|>"
    # The role header comes from the generation prompt and is not trained.
    header = tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert all(m == 0 for i, m in zip(ids, mask, strict=True) if i == header)


def test_loss_mask_without_chat_template_and_truncation(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONVERSATION[1:3], use_template=False)
    assert tokenizer.decode(ids) == "2+3=\n5<|eos|>"
    assert mask == [0.0] * 5 + [1.0, 1.0]
    short, short_mask = encode_conversation(tokenizer, CONVERSATION, max_length=6)
    assert len(short) == len(short_mask) == 6


def test_chat_dataset_maps_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}]},
        {"conversations": [{"from": "human", "value": "yo"}, {"from": "gpt", "value": "sup"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = ChatDataConfig(
        path=str(path), messages_field="conversations", role_field="from", content_field="value"
    )
    samples = ChatDataset(options, None).load("train")
    assert samples[0].messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hey"},
    ]
    with pytest.raises(KeyError):  # no validation source: the core holds one out
        ChatDataset(options, None).load("validation")
    instruct = ChatDataset(ChatDataConfig(prompt_field="q", response_field="a"), None)
    assert instruct.to_sample({"q": "1+1=", "a": "2"}).messages[1]["content"] == "2"
    with pytest.raises(ChatDataError, match="messages_field"):
        ChatDataset(ChatDataConfig(path=str(path)), None).load("train")


def test_shipped_chat_data_loads():
    train = ChatDataset(ChatDataConfig(path="nrl://recipes/data/chat_train.jsonl"), None)
    samples = train.load("train")
    assert len(samples) == 384
    assert all(any(m["role"] == "assistant" for m in s.messages) for s in samples)


def chat_batch(tokenizer, count=8):
    samples = ChatDataset(ChatDataConfig(path="nrl://recipes/data/chat_train.jsonl"), None).load(
        "train"
    )[:count]
    rows = [encode_conversation(tokenizer, s.messages) for s in samples]
    return masked_batch(rows, tokenizer.pad_token_id)


def test_sft_loss_is_invariant_to_micro_batch_size(tiny_model_path, tokenizer, make_policy):
    assert "WORLD_SIZE" not in os.environ
    batch = chat_batch(tokenizer)
    results = {}
    for size in (1, 3, 8):
        policy = make_policy(tiny_model_path, micro_batch_size=size)
        metrics = policy.train(batch, NLLLoss())
        results[size] = (metrics, policy.get_logprobs(batch))
    # The reported loss is the token-mean NLL of the whole batch, computed independently.
    fresh = make_policy(tiny_model_path)
    lp = fresh.get_logprobs(batch)
    expected = float(-(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    for metrics, after in results.values():
        assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
        assert metrics["num_valid_tokens"] == float(batch["loss_mask"].sum())
        assert metrics["grad_norm"] == pytest.approx(results[8][0]["grad_norm"], rel=1e-4)
        torch.testing.assert_close(after, results[8][1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(results[8][1], lp)  # the step changed the model


@pytest.mark.slow
def test_lora_trains_adapters_only_and_exports_merged_weights(
    tiny_model_path, tokenizer, tmp_path, make_policy
):
    from transformers import AutoModelForCausalLM

    policy = make_policy(tiny_model_path, lora_rank=4, lr=5e-3)
    trainable = [n for n, p in policy.group.worker.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    batch = chat_batch(tokenizer)
    losses = [policy.train(batch, NLLLoss())["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    policy.export_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = batch["input_ids"][:2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ours = policy.get_logprobs(batch.slice(0, 2))
    mask = torch.arange(ids.shape[1] - 1)[None] < (batch["lengths"][:2, None] - 1)
    torch.testing.assert_close(lp * mask, ours[:, 1:] * mask, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[name], base.state_dict()[name])


@pytest.mark.slow
def test_nrl_run_sft_on_cpu_decreases_the_loss(tmp_path, run_cli):
    records = run_cli("sft", "sft.max_num_steps=8", "sft.val_period=4")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[-1]["train/loss"] < 0.8 * train[0]["train/loss"]
    assert {"timing/train_s", "throughput/tokens_per_s", "timing/step_s"} <= train[0].keys()
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert sorted(val) == [0, 4, 8]
    assert val[8] < val[0]
    step = tmp_path / "ckpt" / "step_8"
    assert (step / "config.yaml").is_file() and (step / "policy").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(900)  # two short runs on Ray: minutes on a loaded 2-core machine
def test_a_lora_run_resumed_halfway_equals_the_uninterrupted_run(tmp_path):
    """Issue 52: a LoRA `nrl run sft` on 2 ranks (rank 4, adapter dropout 0.1) stopped after
    step 2 and resumed to step 4 takes the uninterrupted run's steps 3 and 4 exactly (the same
    losses and gradient norms, compared with ==) and ends with the same adapters
    (`nrl convert --lora adapters` of both step_4 checkpoints, tensor for tensor): the
    adapters' AdamW moments, the schedule's position and each rank's dropout RNG resume.

    The stopped run is the uninterrupted run's folder as it stood after step 2 (a copy without
    its step_4 checkpoint; the resume drops the metrics after step 2), not a third run to step
    2: the same steps 1 and 2 and the same step_2 checkpoint, one Ray start and two ranks
    fewer. The resume is a fresh process, so all it continues from is that checkpoint."""
    from safetensors.torch import load_file

    from nrl_core.cli import main
    from tests.algorithms.test_grpo_cli import metrics, run_nrl

    base = [
        "policy.num_workers=2",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.optimizer.warmup_steps=3",
        "policy.dtensor.lora_rank=4",
        "policy.dtensor.lora_dropout=0.1",
        "sft.val_period=0",
        "checkpointing.save_period=2",
        "cluster.num_cpus=2",
    ]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    run_nrl(reference, "sft.max_num_steps=4", algorithm="sft", base=base)
    shutil.copytree(reference, stopped)
    shutil.rmtree(stopped / "ckpt" / "step_4")
    assert [p.name for p in (stopped / "ckpt").iterdir() if p.name.startswith("step_")] == [
        "step_2"
    ]
    run_nrl(stopped, "sft.max_num_steps=4", algorithm="sft", base=base)  # resume=auto
    expected = {r["step"]: r for r in metrics(reference) if "train/loss" in r}
    resumed = {r["step"]: r for r in metrics(stopped) if "train/loss" in r}
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4]
    # Steps 1 and 2 are the copied records, timings included (wall-clock figures no second
    # run reproduces): the resume started after step 2 and did not train from scratch.
    assert resumed[1] == expected[1] and resumed[2] == expected[2]
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert resumed[step][key] == expected[step][key], (step, key)
    assert expected[4]["train/loss"] != expected[3]["train/loss"]  # it trains

    adapters = {}
    for run in (reference, stopped):
        out = tmp_path / f"{run.name}-adapters"
        assert main(["convert", str(run / "ckpt" / "step_4"), str(out), "--lora", "adapters"]) == 0
        adapters[run.name] = load_file(out / "adapter_model.safetensors")
    assert adapters["reference"].keys() == adapters["stopped"].keys()
    lora_b = [name for name in adapters["reference"] if ".lora_B." in name]
    assert lora_b and max(adapters["reference"][n].abs().max() for n in lora_b) > 0
    for name, tensor in adapters["reference"].items():
        assert torch.equal(adapters["stopped"][name], tensor), name


class _NaNLoss(NLLLoss):
    """The NLL times NaN: every gradient is NaN (what NaN rewards or advantages give)."""

    def __call__(self, logprobs, batch, stats):
        loss, metrics = super().__call__(logprobs, batch, stats)
        return loss * float("nan"), metrics


def test_a_nan_gradient_is_never_applied(tiny_model_path, tokenizer, make_policy):
    """Issue 40: a step whose gradients are NaN reports grad_norm NaN and leaves the weights
    as they were (the optimizer does not step); the next finite step trains normally."""
    import math

    batch = chat_batch(tokenizer)
    policy = make_policy(tiny_model_path)
    before = policy.get_logprobs(batch)
    metrics = policy.train(batch, _NaNLoss())
    assert math.isnan(metrics["loss"]) and not math.isfinite(metrics["grad_norm"])
    after = policy.get_logprobs(batch)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    # No NaN gradient was left behind to poison the next step.
    fresh = make_policy(tiny_model_path)
    expected = fresh.train(batch, NLLLoss())
    assert policy.train(batch, NLLLoss())["grad_norm"] == pytest.approx(expected["grad_norm"])
    torch.testing.assert_close(policy.get_logprobs(batch), fresh.get_logprobs(batch))
