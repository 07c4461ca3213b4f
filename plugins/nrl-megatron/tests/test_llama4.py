"""Llama 4 in the megatron policy on CPU (issue 48 item 4): the tiny Llama 4 text model (4
layers: three chunked-attention RoPE layers with the q/k L2 norm, then one full-attention NoPE
layer with the attention temperature tuning; 4 experts, top-1 through a sigmoid weighting the
expert's input, a shared expert) through the HF <-> Megatron converter, Megatron-Core's local
layers with nrl's attention and grouped experts against transformers' forward, one training
step against the dtensor policy, packed against padded training, and a refit into the torch
engine.

The tiny model exercises each feature at the test lengths: 8-token chunks under 21- to
60-token sequences, and a ``floor_scale`` of 2 so that the temperature tuning scales queries
from position 1 on (the builder's 8 changes only the last two thirds of a 21-token sequence,
the published 8192 nothing).

Tolerances, float32 on CPU, as test_gpt_oss.py's: Megatron vs Hugging Face logits within 1e-5
absolute; one step vs dtensor: loss and grad norm within 1e-5 relative, logprobs 1e-5 absolute
before the step and 1e-4 after.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import requires_megatron
from test_megatron import (
    WORKER,
    assert_one_step_matches_dtensor,
    assert_refit_into_the_torch_engine_gives_the_trainers_logprobs,
    context,
    make_config,
    megatron_options,
    policy,
)

from nrl_core.testing.batches import TokenMeanNLL, make_batch

EXPERTS, CHUNK, FLOOR_SCALE = 4, 8, 2


@pytest.fixture(scope="module")
def llama4_path(tmp_path_factory):
    """The tiny Llama 4 (top-1, 8-token chunks, ``floor_scale`` 2) with its RMSNorm weights
    drawn around 1 and its routers widened: transformers initialises norms to 1, which would
    hide a swapped one in the converter, and routers of std 0.02 give every token a sigmoid
    score near 0.5, which would hide the score applied to the wrong side of the expert."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.testing.tiny import tiny_model_path

    source = tiny_model_path(
        tmp_path_factory.mktemp("nrl-llama4-cache"),
        arch="llama4",
        num_experts=EXPERTS,
        num_experts_per_tok=1,
        attention_chunk_size=CHUNK,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.floor_scale = FLOOR_SCALE
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * noise)
            elif name.endswith("router.weight"):
                param.copy_(0.5 * noise)
    path = tmp_path_factory.mktemp("nrl-llama4") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def hf_state(path) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict (experts stacked): what the torch engine holds."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


# -- the converter (pure torch) ------------------------------------------------------------------


def test_llama4_tiny_model_exercises_each_feature(llama4_path):
    """What the comparisons below can only catch if the model has it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama4_path)
    assert config.model_type == "llama4_text"
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert config.no_rope_layers == [1, 1, 1, 0]  # 1: RoPE; the last layer is NoPE
    assert config.attention_chunk_size == CHUNK and config.use_qk_norm
    assert config.attn_temperature_tuning and config.floor_scale == FLOOR_SCALE
    assert config.num_experts_per_tok == 1 and config.moe_layers == [0, 1, 2, 3]


def test_llama4_round_trip_is_bit_exact_and_experts_are_transposed(llama4_path):
    from nrl_megatron.convert import (
        ModelShape,
        hf_to_megatron,
        megatron_to_hf,
        megatron_to_hf_names,
    )
    from transformers import AutoConfig

    hf = hf_state(llama4_path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(llama4_path))
    assert (shape.num_experts, shape.num_experts_per_tok) == (EXPERTS, 1)
    assert shape.shared_expert_size > 0 and not shape.qkv_bias and not shape.linear_bias
    mg = hf_to_megatron(hf, shape)
    # Expert 3 of layer 1: transformers' input-major [hidden, 2w], gate columns then up ones;
    # Megatron's fc1 is [gate; up] rows of [2w, hidden].
    layer = "model.layers.1.feed_forward."
    expert = "decoder.layers.1.mlp.experts.local_experts.3."
    gate_up = hf[layer + "experts.gate_up_proj"][3]
    width = gate_up.shape[1] // 2
    assert torch.equal(mg[expert + "linear_fc1.weight"][:width], gate_up[:, :width].t())
    assert torch.equal(mg[expert + "linear_fc1.weight"][width:], gate_up[:, width:].t())
    assert torch.equal(mg[expert + "linear_fc2.weight"], hf[layer + "experts.down_proj"][3].t())
    shared = "decoder.layers.1.mlp.shared_experts."
    fc1 = mg[shared + "linear_fc1.weight"]
    assert torch.equal(fc1[: fc1.shape[0] // 2], hf[layer + "shared_expert.gate_proj.weight"])
    assert torch.equal(fc1[fc1.shape[0] // 2 :], hf[layer + "shared_expert.up_proj.weight"])
    assert torch.equal(
        mg[shared + "linear_fc2.weight"], hf[layer + "shared_expert.down_proj.weight"]
    )
    assert torch.equal(mg["decoder.layers.1.mlp.router.weight"], hf[layer + "router.weight"])

    back = megatron_to_hf(mg, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    names = megatron_to_hf_names(shape)
    assert names.keys() == mg.keys()
    assert {n for hf_names in names.values() for n in hf_names} == set(hf)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok=2"),
        ({"moe_layers": [1, 3]}, "dense layers between the MoE ones"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_llama4_layouts_megatron_does_not_reproduce_are_refused_in_one_line(
    change, message, llama4_path
):
    """Top-k > 1 (Megatron weights the experts' input for top-1 only), dense layers between
    the MoE ones (Llama 4 Maverick's ``interleave_moe_layer_step=2``) and attention biases."""
    from nrl_megatron.convert import ConversionError, ModelShape
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama4_path)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ConversionError, match=message) as caught:
        ModelShape.from_hf_config(config)
    assert "\n" not in str(caught.value) and "policy.backend=dtensor" in str(caught.value)


# -- Megatron-Core on gloo ranks -----------------------------------------------------------------


def _ids() -> torch.Tensor:
    ids = torch.randint(7, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    assert ids.shape[1] > 2 * CHUNK  # three chunks on the chunked layers
    return ids


@requires_megatron
def test_llama4_forward_matches_hugging_face(llama4_path, pool1, start_group):
    probe = start_group(pool1, "_megatron_helpers:ForwardProbe", (str(llama4_path),), name="p")
    assert probe.run_all("unloaded")[0] == []  # every Megatron parameter came from the file
    megatron_logits, hf_logits = probe.run_all("logits", _ids())[0]
    assert hf_logits.abs().max() > 0.05  # a real signal
    torch.testing.assert_close(megatron_logits, hf_logits, rtol=0, atol=1e-5)


@requires_megatron
@pytest.mark.parametrize("dropped", ["no_chunks", "no_temperature", "no_qk_norm"])
def test_llama4_forward_negative_controls_differ(dropped, llama4_path, pool1, start_group):
    """Proves the comparison above can fail: the same model without the chunk mask (every
    layer full), without the temperature tuning of its NoPE layer or without the q/k L2 norm
    of its RoPE layers gives other logits."""
    probe = start_group(
        pool1, "_megatron_helpers:ForwardProbe", (str(llama4_path), dropped), name=dropped
    )
    megatron_logits, hf_logits = probe.run_all("logits", _ids())[0]
    assert (megatron_logits - hf_logits).abs().max() > 1e-3


@requires_megatron
def test_llama4_train_step_matches_dtensor(llama4_path, pool1, start_group):
    assert_one_step_matches_dtensor(make_config(llama4_path), pool1, start_group)


@requires_megatron
def test_llama4_refit_into_the_torch_engine_gives_the_trainers_logprobs(
    llama4_path, pool1, start_group
):
    # Prompts of one length: the torch engine left-pads shorter prompts, and transformers'
    # temperature tuning counts positions from the padding, not from position_ids
    # (transformers 5.24 ``Llama4TextAttention``: ``arange`` over the padded row), so a
    # left-padded row is off its unpadded self whatever the weights (logits 4.7e-4 apart with
    # 5 pads at floor_scale 8, 4.8e-7 with the tuning off). Each prompt and its continuation
    # cross two chunk boundaries.
    prompts = [[5, 9, 12, 30, 31, 40, 41, 42, 43, 44], [7, 8] * 5, list(range(20, 30))]
    assert_refit_into_the_torch_engine_gives_the_trainers_logprobs(
        make_config(llama4_path), prompts, pool1, start_group
    )


@requires_megatron
def test_llama4_parallel_layouts_that_are_not_wired_are_refused(llama4_path):
    """Tensor parallelism over MoE layers (expert tensor parallelism) and the Transformer
    Engine spec (its attention would need the chunks, the NoPE temperature and the L2 norm
    mapped too) are refused in one line each."""
    from nrl_megatron.model import MegatronModelError, build_gpt_model, transformer_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama4_path)
    with pytest.raises(MegatronModelError, match="tensor_model_parallel_size=1") as caught:
        transformer_config(config, tp=2)
    assert "\n" not in str(caught.value)
    with pytest.raises(MegatronModelError, match="transformer_engine=false"):
        build_gpt_model(config, None, transformer_engine=True)


@requires_megatron
def test_llama4_packed_training_matches_padded(llama4_path, pool1, start_group):
    """Packed micro batches (THD: the chunks and the temperature tuning counted per sample by
    :class:`SDPAttention`'s packed path, RoPE restarting at every boundary) give the padded
    path's logprobs, metrics and update (rel. 1e-5, as test_packing.py for Llama), with
    samples spanning several chunks."""
    from safetensors.torch import load_file
    from test_packing import LOSSES, assert_same, long_tailed_batch, run

    initial = load_file(str(llama4_path / "model.safetensors"))
    batch = long_tailed_batch(8, seed=3)
    assert batch["input_ids"].shape[1] > 4 * CHUNK
    loss = LOSSES["clipped_pg-token_mean"]
    expected = run(pool1, start_group, llama4_path, batch, loss(), packing=False, name="pad")
    got = run(pool1, start_group, llama4_path, batch, loss(), packing=True, name="pack")
    assert_same(got, expected, initial, "llama4")


@requires_megatron
def test_llama4_checkpoint_layout_stream_and_export_are_the_checkpoint(
    llama4_path, tmp_path, pool1, start_group
):
    """The refit stream in the layout vLLM and SGLang load (``EngineOptions.weight_layout``)
    and ``export_hf`` are the saved ``model.safetensors``, name for name and bit for bit, and
    the export loads in ``from_pretrained`` as a Llama 4."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nrl_core.config.schema import EngineOptions

    config = make_config(llama4_path)
    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    want = load_file(str(llama4_path / "model.safetensors"))
    buckets = group.run_all("state_dict_buckets", 1 << 16, EngineOptions.weight_layout)[0]
    sent = [item for bucket in buckets for item in bucket.items()]
    assert sorted(name for name, _ in sent) == sorted(want)  # each name once
    for name, tensor in sent:
        assert torch.equal(tensor, want[name]), name
    group.run_all("export_hf", str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(exported[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(model).__name__ == "Llama4ForCausalLM"


@pytest.mark.slow  # 2 gloo ranks, as test_moe.py's EP=2 test
@requires_megatron
def test_llama4_expert_parallel_two_ranks_match_one_rank(llama4_path, pool1, pool2, start_group):
    """EP=2 on 2 gloo ranks (2 experts each, the shared expert and the router replicated;
    allgather dispatcher, the sigmoid score applied on each gathered token's input) vs one
    rank: the same logprobs before and after one step, loss and grad norm; each rank's refit
    stream holds every checkpoint tensor once, bit for bit."""
    from test_moe import moe_options

    config = make_config(llama4_path)
    batch = make_batch(8, seed=2)
    single = policy(
        start_group(pool1, WORKER, (moe_options(), context(config)), name="single"), config
    )
    want_lp = single.get_logprobs(batch)
    want = single.train(batch, TokenMeanNLL())
    want_after = single.get_logprobs(batch)

    group = start_group(pool2, WORKER, (moe_options(2), context(config)))
    checkpoint = hf_state(llama4_path)
    for buckets in group.run_all("state_dict_buckets", 1 << 16):
        sent = {k: v for bucket in buckets for k, v in bucket.items()}
        assert sorted(k for bucket in buckets for k in bucket) == sorted(checkpoint)
        for name, tensor in checkpoint.items():
            assert torch.equal(sent[name], tensor), name

    ep = policy(group, config)
    torch.testing.assert_close(ep.get_logprobs(batch), want_lp, rtol=0, atol=1e-5)
    got = ep.train(batch, TokenMeanNLL())
    for key in ("loss", "nll_sum", "tokens", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    after = ep.get_logprobs(batch)
    assert (after - want_lp).abs().max() > 1e-4  # the step changed the model
    torch.testing.assert_close(after, want_after, rtol=0, atol=1e-5)
