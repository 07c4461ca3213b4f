"""LoRA on the dtensor policy (:mod:`nrl_dtensor.lora`): adapters under tensor parallelism, and
an exact resume of the adapters' training."""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.config import DTensorConfig
from test_dtensor import (
    WORKER,
    adapter_params,
    context,
    full_params,
    local_policy,
    local_worker,
    make_config,
)

from nrl_core.policy import Policy
from nrl_core.testing.batches import TokenMeanNLL, make_batch

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def test_the_tp_plan_splits_each_adapter_like_the_weight_it_adapts(tiny_path):
    """A column-parallel projection gets a column-parallel lora_B (lora_A whole), a
    row-parallel one a row-parallel lora_A (lora_B whole); an unadapted one keeps its entry."""
    from nrl_dtensor.lora import lora_tensor_parallel_plan
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    layer = model.get_base_model().model.layers[0]
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    expanded = lora_tensor_parallel_plan(layer, plan)
    assert {name: type(style) for name, style in expanded.items()} == {
        "self_attn.q_proj.base_layer": ColwiseParallel,
        "self_attn.q_proj.lora_B.default": ColwiseParallel,
        "self_attn.k_proj": ColwiseParallel,
        "self_attn.o_proj.base_layer": RowwiseParallel,
        "self_attn.o_proj.lora_A.default": RowwiseParallel,
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
def test_adapter_training_resumes_exactly(tiny_path, tmp_path):
    """Four steps in one go, or two, a checkpoint, a fresh worker that loads it and two more:
    the same losses and the same adapters bit for bit (the adapters' AdamW moments, the
    warm-up's position and the adapter dropout's RNG stream all come back)."""
    config = make_config(tiny_path, warmup=2)
    options = DTensorConfig(**LORA, lora_dropout=0.1)
    batches = [make_batch(8, seed=20 + i) for i in range(4)]
    loss = TokenMeanNLL()

    straight = local_policy(config, options)
    expected = [straight.train(batch, loss)["loss"] for batch in batches]
    expected_adapters = straight.group.run_all("lora_adapter_tensors")[0]

    first = local_policy(config, options)
    losses = [first.train(batch, loss)["loss"] for batch in batches[:2]]
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.shutdown()
    resumed = local_policy(config, options)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    losses += [resumed.train(batch, loss)["loss"] for batch in batches[2:]]
    adapters = resumed.group.run_all("lora_adapter_tensors")[0]

    assert losses == expected
    assert adapters.keys() == expected_adapters.keys()
    for name, tensor in expected_adapters.items():
        assert torch.equal(adapters[name], tensor), name
    # The adapters did train (lora_B starts at zero), with dropout drawing from the RNG.
    assert max(t.abs().max() for n, t in adapters.items() if ".lora_B." in n) > 1e-4


@pytest.mark.slow
def test_lora_under_tensor_parallelism_matches_one_process(tiny_path, start_group, tmp_path):
    """Issue 52 item 3: tensor_parallel_size=2 with LoRA (refused before) gives one process's
    logprobs and steps (loss, gradient norm, the adapters' updates), and its full tensors for
    adapter refits (lora_adapter_tensors), merged refits (the plain model's state dict, adapters
    merged) and export_hf. Two SGD steps: the update is the gradient itself (AdamW's first step
    divides near-zero gradients by their own size, which amplifies float noise), and lora_A
    only gets a gradient once lora_B has left zero, at the second step."""
    from safetensors.torch import load_file

    config = make_config(tiny_path, optimizer="sgd", lr=0.5)
    options = DTensorConfig(**LORA)
    batches = [make_batch(4, seed=5), make_batch(4, seed=6)]
    batch = batches[0]
    single = local_policy(config, options)
    # Copies: in this process the tensors returned are the live parameters.
    before = {k: v.clone() for k, v in single.group.run_all("lora_adapter_tensors")[0].items()}
    expected_lp = single.get_logprobs(batch)
    expected = [single.train(b, TokenMeanNLL()) for b in batches]
    expected_adapters = single.group.run_all("lora_adapter_tensors")[0]
    buckets = single.group.worker.state_dict_buckets(1 << 16)
    expected_merged = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    expected_lp_after = single.get_logprobs(batch)
    single.export_hf(str(tmp_path / "single"))

    tp_options = DTensorConfig(**LORA, tensor_parallel_size=2)
    group = start_group(WORKER, (tp_options, context(config)))
    policy = Policy.from_config(group, config.policy)
    assert policy.dp_size == 1
    # The same initial adapters (drawn from the run's seed, whatever the layout).
    for name, tensor in adapter_params(group).items():
        assert torch.equal(tensor, before[name]), name
    torch.testing.assert_close(policy.get_logprobs(batch), expected_lp, rtol=0, atol=1e-5)
    for b, want in zip(batches, expected, strict=True):
        got = policy.train(b, TokenMeanNLL())
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)

    adapters = adapter_params(group)
    assert adapters.keys() == expected_adapters.keys()
    for name, tensor in expected_adapters.items():
        assert adapters[name].shape == tensor.shape, name  # full, not a shard
        torch.testing.assert_close(adapters[name], tensor, rtol=1e-5, atol=1e-6)
    # The steps moved both adapters: what is compared is an update, not the initial values.
    for kind in (".lora_A.", ".lora_B."):
        moved = [(expected_adapters[n] - before[n]).abs().max() for n in before if kind in n]
        assert max(moved) > 1e-3, kind
    merged = full_params(group)
    assert merged.keys() == expected_merged.keys()
    assert not any("lora" in name or "base_layer" in name for name in merged)
    for name, tensor in expected_merged.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(policy.get_logprobs(batch), expected_lp_after, rtol=0, atol=1e-5)

    # The TP=2 checkpoint loads into one process (what `nrl convert` does) with its adapters.
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    reloaded = local_worker(config, options)
    reloaded.load_checkpoint(str(tmp_path / "ckpt"))
    for name, tensor in reloaded.lora_adapter_tensors().items():
        assert torch.equal(tensor, adapters[name]), name

    policy.export_hf(str(tmp_path / "tp"))
    ours = load_file(tmp_path / "tp" / "model.safetensors")
    theirs = load_file(tmp_path / "single" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tensor_parallel_peers_drop_the_same_adapter_inputs(tiny_path, start_group):
    """With adapter dropout under TP=2, both peers draw the same dropout masks (they seed by
    data-parallel rank): a column-parallel projection's whole lora_A, held by each peer, gets
    the same gradient on both and stays equal (seeded by global rank, the peers dropped
    different entries and their copies drifted apart)."""
    config = make_config(tiny_path, optimizer="sgd", lr=0.5)
    options = DTensorConfig(**LORA, lora_dropout=0.3, tensor_parallel_size=2)
    group = start_group(WORKER, (options, context(config)))
    policy = Policy.from_config(group, config.policy)
    for seed in (5, 6):
        policy.train(make_batch(4, seed=seed), TokenMeanNLL())
    adapter_params(group)  # asserts the two peers' full adapters are equal
