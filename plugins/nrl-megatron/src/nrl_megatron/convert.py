"""Hugging Face <-> Megatron-Core weight conversion for Llama- and Qwen2-family models.

Pure torch (no megatron import), so the layout logic is testable anywhere.

Megatron-Core's GPT layout differs from Hugging Face's in three places:

- **Fused QKV** (``self_attention.linear_qkv``): one ``[ng * (q_per_g + 2) * d, h]`` matrix,
  ordered *per query group*: the ``q_per_g`` query heads of group ``g``, then its key head, then
  its value head. Column-parallel sharding then splits whole groups, so every tensor-parallel
  rank holds complete groups. Qwen2's q/k/v biases follow the same order.
- **Fused gate/up** (``mlp.linear_fc1``): ``[gate; up]`` stacked on dim 0. Under tensor
  parallelism each rank holds ``[gate_r; up_r]`` (its slice of each), not a slice of the stack.
- **Names**: ``embedding.word_embeddings``, ``decoder.layers.N.*``, ``decoder.final_layernorm``,
  ``output_layer``. With the Transformer Engine spec the RMSNorm weights live inside the fused
  layernorm-linear modules (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

Tied embeddings: Megatron keeps one tensor (``embedding.word_embeddings.weight``) and the
output layer reuses it; exporting writes only ``model.embed_tokens.weight`` (HF re-ties it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from nrl_core.errors import NrlError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class ConversionError(NrlError):
    """A checkpoint does not fit the converter (unsupported architecture or shapes)."""


@attrs.frozen
class ModelShape:
    """What the converter needs to know about a Llama/Qwen2 model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Read the shape from a ``transformers`` config (Llama or Qwen2)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(
                f"model_type {model_type!r} is not supported by the megatron policy; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (use policy.backend=dtensor for others)"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % kv_heads:
            raise ConversionError(f"{heads} attention heads are not a multiple of {kv_heads}")
        # Llama has `attention_bias` (default False); Qwen2 always has q/k/v biases.
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        if model_type == "llama" and getattr(config, "mlp_bias", False):
            raise ConversionError("Llama models with mlp_bias=True are not supported")
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )


# ---------------------------------------------------------------------------------------------
# QKV and gate/up fusion


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF ``q_proj``/``k_proj``/``v_proj`` weights (or biases) -> Megatron ``linear_qkv``."""
    ng, d, qpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(ng, qpg * d, *tail)
    k = k.reshape(ng, d, *tail)
    v = v.reshape(ng, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(ng * (qpg + 2) * d, *tail)


def split_qkv(
    qkv: torch.Tensor, shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` weight (or bias) -> HF ``(q, k, v)``; inverse of :func:`fuse_qkv`."""
    ng, d, qpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (qpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return (
        q.reshape(ng * qpg * d, *tail).clone(),
        k.reshape(ng * d, *tail).clone(),
        v.reshape(ng * d, *tail).clone(),
    )


# ---------------------------------------------------------------------------------------------
# Names


def _layer_names(te: bool) -> dict[str, str]:
    """Megatron suffix -> HF suffix inside one decoder layer, for the 1:1 tensors."""
    return {
        (
            "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        ): "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        (
            "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
        ): "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }


def megatron_to_hf_names(shape: ModelShape, te: bool = False) -> dict[str, list[str]]:
    """Every Megatron parameter name -> the HF names it becomes (fused tensors map to several).

    Engines use this for refit: it says which HF tensors each Megatron tensor feeds.
    """
    names: dict[str, list[str]] = {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"]
    }
    for i in range(shape.num_layers):
        mg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mg_suffix, hf_suffix in _layer_names(te).items():
            names[mg + mg_suffix] = [hf + hf_suffix]
        names[mg + "self_attention.linear_qkv.weight"] = [
            hf + f"self_attn.{p}_proj.weight" for p in "qkv"
        ]
        if shape.qkv_bias:
            names[mg + "self_attention.linear_qkv.bias"] = [
                hf + f"self_attn.{p}_proj.bias" for p in "qkv"
            ]
        names[mg + "mlp.linear_fc1.weight"] = [
            hf + "mlp.gate_proj.weight",
            hf + "mlp.up_proj.weight",
        ]
    names["decoder.final_layernorm.weight"] = ["model.norm.weight"]
    if not shape.tie_word_embeddings:
        names["output_layer.weight"] = ["lm_head.weight"]
    return names


# ---------------------------------------------------------------------------------------------
# Full (unsharded) conversion


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], shape: ModelShape, te: bool = False
) -> dict[str, torch.Tensor]:
    """A full HF state dict -> the full (tensor-parallel size 1) Megatron state dict."""
    try:
        out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
        for i in range(shape.num_layers):
            mg, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            for mg_suffix, hf_suffix in _layer_names(te).items():
                out[mg + mg_suffix] = hf[p + hf_suffix]
            attn = p + "self_attn."
            out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
                hf[attn + "q_proj.weight"],
                hf[attn + "k_proj.weight"],
                hf[attn + "v_proj.weight"],
                shape,
            )
            if shape.qkv_bias:
                out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                    hf[attn + "q_proj.bias"],
                    hf[attn + "k_proj.bias"],
                    hf[attn + "v_proj.bias"],
                    shape,
                )
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
    except KeyError as missing:
        raise ConversionError(
            f"the Hugging Face checkpoint lacks {missing}; is it a Llama/Qwen2 causal LM?"
        ) from None
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], shape: ModelShape, te: bool = False
) -> dict[str, torch.Tensor]:
    """A full Megatron state dict -> the HF state dict; inverse of :func:`hf_to_megatron`."""
    out = dict(iter_megatron_to_hf(mg.items(), shape, te))
    return out


def iter_megatron_to_hf(
    items: Iterator[tuple[str, torch.Tensor]] | Any, shape: ModelShape, te: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert ``(megatron name, full tensor)`` pairs one at a time (streaming refit)."""
    simple = {}
    for mg_name, hf_names in megatron_to_hf_names(shape, te).items():
        if len(hf_names) == 1:
            simple[mg_name] = hf_names[0]
    for name, tensor in items:
        if name.endswith("._extra_state"):
            continue
        if name in simple:
            yield simple[name], tensor
        elif name.endswith("self_attention.linear_qkv.weight") or name.endswith(
            "self_attention.linear_qkv.bias"
        ):
            kind = name.rsplit(".", 1)[1]
            prefix = "model.layers." + name.split(".")[2] + ".self_attn."
            for proj, part in zip("qkv", split_qkv(tensor, shape), strict=True):
                yield f"{prefix}{proj}_proj.{kind}", part
        elif name.endswith("mlp.linear_fc1.weight"):
            prefix = "model.layers." + name.split(".")[2] + ".mlp."
            gate, up = torch.chunk(tensor, 2, dim=0)
            yield prefix + "gate_proj.weight", gate.clone()
            yield prefix + "up_proj.weight", up.clone()
        elif name == "output_layer.weight" and shape.tie_word_embeddings:
            continue  # the shared embedding already produced model.embed_tokens.weight
        else:
            raise ConversionError(f"no Hugging Face name for Megatron tensor {name!r}")


# ---------------------------------------------------------------------------------------------
# Tensor-parallel sharding

# How each Megatron tensor is split across tensor-parallel ranks: the dim, or None (replicated).
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_split_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits Megatron tensor ``name`` (None: replicated)."""
    if name.endswith(_COLUMN) or name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def shard_for_tp(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of a full Megatron tensor."""
    if tp_size == 1:
        return tensor
    dim = tp_split_dim(name)
    if dim is None:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ConversionError(
            f"{name} has {tensor.shape[dim]} rows/columns, not divisible by tensor parallel "
            f"size {tp_size}; lower policy.megatron.tensor_model_parallel_size"
        )
    if name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat(
            [torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]]
        ).contiguous()
    return torch.chunk(tensor, tp_size, dim=dim)[tp_rank].contiguous()


def unshard_from_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from every tensor-parallel rank's slice (in rank order)."""
    if len(shards) == 1:
        return shards[0]
    dim = tp_split_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)
