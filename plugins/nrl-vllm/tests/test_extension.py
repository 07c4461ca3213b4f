"""nrl_vllm.extension's refit layouts without vLLM: which checkpoint tensors a gpt-oss refit
sends expert by expert, which after the reload (the engine side runs in
``test_vllm_cpu_families.py``)."""

from __future__ import annotations

import torch
from nrl_vllm.extension import GPT_OSS_EXPERT_TENSORS, refit_layout, reload_split


def _named(cls_name: str, **attrs) -> object:
    return type(cls_name, (), attrs)()


def test_only_vllms_unquantized_gpt_oss_with_per_expert_loading_gets_its_layout():
    streamed = _named("GptOssModel", _get_streamed_expert_info=staticmethod(lambda *a: None))
    plain = _named("GptOssModel")
    quantized = _named("GptOssConfig", quantization_config={"quant_method": "mxfp4"})

    assert refit_layout(_named("GptOssForCausalLM", model=streamed, config=None)) == "gpt_oss"
    # vLLM releases without the per-expert loader keep the checkpoint layout.
    assert refit_layout(_named("GptOssForCausalLM", model=plain, config=None)) == "checkpoint"
    # MXFP4 engines load other names (``*_blocks``/``*_scales``): not this layout.
    gptoss_mxfp4 = _named("GptOssForCausalLM", model=streamed, config=quantized)
    assert refit_layout(gptoss_mxfp4) == "checkpoint"
    assert refit_layout(_named("Qwen3ForCausalLM", model=streamed)) == "checkpoint"


def test_gpt_oss_experts_go_one_by_one_and_sinks_after_the_reload():
    from transformers import AutoModelForCausalLM, GptOssConfig

    # transformers' own gpt-oss names and shapes (what the dtensor policy streams), tiny.
    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_local_experts=3,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    state = AutoModelForCausalLM.from_config(config).state_dict()
    weights = list(state.items())

    now, after = reload_split("gpt_oss", weights)

    sinks = {n for n in state if n.endswith(".self_attn.sinks")}
    stacked = {n for n in state if n.rpartition(".")[2] in GPT_OSS_EXPERT_TENSORS}
    layers = len({n.split(".")[2] for n in state if n.startswith("model.layers.")})
    assert len(sinks) == layers and len(stacked) == 4 * layers
    assert [n for n, _ in after] == sorted(sinks, key=list(state).index)
    sent = dict(now)
    # Everything else as it came, the same tensors.
    for name in state.keys() - sinks - stacked:
        assert sent[name] is state[name]
    # Each stacked tensor exactly once, as its experts' slices in order.
    for name in stacked:
        prefix, _, leaf = name.rpartition(".")
        experts = state[name].shape[0]
        assert experts > 1
        parts = [sent.pop(f"{prefix}.{e}.{leaf}") for e in range(experts)]
        assert torch.equal(torch.stack(parts), state[name])
    assert set(sent) == state.keys() - sinks - stacked


def test_other_models_load_the_bucket_as_it_came():
    weights = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 3, 4))]
    weights.append(("model.layers.0.self_attn.sinks", torch.zeros(4)))
    assert reload_split("checkpoint", weights) == (weights, [])
