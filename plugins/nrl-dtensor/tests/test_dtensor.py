"""The dtensor policy and torch generation on CPU: real gloo ranks, real ``from_pretrained``.

Tolerances: float32 on CPU. Sharding changes the order of floating-point reductions, so
"same" means within 1e-5 relative for losses and gradient norms and 1e-5 absolute for logprobs
(observed differences are ~1e-7).
"""

from __future__ import annotations

import torch
from _helpers import TokenMeanNLL, make_batch, stats_for
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig

from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig
from nrl_core.data import Batch, pad_sequences
from nrl_core.interfaces import ComponentContext, SamplingParams

WORKER = "_helpers:InspectableWorker"


def make_config(
    path,
    *,
    mbs=4,
    warmup=0,
    temperature=1.0,
    precision="float32",
    seed=0,
    optimizer="adamw",
    lr=1e-3,
    max_grad_norm=1.0,
):
    """A GRPO run config around the tiny model."""
    policy = PolicyConfig(
        model_name=str(path),
        train_micro_batch_size=mbs,
        logprob_batch_size=4,
        precision=precision,
        max_grad_norm=max_grad_norm,
        optimizer=OptimizerConfig(name=optimizer, lr=lr, warmup_steps=warmup),
    )
    return GRPOConfig(
        seed=seed, policy=policy, generation=GenerationConfig(temperature=temperature)
    )


def context(config, rank=0, world_size=1):
    return ComponentContext(config=config, rank=rank, world_size=world_size, seed=config.seed)


def local_worker(config, options=None):
    """A single-process worker in the pytest process (no torch.distributed, no FSDP)."""
    from nrl_dtensor.worker import DTensorPolicyWorker

    return DTensorPolicyWorker(options or DTensorConfig(), context(config))


def full_params(group) -> dict[str, torch.Tensor]:
    """The unsharded parameters, streamed through ``state_dict_buckets``; checks both ranks agree."""
    per_rank = group.run_all("bucket_list", 1 << 16)
    merged = [{k: v for bucket in buckets for k, v in bucket.items()} for buckets in per_rank]
    assert merged[0].keys() == merged[1].keys()
    for name in merged[0]:
        torch.testing.assert_close(merged[0][name], merged[1][name], rtol=0, atol=0)
    return merged[0]


def test_two_ranks_match_one_rank(tiny_path, start_group):
    config = make_config(tiny_path)
    batch = make_batch(8, seed=1)
    stats = stats_for(batch)
    single = local_worker(config)
    expected = single.train(batch, TokenMeanNLL(), stats)
    expected_lp = single.get_logprobs(batch)

    group = start_group(WORKER, (DTensorConfig(), context(config)))
    results = group.run_sharded("train", batch.shard(2), TokenMeanNLL(), stats)
    # Metrics are global sums, identical on every rank.
    assert results[0] == results[1]
    got = results[0]
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    assert got["tokens"] == expected["tokens"] == stats.valid_tokens
    assert got["lr"] == expected["lr"] == 1e-3
    # The same update: logprobs after the step agree.
    lps = torch.cat(group.run_sharded("get_logprobs", batch.shard(2)))
    torch.testing.assert_close(lps, expected_lp, rtol=0, atol=1e-5)
    # Padding and position 0 hold exactly 0.
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["lengths"][:, None]
    assert (lps[~valid] == 0).all() and (lps[:, 0] == 0).all() and (lps[:, 1] < 0).all()


def test_micro_batch_size_and_token_budget_do_not_change_the_step(tiny_path, start_group):
    batch = make_batch(8, seed=2, min_len=4, max_len=30)
    stats = stats_for(batch)
    shards = batch.shard(2)
    outcomes = {}
    variants = {
        "mbs1": (1, DTensorConfig()),
        "mbs4": (4, DTensorConfig()),
        # Packs by tokens: the ranks end up with different numbers of micro batches.
        "budget": (4, DTensorConfig(micro_batch_token_budget=30)),
    }
    for name, (mbs, options) in variants.items():
        # Plain SGD without clipping: the update is proportional to the gradient, so a wrongly
        # scaled loss shows in the parameters (Adam and clipping would hide a scale error).
        config = make_config(tiny_path, mbs=mbs, optimizer="sgd", lr=0.5, max_grad_norm=0.0)
        group = start_group(WORKER, (options, context(config)), name=name)
        metrics = group.run_sharded("train", shards, TokenMeanNLL(), stats)[0]
        outcomes[name] = (metrics, full_params(group))
        group.shutdown()
    ref_metrics, ref_params = outcomes["mbs4"]
    for name in ("mbs1", "budget"):
        metrics, params = outcomes[name]
        assert abs(metrics["loss"] - ref_metrics["loss"]) <= 1e-5 * abs(ref_metrics["loss"]), name
        assert (
            abs(metrics["grad_norm"] - ref_metrics["grad_norm"]) <= 1e-5 * ref_metrics["grad_norm"]
        )
        for key in ref_params:
            torch.testing.assert_close(params[key], ref_params[key], rtol=1e-5, atol=1e-7)
    # The step did move the weights (so the comparison above is not vacuous).
    initial = local_worker(make_config(tiny_path)).model.state_dict()
    assert max((ref_params[k] - initial[k]).abs().max() for k in ref_params) > 1e-4


def test_generation_logprobs_match_training_logprobs(tiny_path, start_group):
    # A temperature other than 1 checks that trainer and generator scale the same way.
    config = make_config(tiny_path, temperature=0.7)
    config.generation.options["torch"] = TorchGenerationConfig(generation_batch_size=2)
    group = start_group(WORKER, (DTensorConfig(), context(config)))
    prompts = [[1, 5, 20, 21, 22], [1, 5, 30], [1, 5, 31, 32, 33, 34, 35], [1, 5, 40, 41]]
    # Uneven shards (3 and 1 prompts, 2 and 1 chunks) exercise the keep-stepping protocol.
    shards = [prompts[:3], prompts[3:]]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=11)
    outputs = group.run_sharded("generate", shards, params)
    for shard, out in zip(shards, outputs, strict=True):
        assert len(out.token_ids) == len(shard)
        seqs = [p + t for p, t in zip(shard, out.token_ids, strict=True)]
        batch = Batch(
            {"input_ids": pad_sequences(seqs), "lengths": torch.tensor([len(s) for s in seqs])}
        )
        lp = group.run_sharded("get_logprobs", [batch, batch])[0]
        for i, (p, t) in enumerate(zip(shard, out.token_ids, strict=True)):
            train_lp = lp[i, len(p) : len(p) + len(t)]
            assert len(t) > 0
            torch.testing.assert_close(train_lp, torch.tensor(out.logprobs[i]), rtol=0, atol=1e-5)
    # Same seed, same samples.
    again = group.run_sharded("generate", shards, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]


def test_checkpoint_round_trip_reference_and_export(tiny_path, start_group, tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_config(tiny_path, warmup=3)
    batch1, batch2 = make_batch(8, seed=3), make_batch(8, seed=4)
    group = start_group(WORKER, (DTensorConfig(), context(config)), name="a")
    initial_lp = torch.cat(group.run_sharded("get_logprobs", batch1.shard(2)))
    first = group.run_sharded("train", batch1.shard(2), TokenMeanNLL(), stats_for(batch1))[0]
    assert abs(first["lr"] - 1e-3 / 3) < 1e-12  # warm-up: step 1 of 3
    group.run_all("save_checkpoint", str(tmp_path / "ckpt"))

    restored = start_group(WORKER, (DTensorConfig(), context(config)), name="b")
    restored.run_all("load_checkpoint", str(tmp_path / "ckpt"))
    lp_a = torch.cat(group.run_sharded("get_logprobs", batch2.shard(2)))
    lp_b = torch.cat(restored.run_sharded("get_logprobs", batch2.shard(2)))
    assert torch.equal(lp_a, lp_b)
    # The next step (optimizer moments, scheduler position) is identical too.
    step_a = group.run_sharded("train", batch2.shard(2), TokenMeanNLL(), stats_for(batch2))[0]
    step_b = restored.run_sharded("train", batch2.shard(2), TokenMeanNLL(), stats_for(batch2))[0]
    assert step_a == step_b and abs(step_a["lr"] - 2e-3 / 3) < 1e-12
    params_a, params_b = full_params(group), full_params(restored)
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), key

    # The reference stays at the initial weights after training.
    ref_lp = torch.cat(restored.run_sharded("get_reference_logprobs", batch1.shard(2)))
    torch.testing.assert_close(ref_lp, initial_lp, rtol=0, atol=1e-6)
    trained_lp = torch.cat(restored.run_sharded("get_logprobs", batch1.shard(2)))
    assert (trained_lp - initial_lp).abs().max() > 1e-3

    # export_hf reloads through from_pretrained and computes the same logprobs.
    restored.run_all("export_hf", str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    for key, value in model.state_dict().items():
        assert torch.equal(value, params_b[key]), key
    with torch.no_grad():
        logits = model(batch1["input_ids"]).logits
    lp = (
        torch.log_softmax(logits[:, :-1], -1)
        .gather(-1, batch1["input_ids"][:, 1:, None])
        .squeeze(-1)
    )
    valid = torch.arange(1, batch1["input_ids"].shape[1])[None, :] < batch1["lengths"][:, None]
    torch.testing.assert_close(lp[valid], trained_lp[:, 1:][valid], rtol=0, atol=1e-5)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_tensor_parallel_matches_single_process(tiny_path, start_group):
    config = make_config(tiny_path)
    batch = make_batch(4, seed=5)
    stats = stats_for(batch)
    single = local_worker(config)
    expected_lp = single.get_logprobs(batch)
    expected = single.train(batch, TokenMeanNLL(), stats)
    # tp=2 on 2 ranks: one data-parallel shard, given to both tensor-parallel peers.
    group = start_group(WORKER, (DTensorConfig(tensor_parallel_size=2), context(config)))
    lps = group.run_sharded("get_logprobs", [batch, batch])
    torch.testing.assert_close(lps[0], expected_lp, rtol=0, atol=1e-5)
    got = group.run_sharded("train", [batch, batch], TokenMeanNLL(), stats)[0]
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    assert got["tokens"] == stats.valid_tokens  # counted once, not once per TP peer


def test_bfloat16_and_activation_checkpointing(tiny_path, start_group):
    batch = make_batch(4, seed=6)
    stats = stats_for(batch)
    plain = start_group(WORKER, (DTensorConfig(), context(make_config(tiny_path))), name="plain")
    ckpt = start_group(
        WORKER,
        (
            DTensorConfig(activation_checkpointing=True, cpu_offload=True),
            context(make_config(tiny_path)),
        ),
        name="ckpt",
    )
    a = plain.run_sharded("train", batch.shard(2), TokenMeanNLL(), stats)[0]
    b = ckpt.run_sharded("train", batch.shard(2), TokenMeanNLL(), stats)[0]
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    bf16 = start_group(
        WORKER,
        (DTensorConfig(), context(make_config(tiny_path, precision="bfloat16"))),
        name="bf16",
    )
    c = bf16.run_sharded("train", batch.shard(2), TokenMeanNLL(), stats)[0]
    # bfloat16 compute: close to float32, not equal.
    assert abs(c["loss"] - a["loss"]) < 0.05 * abs(a["loss"]) and c["loss"] != a["loss"]
    buckets = bf16.run_all("bucket_list", 1 << 14)[0]
    assert len(buckets) > 1
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for t in bucket.values()]
        assert len(sizes) == 1 or sum(sizes) <= 1 << 14
        # Master weights stay float32 under the mixed-precision policy.
        assert all(t.dtype == torch.float32 for t in bucket.values())
