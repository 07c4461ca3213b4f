"""GPU tests of the megatron policy: Transformer Engine spec, TP=2 over NCCL, Megatron's
distributed optimizer, and refit into vLLM. None of these has run yet (no GPU so far); they
are written against the same APIs as the CPU tests and skip without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _megatron_helpers import HAVE_MEGATRON, NO_MEGATRON, TokenMeanNLL, make_batch

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
