"""A mixture of experts (the tiny Qwen3-MoE: 4 experts, top-2) in the megatron policy on CPU:
the HF <-> Megatron converter, Megatron's local MoE layer against transformers' forward, router
statistics, expert parallelism over 2 gloo ranks, export.

Tolerances, float32 on CPU: Megatron vs Hugging Face logprobs within 1e-5 absolute (observed
9.5e-7 logprobs, 4.2e-7 logits: the experts' outputs are summed in another order); the EP=2 step
vs one rank: loss and grad norm within 1e-5 relative, logprobs 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import requires_megatron
from test_megatron import WORKER, context, make_config, policy

from nrl_core.data import Batch
from nrl_core.testing.batches import TokenMeanNLL, make_batch
from nrl_core.testing.moe import transformers_router_metrics
from nrl_core.training import valid_token_mask

EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """The tiny Qwen3-MoE with every norm weight (the layers', the per-head q/k norms', the
    final one) and the routers drawn at random: transformers initialises norms to 1, which would
    hide a swapped or missing norm in the converter."""
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.tiny import tiny_model_path

    source = tiny_model_path(
        tmp_path_factory.mktemp("nrl-moe-cache"),
        arch="qwen3_moe",
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    path = tmp_path_factory.mktemp("nrl-moe") / "model"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def hf_state(path) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict (experts stacked): what the torch engine holds."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def hf_logprobs(path, batch: Batch) -> torch.Tensor:
    """``[B, T]`` logprobs of ``batch`` under transformers' own Qwen3-MoE (position 0 is 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    return torch.nn.functional.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


def moe_options(ep: int = 1):
    from nrl_megatron.config import MegatronConfig

    return MegatronConfig(expert_model_parallel_size=ep)


# -- the converter (pure torch) ----------------------------------------------------------------


def test_converter_round_trip_is_bit_exact_and_ep_shards_cover_each_expert_once(moe_path):
    from nrl_megatron.convert import (
        ModelShape,
        global_expert_name,
        hf_to_megatron,
        megatron_to_hf,
        megatron_to_hf_names,
        shard_for_ep,
    )
    from transformers import AutoConfig

    hf = hf_state(moe_path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(moe_path))
    assert (shape.num_experts, shape.num_experts_per_tok, shape.qk_norm) == (EXPERTS, TOP_K, True)
    mg = hf_to_megatron(hf, shape)
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    # Expert 3's fc1 is its [gate; up] rows of the stacked HF tensor, as Megatron fuses them.
    assert torch.equal(mg[expert], hf["model.layers.1.mlp.experts.gate_up_proj"][3])
    back = megatron_to_hf(mg, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    names = megatron_to_hf_names(shape)
    assert names.keys() == mg.keys()
    assert {n for hf_names in names.values() for n in hf_names} == set(hf)

    # EP=2: each rank keeps 2 experts renumbered from 0; together they hold each expert once.
    seen = []
    for ep_rank in range(2):
        local = shard_for_ep(mg, ep_rank, 2, shape)
        experts = [n for n in local if ".local_experts." in n]
        assert len(experts) == len([n for n in mg if ".local_experts." in n]) // 2
        for name in experts:
            full = global_expert_name(name, ep_rank, EXPERTS // 2)
            assert torch.equal(local[name], mg[full])
            seen.append(full)
    assert sorted(seen) == sorted(n for n in mg if ".local_experts." in n)


# -- Megatron-Core on gloo ranks -----------------------------------------------------------------


@requires_megatron
def test_moe_forward_matches_hugging_face(moe_path, pool1, start_group):
    ids = torch.randint(7, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    probe = start_group(pool1, "_megatron_helpers:ForwardProbe", (str(moe_path),), name="probe")
    megatron_logits, hf_logits = probe.run_all("logits", ids)[0]
    assert hf_logits.abs().max() > 0.05  # a real signal
    got, want = torch.log_softmax(megatron_logits, -1), torch.log_softmax(hf_logits, -1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@requires_megatron
def test_router_statistics_are_transformers_own_routing_of_the_step(moe_path, pool1, start_group):
    """One step of two micro batches (padded rows of different lengths) in the megatron policy:
    ``moe/*`` are the routing of the step's real tokens as transformers reports it, at the
    weights the step started from; the step also trains (logprobs equal HF's before)."""
    config = make_config(moe_path, mbs=4)
    batch = make_batch(8, seed=1)
    expected = transformers_router_metrics(moe_path, batch)
    megatron = policy(start_group(pool1, WORKER, (moe_options(), context(config))), config)
    valid = valid_token_mask(batch, batch["input_ids"].shape[1])  # the policy zeroes padding
    torch.testing.assert_close(
        megatron.get_logprobs(batch) * valid,
        hf_logprobs(moe_path, batch) * valid,
        rtol=0,
        atol=1e-5,
    )
    got = megatron.train(batch, TokenMeanNLL())
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, got[key], value)
    # Not a degenerate routing: some experts get more than others, none all tokens.
    assert 0 < got["moe/load_cv"] < (EXPERTS / TOP_K - 1) ** 0.5
    assert 1 < got["moe/max_load"] < EXPERTS / TOP_K


@requires_megatron
def test_router_statistics_run_no_second_router_gemm(moe_path, pool1, start_group):
    """Review m3: the statistics need the softmax over all experts, which TopKRouter does not
    return; they took it from a second ``gating`` GEMM per layer and forward. They reuse the
    logits the router routed: one GEMM per MoE layer, and still statistics to report."""
    ids = torch.randint(7, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    probe = start_group(pool1, "_megatron_helpers:ForwardProbe", (str(moe_path),), name="gemms")
    calls, layers, metrics = probe.run_all("router_gemms", ids)[0]
    assert layers >= 1
    assert calls == layers
    assert 0 < metrics["moe/load_cv"] < (EXPERTS / TOP_K - 1) ** 0.5


@pytest.mark.slow  # 2 gloo ranks: 30 s alone on the shared 2-core machine (4 s on warm pools)
@requires_megatron
def test_expert_parallel_two_ranks_match_one_rank(moe_path, tmp_path, pool1, pool2, start_group):
    """EP=2 on 2 gloo ranks (each holds 2 experts; data parallel 2, allgather dispatcher) vs one
    rank: the same loss, grad norm and logprobs after one step; its refit stream and export
    hold every expert exactly once, in Hugging Face names (the torch engine's parameters)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = make_config(moe_path)
    batch = make_batch(8, seed=2)
    single = policy(
        start_group(pool1, WORKER, (moe_options(), context(config)), name="single"), config
    )
    want_lp = single.get_logprobs(batch)
    want = single.train(batch, TokenMeanNLL())
    want_after = single.get_logprobs(batch)

    group = start_group(pool2, WORKER, (moe_options(2), context(config)))
    checkpoint = hf_state(moe_path)
    for buckets in group.run_all("state_dict_buckets", 1 << 16):
        names = [k for bucket in buckets for k in bucket]
        assert sorted(names) == sorted(checkpoint)  # each name once (no expert twice)
        exported = {k: v for bucket in buckets for k, v in bucket.items()}
        for name, tensor in checkpoint.items():
            assert torch.equal(exported[name], tensor), name

    ep = policy(group, config)
    torch.testing.assert_close(ep.get_logprobs(batch), want_lp, rtol=0, atol=1e-5)
    got = ep.train(batch, TokenMeanNLL())
    for key in ("loss", "nll_sum", "tokens", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    after = ep.get_logprobs(batch)
    assert (after - want_lp).abs().max() > 1e-4  # the step changed the model
    torch.testing.assert_close(after, want_after, rtol=0, atol=1e-5)

    # Each rank's checkpoint file holds its own experts: a resume takes the same next step.
    ep.save_checkpoint(str(tmp_path / "ckpt"))
    second = ep.train(batch, TokenMeanNLL())
    ep.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(ep.get_logprobs(batch), after, rtol=0, atol=0)
    assert ep.train(batch, TokenMeanNLL()) == second
    ep.load_checkpoint(str(tmp_path / "ckpt"))

    ep.export_hf(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # The published per-expert layout, every expert of every layer once.
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    assert len([k for k in keys if ".mlp.experts." in k]) == 4 * EXPERTS * 3
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    valid = valid_token_mask(batch, batch["input_ids"].shape[1])
    torch.testing.assert_close(
        hf_logprobs(tmp_path / "hf", batch) * valid, after * valid, rtol=0, atol=1e-5
    )


@pytest.mark.gpu_sim
@requires_megatron
@pytest.mark.parametrize("ep", [1, 2])
def test_refit_stream_for_vllm_and_sglang_is_the_checkpoint_file(
    moe_path, ep, request, start_group
):
    """vLLM's and SGLang's Qwen3-MoE loaders take the checkpoint's per-expert tensors
    (``mlp.experts.{e}.gate_proj.weight``) and cannot place transformers' stacked
    ``mlp.experts.gate_up_proj``: in the layout their options declare (inherited from
    ``EngineOptions``) the refit stream is the saved ``model.safetensors``, name for name and
    value for value, every expert of every layer once, on one rank and with the experts split
    over two (each rank's stream is the whole model)."""
    import re

    from safetensors import safe_open

    from nrl_core.config.schema import EngineOptions

    config = make_config(moe_path)
    pool = request.getfixturevalue(f"pool{ep}")
    group = start_group(pool, WORKER, (moe_options(ep), context(config)))
    with safe_open(str(moe_path / "model.safetensors"), "pt") as f:
        want = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    streams = group.run_all("state_dict_buckets", 1 << 16, EngineOptions.weight_layout)
    assert len(streams) == ep
    for buckets in streams:
        sent = [item for bucket in buckets for item in bucket.items()]
        names = [name for name, _ in sent]
        assert sorted(names) == sorted(want)  # each name once
        experts = [name for name in names if ".mlp.experts." in name]
        expert_name = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"
        assert all(re.fullmatch(expert_name, name) for name in experts)
        assert len(experts) == 4 * EXPERTS * 3  # 4 layers, each expert's 3 projections
        for name, tensor in sent:
            assert torch.equal(tensor, want[name].to(tensor.dtype)), name


@requires_megatron
def test_ep_that_does_not_divide_the_experts_is_refused(moe_path, pool1, start_group):
    """A one-line reason, before any weight is loaded (tp=2 with MoE is refused the same way)."""
    from nrl_megatron.convert import ModelShape
    from nrl_megatron.model import MegatronModelError, moe_settings
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(moe_path))
    with pytest.raises(MegatronModelError, match="does not divide the 4 experts"):
        moe_settings(shape, ep=3)
    with pytest.raises(MegatronModelError, match="tensor_model_parallel_size=1"):
        moe_settings(shape, tp=2)


@requires_megatron
def test_pipeline_stages_of_a_mixture_of_experts_are_refused(moe_path, pool2, start_group):
    """PP with MoE is not wired (the stage gather and the expert gather together): one line."""
    from nrl_megatron.config import MegatronConfig

    options = MegatronConfig(pipeline_model_parallel_size=2)
    with pytest.raises(
        RuntimeError, match=r"MegatronSetupError: pipeline parallelism with a mixture"
    ):
        start_group(pool2, WORKER, (options, context(make_config(moe_path))))


@pytest.mark.slow  # two worker groups on 2 gloo ranks
@requires_megatron
def test_expert_parallel_generation_runs_ranks_in_lockstep(moe_path, pool1, pool2, start_group):
    """Colocated generation under EP=2: the ranks hold different prompts (5 = two chunks of 4 on
    rank 0, one prompt on rank 1) and the MoE layers' dispatcher is collective over both, so the
    rank with less work keeps joining the forwards; greedy output equals one rank's."""
    from nrl_core.interfaces import SamplingParams

    config = make_config(moe_path)
    prompts = [[5, 9, 12], [7, 8], [20, 21, 22, 23], [30], [11, 40, 41], [50, 51]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    single = start_group(pool1, WORKER, (moe_options(), context(config)), name="single")
    want = single.run_all("generate", prompts, params)[0].token_ids

    group = start_group(pool2, WORKER, (moe_options(2), context(config)))
    shards = [prompts[:5], prompts[5:]]
    # Each rank its own prompts, as the core's data-parallel mapping gives them.
    outs = group.pool._call("call", group.key, [("generate", (s, params)) for s in shards])
    assert outs[0].token_ids + outs[1].token_ids == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@requires_megatron
def test_moe_on_one_gpu_matches_hugging_face(moe_path, pool1, start_group):
    """The GPU path that CPU cannot build (not run yet: no GPU so far): Megatron's ``alltoall``
    dispatcher (a ``torch.cuda.Stream`` in its constructor), its DDP with the experts in its
    buffers and the distributed optimizer, float32 on one GPU (EP=1). Logprobs equal
    transformers' before the step, the router statistics equal transformers' routing, and the
    step trains."""
    config = make_config(moe_path, mbs=4)
    batch = make_batch(8, seed=1)
    expected = transformers_router_metrics(moe_path, batch)
    megatron = policy(start_group(pool1, WORKER, (moe_options(), context(config))), config)
    valid = valid_token_mask(batch, batch["input_ids"].shape[1])
    before = megatron.get_logprobs(batch)
    torch.testing.assert_close(
        before * valid, hf_logprobs(moe_path, batch) * valid, rtol=0, atol=1e-4
    )
    got = megatron.train(batch, TokenMeanNLL())
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-4 * max(1.0, abs(value)), (key, got[key], value)
    assert torch.isfinite(torch.tensor(got["grad_norm"])) and got["grad_norm"] > 0
    assert (megatron.get_logprobs(batch) - before).abs().max() > 1e-4
