"""What vLLM reads from the tiny models the vLLM CPU tests load, without vLLM installed."""

from __future__ import annotations


def test_vllm_sees_the_tiny_llama4s_attention_temperature_tuning(tmp_path):
    """vLLM 0.32 takes Llama 4's attention temperature tuning from the generation config it
    loads with ``GenerationConfig.from_pretrained`` (``try_get_generation_config``; off below
    32K context when that lacks it, ``Llama4ForCausalLM.__init__``), while transformers applies
    config.json's. The tiny model's flag must survive that load: a generation config marked
    ``_from_model_config`` loses every key ``GenerationConfig`` does not define, which left the
    engine's NoPE layer untuned and 1.3e-3 nats off the trainer
    (``test_vllm_cpu_families.py``)."""
    from transformers import AutoConfig, GenerationConfig

    from nrl_core.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "l4", arch="llama4", hidden_size=32, num_layers=4)
    assert AutoConfig.from_pretrained(path).attn_temperature_tuning is True
    loaded = GenerationConfig.from_pretrained(path).to_diff_dict()
    assert loaded.get("attn_temperature_tuning") is True, loaded
