"""GPU tests of the megatron policy: Transformer Engine spec, TP=2 over NCCL, Megatron's
distributed optimizer, and refit into vLLM. None of these has run yet (no GPU so far); they
are written against the same APIs as the CPU tests and skip without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _megatron_helpers import HAVE_MEGATRON, NO_MEGATRON

from nrl_core.testing.batches import TokenMeanNLL, make_batch

if not HAVE_MEGATRON:
    pytest.skip(NO_MEGATRON, allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA", allow_module_level=True)

from test_megatron import WORKER, context, make_config, megatron_options

from nrl_core.policy import Policy

pytestmark = pytest.mark.gpu

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAVE_TE, reason="transformer-engine not installed (extra `te`)")
def test_te_spec_logprobs_match_local_spec(tiny_path, pool1, start_group):
    from nrl_megatron.config import MegatronConfig

    config = make_config(tiny_path)
    batch = make_batch(4, seed=5)
    local = start_group(pool1, WORKER, (megatron_options(), context(config)), name="local")
    want = Policy.from_config(local, config.policy).get_logprobs(batch)
    local.shutdown()
    te = start_group(
        pool1, WORKER, (MegatronConfig(transformer_engine=True), context(config)), name="te"
    )
    got = Policy.from_config(te, config.policy).get_logprobs(batch)
    # TE kernels (fused attention, fused layernorm-linear) reorder reductions: 1e-3 in float32.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    # The exported HF names come back from the TE layout (layer norms inside linear_qkv/fc1).
    names = {k for b in te.run_all("state_dict_buckets", 1 << 20)[0] for k in b}
    assert "model.layers.0.input_layernorm.weight" in names


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_distributed_optimizer_matches_one_gpu(tiny_path, pool1, pool2, start_group):
    config = make_config(tiny_path)
    batch = make_batch(8, seed=6)
    single = start_group(pool1, WORKER, (megatron_options(), context(config)), name="single")
    want = Policy.from_config(single, config.policy).train(batch, TokenMeanNLL())
    group = start_group(pool2, WORKER, (megatron_options(2), context(config)))
    got = Policy.from_config(group, config.policy).train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per stage)")
def test_pp2_megatron_schedule_matches_one_gpu(tiny_path, pool1, pool2, start_group):
    """Two pipeline stages over NCCL through Megatron-Core's schedule, unchanged (no CPU
    adapter), with Megatron's DDP and distributed optimizer: the same step as one GPU."""
    from nrl_megatron.config import MegatronConfig

    config = make_config(tiny_path, mbs=2)
    batch = make_batch(8, seed=6)
    single = start_group(pool1, WORKER, (megatron_options(), context(config)), name="single")
    one = Policy.from_config(single, config.policy)
    want_lp = one.get_logprobs(batch)
    want = one.train(batch, TokenMeanNLL())
    group = start_group(
        pool2, WORKER, (MegatronConfig(pipeline_model_parallel_size=2), context(config))
    )
    two = Policy.from_config(group, config.policy)
    torch.testing.assert_close(two.get_logprobs(batch), want_lp, rtol=0, atol=1e-3)
    got = two.train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


@pytest.mark.skipif(
    not HAVE_VLLM,
    reason=(
        "needs vllm next to megatron-core; uv.lock keeps them in separate environments, so this "
        "runs only in a hand-built env (the cross-env refit belongs in the core's Ray tests)"
    ),
)
def test_refit_into_vllm_gives_same_greedy_tokens(tiny_path, tmp_path, pool1, start_group):
    """Megatron -> HF-named buckets -> nrl-vllm's update_weights == a fresh vLLM on export."""
    from nrl_vllm.config import VllmConfig
    from nrl_vllm.worker import VllmGenerationWorker

    from nrl_core.interfaces import SamplingParams

    config = make_config(tiny_path)
    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    batch = make_batch(8, seed=7)
    Policy.from_config(group, config.policy).train(batch, TokenMeanNLL())
    group.run_all("export_hf", str(tmp_path / "hf"))
    buckets = group.run_all("state_dict_buckets", 1 << 20)[0]

    engine = VllmGenerationWorker(VllmConfig(), context(config))
    engine.update_weights(iter(buckets))
    exported_config = make_config(tmp_path / "hf")
    fresh = VllmGenerationWorker(VllmConfig(), context(exported_config))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [[1, 20, 21, 22], [1, 30, 31]]
    assert engine.generate(prompts, params).token_ids == fresh.generate(prompts, params).token_ids


def _bf16(config):
    import attrs

    return attrs.evolve(config, policy=attrs.evolve(config.policy, precision="bfloat16"))


def test_resume_restores_the_distributed_optimizer_state(tiny_path, tmp_path, pool1, start_group):
    """A checkpoint carries Adam's moments and the float32 main weights (the distributed
    optimizer's parameter state, ``distopt_pp0_tp0_ep0.pt``): a NEW worker that loads it takes the
    same next step as the worker that saved it. With the moments lost (the bug), Adam's first
    step after the resume is about ``lr * sign(grad)`` and the weights would differ."""
    config = _bf16(make_config(tiny_path))
    batch = make_batch(8, seed=8)
    saver = Policy.from_config(
        start_group(pool1, WORKER, (megatron_options(), context(config)), name="saver"),
        config.policy,
    )
    saver.train(batch, TokenMeanNLL())
    saver.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "distopt_pp0_tp0_ep0.pt").is_file()
    at_save = saver.get_logprobs(batch)
    want = saver.train(batch, TokenMeanNLL())
    want_lp = saver.get_logprobs(batch)
    assert (want_lp - at_save).abs().max() > 1e-3  # the second step moved the model

    resumed = Policy.from_config(
        start_group(pool1, WORKER, (megatron_options(), context(config)), name="resumed"),
        config.policy,
    )
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(resumed.get_logprobs(batch), at_save, rtol=0, atol=0)
    got = resumed.train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    torch.testing.assert_close(resumed.get_logprobs(batch), want_lp, rtol=0, atol=1e-3)


def _gpu_bytes(_worker=None) -> int:
    """GPU memory held by tensors in this (spawned) process."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _state_bytes(worker) -> int:
    """What offloading must free at least: each parameter in its dtype, its float32 gradient
    (``grad_reduce_in_fp32``), float32 main weight and two Adam moments (one rank: the
    distributed optimizer's shard is everything)."""
    return sum(p.numel() * (p.element_size() + 4 * 4) for p in worker.module.parameters())


def test_offload_frees_the_gpu_and_onload_resumes_exactly(tiny_path, pool1, start_group):
    """offload(["optimizer"]) then (["weights"]) frees most of the policy's GPU memory;
    onload() brings everything back and the next step equals that of a never-offloaded
    policy."""
    config = _bf16(make_config(tiny_path))
    batch = make_batch(8, seed=9)
    plain_group = start_group(pool1, WORKER, (megatron_options(), context(config)), name="plain")
    plain = Policy.from_config(plain_group, config.policy)
    plain.train(batch, TokenMeanNLL())
    want = plain.train(batch, TokenMeanNLL())
    want_lp = plain.get_logprobs(batch)
    plain_group.shutdown()  # the same process: its memory must not count below

    group = start_group(pool1, WORKER, (megatron_options(), context(config)), name="offloaded")
    policy = Policy.from_config(group, config.policy)
    policy.train(batch, TokenMeanNLL())
    state = group.run_all(_state_bytes)[0]
    held = group.run_all(_gpu_bytes)[0]
    group.run_all("offload", ["optimizer"])
    group.run_all("offload", ["weights"])
    left = group.run_all(_gpu_bytes)[0]
    assert held - left >= 0.9 * state, (held, left, state)
    group.run_all("onload")
    assert group.run_all(_gpu_bytes)[0] >= held - 0.1 * state
    got = policy.train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    torch.testing.assert_close(policy.get_logprobs(batch), want_lp, rtol=0, atol=1e-3)
