"""The dtensor policy and torch generation on CPU: real gloo ranks, real ``from_pretrained``.

Tolerances: float32 on CPU. Sharding changes the order of floating-point reductions, so
"same" means within 1e-5 relative for losses and gradient norms and 1e-5 absolute for logprobs
(observed differences are ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig
from nrl_dtensor.generation import TorchGenerator

from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig
from nrl_core.data import Batch, pad_sequences
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.interfaces import ComponentContext, SamplingParams
from nrl_core.policy import Policy
from nrl_core.testing.batches import TokenMeanNLL, make_batch, stats_for

# Every test here starts 2-rank Ray worker groups: `slow` lets CI's `plugin-dtensor` session
# (which runs after the dev-env suite already ran these) keep to the quick checks.
pytestmark = pytest.mark.slow

WORKER = "_helpers:InspectableWorker"


def make_config(
    path,
    *,
    mbs=4,
    token_budget=None,
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
        micro_batch_token_budget=token_budget,
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


def local_policy(config, options=None) -> Policy:
    """The core's policy facade over a single-process worker: the same training-step code as a
    worker group runs."""
    return Policy.from_config(InProcessGroup(local_worker(config, options)), config.policy)


def group_policy(start_group, config, options=None, name="policy") -> Policy:
    """The core's policy facade over a 2-rank worker group."""
    group = start_group(WORKER, (options or DTensorConfig(), context(config)), name=name)
    return Policy.from_config(group, config.policy)


def full_params(group) -> dict[str, torch.Tensor]:
    """The unsharded parameters, streamed through ``state_dict_buckets``; checks both ranks agree."""
    per_rank = group.run_all("bucket_list", 1 << 16)
    merged = [{k: v for bucket in buckets for k, v in bucket.items()} for buckets in per_rank]
    assert merged[0].keys() == merged[1].keys()
    for name in merged[0]:
        torch.testing.assert_close(merged[0][name], merged[1][name], rtol=0, atol=0)
    return merged[0]


def adapter_params(group) -> dict[str, torch.Tensor]:
    """A LoRA policy's adapter tensors (PEFT's names: the state dict streamed to engines holds
    the plain model's weights, adapters merged); checks both ranks agree."""
    per_rank = group.run_all("lora_adapter_tensors")
    assert per_rank[0].keys() == per_rank[1].keys()
    for name in per_rank[0]:
        torch.testing.assert_close(per_rank[0][name], per_rank[1][name], rtol=0, atol=0)
    return per_rank[0]


# Replicated weights are the CPU default; sharded ones as one FSDP unit (`auto` on CPU) or per
# decoder block (the GPU default).
LAYOUTS = {
    "replicate": DTensorConfig(),
    "shard-model": DTensorConfig(data_parallel="shard"),
    "shard-blocks": DTensorConfig(data_parallel="shard", fsdp_units="blocks"),
}


def test_learning_rate_follows_the_configured_decay(tiny_path):
    """The rate each step reports and applies is the shared schedule's (nrl_core.lr_schedule):
    a linear warm-up of 2 steps, then a cosine decay to a tenth over 4 steps."""
    config = make_config(tiny_path, lr=1e-3)
    config.policy.optimizer = OptimizerConfig(
        lr=1e-3, warmup_steps=2, decay="cosine", decay_steps=4, min_lr_ratio=0.1
    )
    policy = local_policy(config)
    batch = make_batch(8, seed=1)
    got = [policy.train(batch, TokenMeanNLL())["lr"] for _ in range(7)]
    half = 0.1 + 0.9 * 0.5
    expected = [5e-4, 1e-3, 1e-3, None, half * 1e-3, None, 1e-4]
    for step, (lr, want) in enumerate(zip(got, expected, strict=True)):
        if want is not None:
            assert lr == pytest.approx(want, rel=1e-9), step
    assert got[3] > got[4] > got[5] > got[6]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_match_one_rank(tiny_path, start_group, layout):
    config = make_config(tiny_path)
    batch = make_batch(8, seed=1)
    stats = stats_for(batch)
    single = local_policy(config)
    expected_before = single.get_logprobs(batch)
    expected = single.train(batch, TokenMeanNLL())
    expected_lp = single.get_logprobs(batch)

    policy = group_policy(start_group, config, LAYOUTS[layout])
    assert policy.group.run_all("is_sharded") == [layout != "replicate"] * 2
    # A no-grad forward first (validation before training): the weights it gathers must not
    # outlive the update.
    torch.testing.assert_close(policy.get_logprobs(batch), expected_before, rtol=0, atol=1e-5)
    got = policy.train(batch, TokenMeanNLL())
    # Replicas on one host average their gradients through shared memory.
    through_shm = [True, True] if layout == "replicate" else [None, None]
    assert policy.group.run_all("gradients_through_shared_memory") == through_shm
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    # Additive metrics are summed over micro batches and ranks: each token counted once.
    assert got["tokens"] == expected["tokens"] == stats.valid_tokens
    assert got["lr"] == expected["lr"] == 1e-3
    # The same update: logprobs after the step agree.
    lps = policy.get_logprobs(batch)
    torch.testing.assert_close(lps, expected_lp, rtol=0, atol=1e-5)
    # Padding and position 0 hold exactly 0.
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["lengths"][:, None]
    assert (lps[~valid] == 0).all() and (lps[:, 0] == 0).all() and (lps[:, 1] < 0).all()


def test_max_and_min_metrics_are_extremes_over_micro_batches_and_ranks(tiny_path, start_group):
    """2 ranks x 2 micro batches: ``ratio_max`` / ``ratio_min`` / ``gen_logprob_error_max`` are
    the extremes over every valid token of the step, not sums of per-micro-batch extremes."""
    from nrl_core.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss

    config = make_config(tiny_path, mbs=2)
    policy = group_policy(start_group, config)
    batch = make_batch(8, seed=7)
    current = policy.get_logprobs(batch)
    g = torch.Generator().manual_seed(0)
    shift = torch.rand(current.shape, generator=g) - 0.5  # log-ratios in [-0.5, 0.5)
    gen_shift = torch.rand(current.shape, generator=g) * 0.3
    batch["prev_logprobs"] = current - shift
    batch["gen_logprobs"] = current - shift - gen_shift
    batch["advantages"] = torch.randn(len(batch), generator=g)
    loss = ClippedPGLoss(ClippedPGConfig(is_correction="none"))
    got = policy.train(batch, loss)

    valid = batch["loss_mask"].bool()
    assert got["ratio_max"] == pytest.approx(float(shift[valid].exp().max()), abs=1e-4)
    assert got["ratio_min"] == pytest.approx(float(shift[valid].exp().min()), abs=1e-4)
    assert got["gen_logprob_error_max"] == pytest.approx(
        float(gen_shift[valid].exp().max()), abs=1e-4
    )
    assert got["ratio_min"] < 1.0 < got["ratio_max"] < 1.7


def test_micro_batch_size_and_token_budget_do_not_change_the_step(tiny_path, start_group):
    batch = make_batch(8, seed=2, min_len=4, max_len=30)
    outcomes = {}
    variants = {
        "mbs1": {"mbs": 1},
        "mbs4": {"mbs": 4},
        # Packs by tokens: the ranks end up with different numbers of micro batches.
        "budget": {"mbs": 4, "token_budget": 30},
    }
    for name, sizes in variants.items():
        # Plain SGD without clipping: the update is proportional to the gradient, so a wrongly
        # scaled loss shows in the parameters (Adam and clipping would hide a scale error).
        config = make_config(tiny_path, optimizer="sgd", lr=0.5, max_grad_norm=0.0, **sizes)
        policy = group_policy(start_group, config, name=name)
        metrics = policy.train(batch, TokenMeanNLL())
        outcomes[name] = (metrics, full_params(policy.group))
        policy.shutdown()
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
        lp = Policy.from_config(group, config.policy).get_logprobs(batch)
        for i, (p, t) in enumerate(zip(shard, out.token_ids, strict=True)):
            train_lp = lp[i, len(p) : len(p) + len(t)]
            assert len(t) > 0
            torch.testing.assert_close(train_lp, torch.tensor(out.logprobs[i]), rtol=0, atol=1e-5)
    # Same seed, same samples.
    again = group.run_sharded("generate", shards, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]


@pytest.mark.parametrize(
    ("layout", "once"),
    [
        # The GPU default, before (a gather per layer and decode step) and now (one per call).
        ("shard-blocks", False),
        ("shard-blocks", True),
        # One FSDP unit (`auto` on CPU): the gathered weights stay for the training step.
        ("shard-model", True),
        # The CPU default: replicas have nothing to gather.
        ("replicate", True),
    ],
)
def test_generation_gathers_the_weights_once_per_call(tiny_path, start_group, layout, once):
    """Colocated generation on 2 FSDP ranks all-gathers each FSDP module once per call and runs
    no collective per decode step (before: one all-gather per layer and forward, and an
    all-reduce per step), with the same samples as without a ranks; afterwards the weights are
    sharded again or, on CPU, kept gathered for the next training forward, which trains as a
    single process does. Replicated ranks run no collective at all."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, 5, 20, 21, 22], [1, 5, 30], [1, 5, 31, 32, 33, 34, 35]]
    shards = [prompts[:2], prompts[2:]]  # uneven: the ranks finish at different times
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    config = make_config(tiny_path)
    config.generation.options["torch"] = TorchGenerationConfig(gather_weights_once=once)
    group = start_group(WORKER, (LAYOUTS[layout], context(config)))
    results = group.run_sharded("generate_counting_collectives", shards, params)
    modules = group.run_all("num_fsdp_modules")[0]
    # 4 decoder layers and the root; the root only; none.
    assert modules == {"shard-blocks": 5, "shard-model": 1, "replicate": 0}[layout]
    for (out, counts, sharded), shard in zip(results, shards, strict=True):
        if once:
            assert counts == {"all_gather": modules, "all_reduce": 0}
            assert sharded is (layout == "shard-blocks")
        else:
            # Every forward gathers each layer again (the root keeps its own: not all sharded),
            # and every decode step all-reduces a "done" flag (8 forwards unless all rows stop).
            assert counts["all_gather"] > 2 * modules and counts["all_reduce"] > 2
            assert sharded is False
        # The samples of a single process holding the same weights, seeded as that rank.
        single = TorchGenerator(
            model=AutoModelForCausalLM.from_pretrained(tiny_path).eval(),
            tokenizer=None,
            seed_offset=shards.index(shard),
            synchronize=False,
        )
        expected = single.generate(shard, params)
        assert out.token_ids == expected.token_ids
        for a, b in zip(out.logprobs, expected.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    # The step after a generation is the single-process step.
    batch = make_batch(8, seed=1)
    got = Policy.from_config(group, config.policy).train(batch, TokenMeanNLL())
    expected = local_policy(config).train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)


def test_a_step_without_gradients_is_refused(tiny_path):
    worker = local_worker(make_config(tiny_path))
    with pytest.raises(Exception, match="produced no gradient for the optimizer's parameters"):
        worker.optimizer_step()


def test_gloo_reduce_scatter_as_all_reduce_is_the_same_sum(tiny_path, start_group):
    options = DTensorConfig(data_parallel="shard")
    group = start_group(WORKER, (options, context(make_config(tiny_path))))
    for difference, installed in group.run_all("reduce_scatter_both_ways", 1000):
        assert difference == 0.0  # two addends: the same sum in either order
        assert installed


def test_on_policy_shortcut_takes_the_same_step_as_recomputed_prev_logprobs(tiny_path, start_group):
    """With one optimizer step per rollout, skipping the prev_logprobs pass (rho = 1 by
    construction) gives the update that recomputing them gives (rho = 1 up to rounding)."""
    from nrl_core.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss

    batch = make_batch(8, seed=9)
    batch["advantages"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    outcomes = {}
    for shortcut in (False, True):
        config = make_config(tiny_path, optimizer="sgd", lr=0.5, max_grad_norm=0.0)
        policy = group_policy(start_group, config, name=f"shortcut-{shortcut}")
        loss = ClippedPGLoss(ClippedPGConfig(is_correction="none", on_policy_shortcut=shortcut))
        step = Batch(dict(batch.tensors))
        if loss.needs_prev_logprobs:
            step["prev_logprobs"] = policy.get_logprobs(step)
        metrics = policy.train(step, loss)
        outcomes[shortcut] = (metrics, full_params(policy.group))
        policy.shutdown()
    (recomputed, params_recomputed), (skipped, params_skipped) = outcomes[False], outcomes[True]
    assert "prev_logprobs" not in batch
    assert skipped["ratio_max"] == skipped["ratio_min"] == 1.0
    assert recomputed["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert skipped["loss"] == pytest.approx(recomputed["loss"], rel=1e-5)
    assert skipped["grad_norm"] == pytest.approx(recomputed["grad_norm"], rel=1e-5)
    for key in params_recomputed:
        torch.testing.assert_close(
            params_skipped[key], params_recomputed[key], rtol=1e-5, atol=1e-7
        )


def test_checkpoint_round_trip_reference_and_export(tiny_path, start_group, tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_config(tiny_path, warmup=3)
    batch1, batch2 = make_batch(8, seed=3), make_batch(8, seed=4)
    policy = group_policy(start_group, config, name="a")
    initial_lp = policy.get_logprobs(batch1)
    first = policy.train(batch1, TokenMeanNLL())
    assert abs(first["lr"] - 1e-3 / 3) < 1e-12  # warm-up: step 1 of 3
    policy.save_checkpoint(str(tmp_path / "ckpt"))

    restored = group_policy(start_group, config, name="b")
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(policy.get_logprobs(batch2), restored.get_logprobs(batch2))
    # The next step (optimizer moments, scheduler position) is identical too.
    step_a = policy.train(batch2, TokenMeanNLL())
    step_b = restored.train(batch2, TokenMeanNLL())
    assert step_a == step_b and abs(step_a["lr"] - 2e-3 / 3) < 1e-12
    params_a, params_b = full_params(policy.group), full_params(restored.group)
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), key

    # The reference stays at the initial weights after training.
    ref_lp = restored.get_logprobs(batch1, reference=True)
    torch.testing.assert_close(ref_lp, initial_lp, rtol=0, atol=1e-6)
    trained_lp = restored.get_logprobs(batch1)
    assert (trained_lp - initial_lp).abs().max() > 1e-3

    # export_hf reloads through from_pretrained and computes the same logprobs.
    restored.export_hf(str(tmp_path / "hf"))
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


def test_reference_snapshot_follows_the_weights_it_was_taken_from(tiny_path, start_group, tmp_path):
    """``snapshot_reference`` (GRPO after a supervised warm-up) makes the current weights the
    frozen reference: reference logprobs equal the policy's then, and stay put after a step."""
    config = make_config(tiny_path)
    batch = make_batch(8, seed=8)
    policy = group_policy(start_group, config)
    initial = policy.get_logprobs(batch)
    policy.train(batch, TokenMeanNLL())
    trained = policy.get_logprobs(batch)
    assert (trained - initial).abs().max() > 1e-3
    policy.snapshot_reference(str(tmp_path / "reference"))
    assert (tmp_path / "reference" / "model.safetensors").exists()
    torch.testing.assert_close(
        policy.get_logprobs(batch, reference=True), trained, rtol=0, atol=1e-6
    )
    policy.train(batch, TokenMeanNLL())
    torch.testing.assert_close(
        policy.get_logprobs(batch, reference=True), trained, rtol=0, atol=1e-6
    )
    assert (policy.get_logprobs(batch) - trained).abs().max() > 1e-3


def test_tensor_parallel_matches_single_process(tiny_path, start_group):
    config = make_config(tiny_path)
    batch = make_batch(4, seed=5)
    stats = stats_for(batch)
    single = local_policy(config)
    expected_lp = single.get_logprobs(batch)
    expected = single.train(batch, TokenMeanNLL())
    # tp=2 on 2 ranks: one data-parallel shard, given to both tensor-parallel peers.
    options = DTensorConfig(tensor_parallel_size=2)
    group = start_group(WORKER, (options, context(config)))
    policy = Policy.from_config(group, config.policy)
    assert policy.dp_size == 1
    torch.testing.assert_close(policy.get_logprobs(batch), expected_lp, rtol=0, atol=1e-5)
    got = policy.train(batch, TokenMeanNLL())
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    assert got["tokens"] == stats.valid_tokens  # counted once, not once per TP peer


def test_tensor_parallel_shards_the_vocabulary(tiny_path, start_group):
    """Review m10: under TP each rank holds [.., V / tp] logits (old code: V on both), and the
    sharded logprobs, top-k, student logprobs and step equal one process's; the refit stream
    still carries the whole lm_head weight."""
    from nrl_core.losses.distillation import DistillationLoss, DistillationLossConfig

    config = make_config(tiny_path, temperature=0.7)  # the sharded path divides by T too
    batch = make_batch(4, seed=9)
    worker = local_worker(config)
    single = Policy.from_config(InProcessGroup(worker), config.policy)
    vocab, hidden = worker.model.lm_head.weight.shape
    group = start_group(WORKER, (DTensorConfig(tensor_parallel_size=2), context(config)))
    policy = Policy.from_config(group, config.policy)
    ids = batch["input_ids"][:2]
    widths = [shape[-1] for shape in group.run_all("materialised_logits_shape", ids)]
    assert widths == [vocab // 2, vocab // 2]
    torch.testing.assert_close(
        policy.get_logprobs(batch), single.get_logprobs(batch), atol=1e-5, rtol=0
    )
    tokens, values, top_ids = policy.get_topk_logprobs(batch, 5)
    want_tokens, want_values, want_ids = single.get_topk_logprobs(batch, 5)
    torch.testing.assert_close(tokens, want_tokens, rtol=0, atol=1e-5)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)
    assert torch.equal(top_ids, want_ids)
    # A distillation student: logprobs at the teacher's ids, with the graph, through the step.
    loss = DistillationLoss(DistillationLossConfig())
    # Shifted: a teacher other than the student itself (whose KL and gradient would be ~0).
    batch["teacher_topk_logprobs"], batch["teacher_topk_ids"] = values - 0.5, top_ids
    expected = single.train(batch, loss)
    got = policy.train(batch, loss)
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    head = full_params(group)["lm_head.weight"]
    assert head.shape == (vocab, hidden)
    torch.testing.assert_close(head, worker.model.lm_head.weight.detach(), rtol=0, atol=1e-5)


def test_tensor_parallel_generation_samples_from_the_whole_vocabulary(tiny_path, start_group):
    """Torch generation under TP (vocabulary-sharded logits, gathered at the last position)
    samples what one process samples, with the same logprobs."""
    config = make_config(tiny_path, temperature=0.7)
    prompts = [[1, 5, 20, 21, 22], [1, 5, 30]]
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=11)
    want = local_worker(config).generate(prompts, params)
    group = start_group(WORKER, (DTensorConfig(tensor_parallel_size=2), context(config)))
    for out in group.run_all("generate", prompts, params):  # TP peers take the same prompts
        assert out.token_ids == want.token_ids
        for got_lp, want_lp in zip(out.logprobs, want.logprobs, strict=True):
            torch.testing.assert_close(
                torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0
            )


def test_bfloat16_and_activation_checkpointing(tiny_path, start_group):
    batch = make_batch(4, seed=6)
    config = make_config(tiny_path)
    plain = group_policy(start_group, config, name="plain")
    checkpointed = DTensorConfig(activation_checkpointing=True, cpu_offload=True)
    ckpt = group_policy(start_group, config, checkpointed, name="ckpt")
    a = plain.train(batch, TokenMeanNLL())
    b = ckpt.train(batch, TokenMeanNLL())
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    bf16 = group_policy(
        start_group, make_config(tiny_path, precision="bfloat16"), DTensorConfig(), name="bf16"
    )
    c = bf16.train(batch, TokenMeanNLL())
    # bfloat16 compute: close to float32, not equal.
    assert abs(c["loss"] - a["loss"]) < 0.05 * abs(a["loss"]) and c["loss"] != a["loss"]
    buckets = bf16.group.run_all("bucket_list", 1 << 14)[0]
    assert len(buckets) > 1
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for t in bucket.values()]
        assert len(sizes) == 1 or sum(sizes) <= 1 << 14
        # Master weights stay float32 under the mixed-precision policy.
        assert all(t.dtype == torch.float32 for t in bucket.values())


def test_replicas_start_from_rank0s_weights_and_stay_equal(tiny_path, start_group):
    """Replicated ranks begin with one set of weights although each initialises new ones (LoRA
    adapters) from its own random stream, and after a step on different data they still hold
    the same weights: the averaged gradient, not each rank's own."""
    config = make_config(tiny_path)
    policy = group_policy(start_group, config, DTensorConfig(lora_rank=4))
    assert policy.group.run_all("is_sharded") == [False, False]
    full_params(policy.group)  # asserts the two ranks agree on the (merged) weights
    before = adapter_params(policy.group)  # ... and on the adapters
    random_init = [k for k in before if "lora_A" in k]  # lora_B starts at zero
    assert random_init and min(before[k].abs().max() for k in random_init) > 0
    policy.train(make_batch(8, seed=10), TokenMeanNLL())
    full_params(policy.group)
    after = adapter_params(policy.group)
    assert max((after[k] - before[k]).abs().max() for k in before if "lora_B" in k) > 1e-4


def test_auto_shards_what_the_host_cannot_replicate(tiny_path, start_group):
    config = make_config(tiny_path)
    group = start_group("_helpers:SmallHostWorker", (DTensorConfig(), context(config)))
    assert group.run_all("is_sharded") == [True, True]
    assert group.run_all("num_fsdp_modules") == [1, 1]


@pytest.mark.parametrize(
    ("saved", "loaded"), [("replicate", "shard-model"), ("shard-model", "replicate")]
)
def test_a_checkpoint_resumes_under_the_other_layout(
    tiny_path, start_group, tmp_path, saved, loaded
):
    """A checkpoint is the global weights and optimizer state, whichever way the ranks held
    them: resuming with replicated weights what sharded ones saved (or the reverse) takes the
    same next step."""
    config = make_config(tiny_path)
    first = group_policy(start_group, config, LAYOUTS[saved], name="saved")
    first.train(make_batch(8, seed=11), TokenMeanNLL())
    first.save_checkpoint(str(tmp_path / "ckpt"))
    second = group_policy(start_group, config, LAYOUTS[loaded], name="loaded")
    second.load_checkpoint(str(tmp_path / "ckpt"))
    batch = make_batch(8, seed=12)
    torch.testing.assert_close(
        second.get_logprobs(batch), first.get_logprobs(batch), rtol=0, atol=1e-6
    )
    a, b = first.train(batch, TokenMeanNLL()), second.train(batch, TokenMeanNLL())
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    params_a, params_b = full_params(first.group), full_params(second.group)
    for key in params_a:
        torch.testing.assert_close(params_b[key], params_a[key], rtol=1e-5, atol=1e-7)
