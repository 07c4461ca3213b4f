"""The HF <-> Megatron converter: pure torch, runs with or without megatron-core."""

from __future__ import annotations

import pytest
import torch
from nrl_megatron.convert import (
    ConversionError,
    ModelShape,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_hf_names,
    shard_for_tp,
    split_qkv,
    unshard_from_tp,
)
from safetensors.torch import load_file
from transformers import AutoConfig


def _load(path):
    return load_file(str(path / "model.safetensors")), AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("model", ["tiny_path", "tiny_qwen2_path"])
def test_round_trip_is_bit_exact(model, request):
    hf, config = _load(request.getfixturevalue(model))
    shape = ModelShape.from_hf_config(config)
    for te in (False, True):
        mg = hf_to_megatron(hf, shape, te=te)
        back = megatron_to_hf(mg, shape, te=te)
        assert back.keys() == hf.keys()
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), name
        # Every Megatron tensor has a name mapping, and the mapping covers every HF tensor once.
        names = megatron_to_hf_names(shape, te=te)
        assert names.keys() == mg.keys()
        assert sorted(n for hf_names in names.values() for n in hf_names) == sorted(hf)


def test_qwen2_shape_has_bias_and_tied_embeddings(tiny_qwen2_path):
    hf, config = _load(tiny_qwen2_path)
    shape = ModelShape.from_hf_config(config)
    assert shape.qkv_bias and shape.tie_word_embeddings
    mg = hf_to_megatron(hf, shape)
    assert "output_layer.weight" not in mg
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in mg


def test_qkv_interleaving_is_per_query_group():
    # 4 query heads in 2 groups, head_dim 2: label every row by (kind, head, row).
    shape = ModelShape(1, 8, 4, 2, 2, 16, 32, False, False)
    q = torch.arange(8).float()[:, None] + 100  # heads 0..3, rows 100..107
    k = torch.arange(4).float()[:, None] + 200  # kv heads 0..1
    v = torch.arange(4).float()[:, None] + 300
    fused = fuse_qkv(q, k, v, shape)[:, 0].tolist()
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3 then k1 then v1
    assert fused == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    for got, want in zip(split_qkv(fuse_qkv(q, k, v, shape), shape), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_tp_sharding_round_trip_and_fc1_layout(tiny_path):
    hf, config = _load(tiny_path)
    shape = ModelShape.from_hf_config(config)
    mg = hf_to_megatron(hf, shape)
    for name, tensor in mg.items():
        shards = [shard_for_tp(name, tensor, r, 2) for r in range(2)]
        assert torch.equal(unshard_from_tp(name, shards), tensor), name
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    rank1 = shard_for_tp(fc1, mg[fc1], 1, 2)
    half = shape.ffn_hidden_size // 2
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    # Each rank holds [its slice of gate; its slice of up], as ColumnParallelLinear expects.
    assert torch.equal(rank1, torch.cat([gate[half:], up[half:]]))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    rows_per_group = (shape.heads_per_group + 2) * shape.head_dim
    assert torch.equal(shard_for_tp(qkv, mg[qkv], 1, 2), mg[qkv][rows_per_group:])


def test_lora_adapters_split_like_their_layers():
    """A column layer's B is split by rows and a row layer's A by columns (each rank keeps its
    slice of the base weight's split dim); the other factor is whole on every rank. The pieces
    go back together exactly (what checkpoint resharding and the export gather rely on)."""
    from nrl_megatron.convert import tp_split_dim

    layer = "decoder.layers.1."
    split = {
        layer + "self_attention.linear_qkv.lora_B.k_proj": 0,
        layer + "mlp.linear_fc1.lora_B.up_proj": 0,
        layer + "self_attention.linear_proj.lora_A.o_proj": 1,
        layer + "mlp.linear_fc2.lora_A.down_proj": 1,
        layer + "self_attention.linear_qkv.lora_A.q_proj": None,
        layer + "mlp.linear_fc1.lora_A.gate_proj": None,
        layer + "self_attention.linear_proj.lora_B.o_proj": None,
        layer + "mlp.linear_fc2.lora_B.down_proj": None,
    }
    for name, dim in split.items():
        assert tp_split_dim(name) == dim, name
        tensor = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
        shards = [shard_for_tp(name, tensor, r, 2) for r in range(2)]
        if dim is None:
            assert all(torch.equal(s, tensor) for s in shards), name
        else:
            # fc1's B is not the [gate; up] stack: a plain contiguous half of its rows.
            assert torch.equal(shards[0], tensor.chunk(2, dim=dim)[0]), name
        assert torch.equal(unshard_from_tp(name, shards), tensor), name


def test_unsupported_architecture_is_a_user_error():
    class Config:
        model_type = "gpt2"

    with pytest.raises(ConversionError, match="not supported"):
        ModelShape.from_hf_config(Config())


@pytest.mark.parametrize(
    ("arch", "layer"),
    [
        ("qwen3_5", "Gated DeltaNet"),
        ("qwen3_5_moe", "Gated DeltaNet"),
    ],
)
def test_new_families_are_refused_in_one_line_naming_the_layer(arch, layer, tmp_path):
    """The tiny models of the families issue 48 names, as ``from_pretrained`` configs: refused
    by the layer that the converter cannot map, pointing at the dtensor backend."""
    from transformers import AutoConfig

    from nrl_core.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, arch=arch, hidden_size=32, num_layers=4)
    with pytest.raises(ConversionError, match=layer) as caught:
        ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    message = str(caught.value)
    assert "\n" not in message and "policy.backend=dtensor" in message


def test_llama4_vision_language_checkpoint_is_refused_in_one_line():
    """Llama 4's text model (``llama4_text``) converts (test_llama4.py); the published
    checkpoints' vision-language config (``llama4``) names a vision tower the converter does
    not map."""
    from transformers import Llama4Config

    with pytest.raises(ConversionError, match="vision tower") as caught:
        ModelShape.from_hf_config(Llama4Config())
    message = str(caught.value)
    assert "\n" not in message and "llama4_text" in message
    assert "policy.backend=dtensor" in message
