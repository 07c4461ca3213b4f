"""gpt-oss in the megatron policy on CPU (issue 48 item 4): the tiny gpt-oss (4 layers
alternating an 8-token sliding window and full attention, a learned sink per head, q/k/v/o
biases, YaRN RoPE, 4 biased experts, top-2, the clamped SwiGLU) through the HF <-> Megatron
converter, Megatron-Core's local layers with nrl's attention and grouped experts against
transformers' forward, one training step against the dtensor policy, and a refit into the
torch engine.

Tolerances, float32 on CPU: Megatron vs Hugging Face logits within 1e-5 absolute (the
attention runs as explicit matrix products in another order than transformers' eager one);
one step vs dtensor: loss and grad norm within 1e-5 relative, logprobs 1e-5 absolute before
the step and 1e-4 after (as test_megatron's dense comparison).
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
)

EXPERTS, TOP_K, WINDOW = 4, 2, 8


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory):
    """The tiny gpt-oss with every 1-D parameter drawn at random (norms around 1; sinks, biases
    of q/k/v/o, router and experts around 0 with a visible spread) and the routers widened:
    transformers initialises norms to 1 and the experts' and o_proj's biases to 0, which would
    hide a missing or swapped one in the converter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.testing.tiny import tiny_model_path

    source = tiny_model_path(
        tmp_path_factory.mktemp("nrl-gpt-oss-cache"),
        arch="gpt_oss",
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * noise)
            elif name.endswith(("sinks", "bias")) or name.endswith("router.weight"):
                param.copy_(0.5 * noise)
    path = tmp_path_factory.mktemp("nrl-gpt-oss") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def hf_state(path) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict (experts stacked): what the torch engine holds."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


# -- the converter (pure torch) ------------------------------------------------------------------


def test_gpt_oss_round_trip_is_bit_exact_and_experts_are_deinterleaved(gpt_oss_path):
    from nrl_megatron.convert import (
        ModelShape,
        hf_to_megatron,
        megatron_to_hf,
        megatron_to_hf_names,
    )
    from transformers import AutoConfig

    hf = hf_state(gpt_oss_path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(gpt_oss_path))
    assert (shape.num_experts, shape.num_experts_per_tok) == (EXPERTS, TOP_K)
    assert shape.attention_sinks and shape.linear_bias and shape.qkv_bias
    mg = hf_to_megatron(hf, shape)
    # Expert 3 of layer 1: transformers interleaves gate and up columns of an input-major
    # [hidden, 2w]; Megatron's fc1 is [gate; up] rows of [2w, hidden].
    layer = "model.layers.1.mlp.experts."
    expert = "decoder.layers.1.mlp.experts.local_experts.3."
    gate_up, bias = hf[layer + "gate_up_proj"][3], hf[layer + "gate_up_proj_bias"][3]
    width = gate_up.shape[1] // 2
    assert torch.equal(mg[expert + "linear_fc1.weight"][:width], gate_up[:, 0::2].t())
    assert torch.equal(mg[expert + "linear_fc1.weight"][width:], gate_up[:, 1::2].t())
    assert torch.equal(mg[expert + "linear_fc1.bias"][width:], bias[1::2])
    assert torch.equal(mg[expert + "linear_fc2.weight"], hf[layer + "down_proj"][3].t())
    assert torch.equal(mg[expert + "linear_fc2.bias"], hf[layer + "down_proj_bias"][3])
    sinks = "decoder.layers.2.self_attention.core_attention.softmax_offset"
    assert torch.equal(mg[sinks], hf["model.layers.2.self_attn.sinks"])

    back = megatron_to_hf(mg, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    names = megatron_to_hf_names(shape)
    assert names.keys() == mg.keys()
    assert {n for hf_names in names.values() for n in hf_names} == set(hf)


def test_gpt_oss_without_attention_biases_is_refused_in_one_line(gpt_oss_path):
    from nrl_megatron.convert import ConversionError, ModelShape
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gpt_oss_path)
    config.attention_bias = False
    with pytest.raises(ConversionError, match="attention_bias=False") as caught:
        ModelShape.from_hf_config(config)
    assert "\n" not in str(caught.value) and "policy.backend=dtensor" in str(caught.value)


def test_yarn_frequencies_are_transformers_own(gpt_oss_path):
    """:func:`yarn_inv_freq` against transformers' YaRN for gpt-oss's (``truncate=False``) and
    the default rounding (``truncate`` absent)."""
    pytest.importorskip("megatron.core", reason="nrl_megatron.model imports megatron-core")
    from nrl_megatron.model import yarn_inv_freq
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(gpt_oss_path)
    for truncate in (False, None):
        if truncate is None:
            config.rope_parameters.pop("truncate", None)
        want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        got, factor = yarn_inv_freq(config)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert factor == pytest.approx(want_factor, rel=1e-12)
    assert factor > 1.3  # 0.1 ln(32) + 1: a factor that matters


# -- Megatron-Core on gloo ranks -----------------------------------------------------------------


@requires_megatron
def test_gpt_oss_forward_matches_hugging_face(gpt_oss_path, pool1, start_group):
    ids = torch.randint(7, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    assert ids.shape[1] > 2 * WINDOW  # the windowed layers see less than the full ones
    probe = start_group(pool1, "_megatron_helpers:ForwardProbe", (str(gpt_oss_path),), name="p")
    assert probe.run_all("unloaded")[0] == []  # every Megatron parameter came from the file
    megatron_logits, hf_logits = probe.run_all("logits", ids)[0]
    assert hf_logits.abs().max() > 0.05  # a real signal
    torch.testing.assert_close(megatron_logits, hf_logits, rtol=0, atol=1e-5)


@requires_megatron
@pytest.mark.parametrize("dropped", ["no_sinks", "no_window"])
def test_gpt_oss_forward_negative_controls_differ(dropped, gpt_oss_path, pool1, start_group):
    """Proves the comparison above can fail: the same model without the sinks (plain softmax)
    or without the sliding window (every layer full) gives other logits."""
    ids = torch.randint(7, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    probe = start_group(
        pool1, "_megatron_helpers:ForwardProbe", (str(gpt_oss_path), dropped), name=dropped
    )
    megatron_logits, hf_logits = probe.run_all("logits", ids)[0]
    assert (megatron_logits - hf_logits).abs().max() > 1e-3


@requires_megatron
def test_gpt_oss_train_step_matches_dtensor(gpt_oss_path, pool1, start_group):
    assert_one_step_matches_dtensor(make_config(gpt_oss_path), pool1, start_group)


@requires_megatron
def test_gpt_oss_refit_into_the_torch_engine_gives_the_trainers_logprobs(
    gpt_oss_path, pool1, start_group
):
    prompts = [[5, 9, 12, 30, 31], [7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    assert_refit_into_the_torch_engine_gives_the_trainers_logprobs(
        make_config(gpt_oss_path), prompts, pool1, start_group
    )


@requires_megatron
def test_gpt_oss_parallel_layouts_that_are_not_wired_are_refused(gpt_oss_path):
    """Tensor parallelism over MoE layers (expert tensor parallelism) and the Transformer
    Engine spec (its attention would need the sinks and windows mapped too) are refused in
    one line each."""
    from nrl_megatron.model import MegatronModelError, build_gpt_model, transformer_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gpt_oss_path)
    with pytest.raises(MegatronModelError, match="tensor_model_parallel_size=1"):
        transformer_config(config, tp=2)
    with pytest.raises(MegatronModelError, match="transformer_engine=false"):
        build_gpt_model(config, None, transformer_engine=True)


@requires_megatron
def test_gpt_oss_packed_training_matches_padded(gpt_oss_path, pool1, start_group):
    """Packed micro batches (THD: the sinks and the window applied per sample by
    :class:`SDPAttention`'s packed path, RoPE restarting at every boundary) give the padded
    path's logprobs, metrics and update (rel. 1e-5, as test_packing.py for Llama), with
    samples longer than the window."""
    from safetensors.torch import load_file
    from test_packing import LOSSES, assert_same, long_tailed_batch, run

    initial = load_file(str(gpt_oss_path / "model.safetensors"))
    batch = long_tailed_batch(8, seed=3)
    assert batch["input_ids"].shape[1] > 4 * WINDOW
    loss = LOSSES["clipped_pg-token_mean"]
    expected = run(pool1, start_group, gpt_oss_path, batch, loss(), packing=False, name="pad")
    got = run(pool1, start_group, gpt_oss_path, batch, loss(), packing=True, name="pack")
    assert_same(got, expected, initial, "gpt_oss")


@requires_megatron
def test_gpt_oss_checkpoint_layout_stream_and_export_are_the_checkpoint(
    gpt_oss_path, tmp_path, pool1, start_group
):
    """The refit stream in the layout vLLM and SGLang load (``EngineOptions.weight_layout``)
    and ``export_hf`` are the saved ``model.safetensors``, name for name and bit for bit, and
    the export loads in ``from_pretrained`` as a gpt-oss."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nrl_core.config.schema import EngineOptions

    config = make_config(gpt_oss_path)
    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    want = load_file(str(gpt_oss_path / "model.safetensors"))
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
    assert type(model).__name__ == "GptOssForCausalLM"
