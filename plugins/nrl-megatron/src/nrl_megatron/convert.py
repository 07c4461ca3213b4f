"""Hugging Face <-> Megatron-Core weight conversion for Llama- and Qwen2-family models, and
Qwen3-MoE, gpt-oss and Llama 4 mixtures of experts.

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

Qwen3-MoE (``model_type`` ``qwen3_moe``, every layer a mixture of experts): the per-head query
and key RMSNorms are ``self_attention.q_layernorm``/``k_layernorm`` (``self_attn.q_norm``/
``k_norm``); the router is ``mlp.router.weight`` (``mlp.gate.weight``, ``[experts, hidden]``);
expert ``e`` is ``mlp.experts.local_experts.{e}.linear_fc1.weight`` (``[gate; up]``, like a
dense fc1) and ``linear_fc2.weight``. Hugging Face names are transformers 5's in-memory layout
(what ``from_pretrained`` builds and the torch engine loads): one ``[experts, 2 * width,
hidden]`` ``mlp.experts.gate_up_proj`` (rows ``[gate; up]`` per expert) and one ``[experts,
hidden, width]`` ``mlp.experts.down_proj`` per layer; the published per-expert file layout is
transformers' own conversion of those (``nrl_megatron.worker``'s export applies it). The full
Megatron state dict numbers experts globally; under expert parallelism rank ``r`` of ``ep``
holds experts ``[r * E / ep, (r + 1) * E / ep)`` renumbered from 0 (:func:`shard_for_ep`).

gpt-oss (``model_type`` ``gpt_oss``, every layer a mixture of experts, every linear biased):
the router is ``mlp.router.weight``/``bias`` under both names; each head's attention sink
(``self_attn.sinks``) is ``self_attention.core_attention.softmax_offset`` (megatron-core's name
for the learnable softmax offset); ``self_attn.o_proj.bias`` is
``self_attention.linear_proj.bias``. Its stacked experts are stored input-major
(``gate_up_proj`` ``[experts, hidden, 2 * width]``, ``down_proj`` ``[experts, width, hidden]``)
with gate and up *interleaved* column by column (gate ``[..., 0::2]``, up ``[..., 1::2]``, as
transformers' ``GptOssExperts`` reads them): expert ``e``'s ``linear_fc1.weight`` is the
de-interleaved ``[gate; up]`` transposed to ``[2 * width, hidden]`` (its bias the same
de-interleaving of ``gate_up_proj_bias[e]``), ``linear_fc2.weight`` is ``down_proj[e]``
transposed, ``linear_fc2.bias`` is ``down_proj_bias[e]``.

Llama 4's text model (``model_type`` ``llama4_text``, every layer a mixture of experts with a
shared expert): the MLP is ``feed_forward.*``; the router is ``mlp.router.weight``
(``feed_forward.router.weight``); the stacked experts are input-major like gpt-oss's but with
gate and up *not* interleaved (``gate_up_proj`` ``[experts, hidden, 2 * width]``, the gate
columns then the up columns, as transformers' ``Llama4TextExperts`` chunks them): expert
``e``'s ``linear_fc1.weight`` is ``gate_up_proj[e]`` transposed (already ``[gate; up]``),
``linear_fc2.weight`` is ``down_proj[e]`` (``[width, hidden]``) transposed; the shared expert
``feed_forward.shared_expert.{gate,up,down}_proj`` is ``mlp.shared_experts.linear_fc1``
(``[gate; up]``) and ``linear_fc2``. Its q/k L2 norm has no weight, so nothing to convert.

Tied embeddings: Megatron keeps one tensor (``embedding.word_embeddings.weight``) and the
output layer reuses it; exporting writes only ``model.embed_tokens.weight`` (HF re-ties it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from nrl_core.errors import NrlError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3_moe", "gpt_oss", "llama4_text")

_GDN = (
    "Qwen3.5's Gated DeltaNet layers (layer_types 'linear_attention') are not converted: "
    "megatron-core's GatedDeltaNet (0.16 and 0.19) runs only on flash-linear-attention's CUDA "
    "kernels, so its forward cannot be checked against transformers' here"
)
_LLAMA4_VLM = (
    "the Llama 4 vision-language checkpoint's vision tower and projector are not mapped (its "
    "text model, model_type 'llama4_text', is)"
)
REFUSED_LAYERS = {
    "qwen3_5": _GDN,
    "qwen3_5_text": _GDN,
    "qwen3_5_moe": _GDN,
    "qwen3_5_moe_text": _GDN,
    "llama4": _LLAMA4_VLM,
}
"""Model families transformers ships that the converter refuses, each with the layer that it
cannot map (docs/megatron.md, "Model families")."""


class ConversionError(NrlError):
    """A checkpoint does not fit the converter (unsupported architecture or shapes)."""


@attrs.frozen
class ModelShape:
    """What the converter needs to know about a Llama/Qwen2/Qwen3-MoE/gpt-oss/Llama 4 model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    num_experts: int = 0
    """Experts per MoE layer; 0: a dense model (every layer is MoE otherwise)."""
    num_experts_per_tok: int = 0
    """Router top-k (MoE only)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate width (MoE only)."""
    norm_topk_prob: bool = True
    """Whether the top-k router probabilities are renormalised to sum to 1 (MoE only)."""
    model_type: str = ""
    """The HF ``model_type`` (``gpt_oss`` selects its expert layout and names)."""
    linear_bias: bool = False
    """Biases on every linear layer: o_proj, router, experts (gpt-oss; Megatron's
    ``add_bias_linear``)."""
    attention_sinks: bool = False
    """A learned per-head logit in each attention softmax's denominator (gpt-oss)."""
    shared_expert_size: int = 0
    """The intermediate width of a shared expert every token passes through beside its routed
    ones (Llama 4); 0: none."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Read the shape from a ``transformers`` config (Llama or Qwen2)."""
        model_type = getattr(config, "model_type", None)
        if model_type in REFUSED_LAYERS:
            raise ConversionError(
                f"model_type {model_type!r}: {REFUSED_LAYERS[model_type]}; use "
                "policy.backend=dtensor"
            )
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
        moe = {}
        if model_type == "qwen3_moe":
            moe = _qwen3_moe_settings(config)
        if model_type == "gpt_oss":
            moe = _gpt_oss_settings(config)
        if model_type == "llama4_text":
            moe = _llama4_settings(config)
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
            model_type=model_type,
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _qwen3_moe_settings(config: Any) -> dict[str, Any]:
    """The MoE fields of :class:`ModelShape` for a ``Qwen3MoeConfig``; refuses what Megatron's
    uniform MoE layers cannot reproduce (dense layers between MoE ones)."""
    sparse_step = getattr(config, "decoder_sparse_step", 1)
    dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ConversionError(
            f"Qwen3-MoE with dense layers (decoder_sparse_step={sparse_step}, mlp_only_layers="
            f"{dense_layers}) is not supported by the megatron policy; use policy.backend=dtensor"
        )
    return {
        "qk_norm": True,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "norm_topk_prob": bool(config.norm_topk_prob),
    }


def _gpt_oss_settings(config: Any) -> dict[str, Any]:
    """The MoE and bias fields of :class:`ModelShape` for a ``GptOssConfig``. Megatron has one
    switch for every linear bias (``add_bias_linear``): a gpt-oss without attention biases
    (``attention_bias=False``, no published one) is refused rather than given zero biases."""
    if not getattr(config, "attention_bias", True):
        raise ConversionError(
            "gpt-oss with attention_bias=False is not supported by the megatron policy (its "
            "experts and router keep their biases, Megatron biases all linears or none); use "
            "policy.backend=dtensor"
        )
    return {
        "num_experts": config.num_local_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.intermediate_size,
        # softmax over the top-k logits (GptOssTopKRouter): Megatron's pre_softmax=False.
        "norm_topk_prob": True,
        "linear_bias": True,
        "attention_sinks": True,
    }


def _llama4_settings(config: Any) -> dict[str, Any]:
    """The MoE fields of :class:`ModelShape` for a ``Llama4TextConfig``; refuses in one line
    what the Megatron layers here do not reproduce:

    - top-k > 1: Megatron applies the routing weight on the experts' input
      (``moe_apply_probs_on_input``, as transformers' ``Llama4TextMoe`` does) for top-1 only,
      and renormalises sigmoid top-k scores, which transformers does not (Scout and Maverick
      are top-1);
    - dense layers between the MoE ones (``interleave_moe_layer_step`` > 1, ``moe_layers``):
      every Megatron layer here has the same MLP;
    - attention biases: Megatron's one ``add_bias_linear`` would give the experts biases too.
    """
    top_k = config.num_experts_per_tok
    if top_k != 1:
        raise ConversionError(
            f"Llama 4 with num_experts_per_tok={top_k} is not supported by the megatron policy "
            "(its routing weight scales the experts' input, which Megatron does for top-1 "
            "only); use policy.backend=dtensor"
        )
    moe_layers = list(getattr(config, "moe_layers", None) or [])
    if moe_layers != list(range(config.num_hidden_layers)):
        raise ConversionError(
            f"Llama 4 with dense layers between the MoE ones (moe_layers={moe_layers}, "
            f"interleave_moe_layer_step={getattr(config, 'interleave_moe_layer_step', None)}) "
            "is not supported by the megatron policy; use policy.backend=dtensor"
        )
    if getattr(config, "attention_bias", False):
        raise ConversionError(
            "Llama 4 with attention_bias=True is not supported by the megatron policy (Megatron "
            "biases all linears or none); use policy.backend=dtensor"
        )
    return {
        "num_experts": config.num_local_experts,
        "num_experts_per_tok": top_k,
        "moe_ffn_hidden_size": config.intermediate_size,
        # One sigmoid score per token: nothing to renormalise.
        "norm_topk_prob": False,
        "shared_expert_size": config.intermediate_size,
    }


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


def _layer_names(te: bool, shape: ModelShape | None = None) -> dict[str, str]:
    """Megatron suffix -> HF suffix inside one decoder layer, for the 1:1 tensors."""
    moe = shape is not None and shape.is_moe
    names = {
        (
            "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        ): "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        # An MoE layer keeps its own pre-MLP norm under both specs (nothing to fuse it into).
        (
            "mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"
        ): "post_attention_layernorm.weight",
    }
    gpt_oss = shape is not None and shape.model_type == "gpt_oss"
    if gpt_oss:
        names["mlp.router.weight"] = "mlp.router.weight"
        names["mlp.router.bias"] = "mlp.router.bias"
    elif shape is not None and shape.model_type == "llama4_text":
        names["mlp.router.weight"] = "feed_forward.router.weight"
        names["mlp.shared_experts.linear_fc2.weight"] = (
            "feed_forward.shared_expert.down_proj.weight"
        )
    elif moe:
        names["mlp.router.weight"] = "mlp.gate.weight"
    else:
        names["mlp.linear_fc2.weight"] = "mlp.down_proj.weight"
    if shape is not None and shape.linear_bias:
        names["self_attention.linear_proj.bias"] = "self_attn.o_proj.bias"
    if shape is not None and shape.attention_sinks:
        names["self_attention.core_attention.softmax_offset"] = "self_attn.sinks"
    if shape is not None and shape.qk_norm:
        names["self_attention.q_layernorm.weight"] = "self_attn.q_norm.weight"
        names["self_attention.k_layernorm.weight"] = "self_attn.k_norm.weight"
    return names


EXPERT_PREFIX = "mlp.experts.local_experts."
"""Inside a Megatron MoE layer (local spec, ``SequentialMLP``): expert ``e``'s tensors are
``mlp.experts.local_experts.{e}.linear_fc1.weight`` and ``...linear_fc2.weight`` (and their
``.bias`` for gpt-oss)."""

_HF_EXPERTS = {
    "linear_fc1.weight": "mlp.experts.gate_up_proj",
    "linear_fc2.weight": "mlp.experts.down_proj",
}
_GPT_OSS_EXPERTS = {
    **_HF_EXPERTS,
    "linear_fc1.bias": "mlp.experts.gate_up_proj_bias",
    "linear_fc2.bias": "mlp.experts.down_proj_bias",
}


_LLAMA4_EXPERTS = {
    "linear_fc1.weight": "feed_forward.experts.gate_up_proj",
    "linear_fc2.weight": "feed_forward.experts.down_proj",
}

SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
"""Inside a Megatron MoE layer: the shared expert's ``[gate; up]`` (Llama 4)."""


def _hf_experts(shape: ModelShape) -> dict[str, str]:
    """Megatron expert tensor kind -> the HF stacked tensor (per layer) it is one row of."""
    if shape.model_type == "llama4_text":
        return _LLAMA4_EXPERTS
    return _GPT_OSS_EXPERTS if shape.model_type == "gpt_oss" else _HF_EXPERTS


def _expert_to_megatron(kind: str, part: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """One expert's slice of an HF stacked tensor -> its Megatron tensor ``kind``. Qwen3-MoE's
    are already Megatron's (views, no copy); gpt-oss's are input-major and interleave gate and
    up columns, Llama 4's are input-major only (module docstring)."""
    if shape.model_type == "llama4_text":  # [hidden, 2w] gate then up, [w, hidden]
        return part.t().contiguous()
    if shape.model_type != "gpt_oss":
        return part
    if kind == "linear_fc1.weight":  # [hidden, 2w] interleaved -> [gate; up] as [2w, hidden]
        return torch.cat([part[:, 0::2], part[:, 1::2]], dim=1).t().contiguous()
    if kind == "linear_fc1.bias":
        return torch.cat([part[0::2], part[1::2]])
    if kind == "linear_fc2.weight":  # [w, hidden] -> [hidden, w]
        return part.t().contiguous()
    return part


def _expert_to_hf(kind: str, tensor: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Inverse of :func:`_expert_to_megatron` (one expert, before stacking)."""
    if shape.model_type == "llama4_text":
        return tensor.t()
    if shape.model_type != "gpt_oss":
        return tensor
    if kind in ("linear_fc1.weight", "linear_fc1.bias"):
        gate, up = torch.chunk(tensor, 2, dim=0)
        # rows g0, u0, g1, u1, ...: the interleaving, then input-major for the weight.
        merged = torch.stack([gate, up], dim=1).reshape(tensor.shape)
        return merged.t() if kind == "linear_fc1.weight" else merged
    if kind == "linear_fc2.weight":
        return tensor.t()
    return tensor


def expert_index(name: str) -> tuple[int, int, str] | None:
    """``(layer, expert, "linear_fc1.weight" | "linear_fc2.weight")`` of a Megatron expert
    tensor name, None for any other name."""
    parts = name.split(".")  # decoder.layers.L.mlp.experts.local_experts.E.linear_fcN.weight
    if len(parts) != 9 or parts[0] != "decoder" or ".".join(parts[3:6]) + "." != EXPERT_PREFIX:
        return None
    return int(parts[2]), int(parts[6]), f"{parts[7]}.{parts[8]}"


def megatron_to_hf_names(shape: ModelShape, te: bool = False) -> dict[str, list[str]]:
    """Every Megatron parameter name -> the HF names it becomes (fused tensors map to several;
    each expert's tensors map to their layer's stacked ``[experts, ...]`` HF tensor).

    Engines use this for refit: it says which HF tensors each Megatron tensor feeds.
    """
    names: dict[str, list[str]] = {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"]
    }
    for i in range(shape.num_layers):
        mg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mg_suffix, hf_suffix in _layer_names(te, shape).items():
            names[mg + mg_suffix] = [hf + hf_suffix]
        names[mg + "self_attention.linear_qkv.weight"] = [
            hf + f"self_attn.{p}_proj.weight" for p in "qkv"
        ]
        if shape.qkv_bias:
            names[mg + "self_attention.linear_qkv.bias"] = [
                hf + f"self_attn.{p}_proj.bias" for p in "qkv"
            ]
        if shape.is_moe:
            for e in range(shape.num_experts):
                for kind, hf_name in _hf_experts(shape).items():
                    names[f"{mg}{EXPERT_PREFIX}{e}.{kind}"] = [hf + hf_name]
            if shape.shared_expert_size:
                names[mg + SHARED_FC1] = [
                    hf + "feed_forward.shared_expert.gate_proj.weight",
                    hf + "feed_forward.shared_expert.up_proj.weight",
                ]
            continue
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
            for mg_suffix, hf_suffix in _layer_names(te, shape).items():
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
            if shape.is_moe:
                for kind, hf_name in _hf_experts(shape).items():
                    # [experts, ...] -> one tensor per expert (Qwen3-MoE: views of the stack).
                    for e, part in enumerate(torch.unbind(hf[p + hf_name], dim=0)):
                        out[f"{mg}{EXPERT_PREFIX}{e}.{kind}"] = _expert_to_megatron(
                            kind, part, shape
                        )
                if shape.shared_expert_size:
                    shared = p + "feed_forward.shared_expert."
                    out[mg + SHARED_FC1] = torch.cat(
                        [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]], dim=0
                    )
                continue
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
    except KeyError as missing:
        raise ConversionError(
            f"the Hugging Face checkpoint lacks {missing}; is it a Llama/Qwen2/Qwen3-MoE/gpt-oss/"
            "Llama 4 causal LM (loaded with transformers 5, which stacks each layer's experts)?"
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
    """Convert ``(megatron name, full tensor)`` pairs one at a time (streaming refit).

    Experts (globally numbered names) are held until their layer's last expert of that tensor
    arrives, then yielded stacked as the HF ``[experts, ...]`` tensor: at most one layer's
    experts wait when they come in order."""
    simple = {}
    for mg_name, hf_names in megatron_to_hf_names(shape, te).items():
        if len(hf_names) == 1 and expert_index(mg_name) is None:
            simple[mg_name] = hf_names[0]
    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in items:
        if name.endswith("._extra_state"):
            continue
        expert = expert_index(name) if shape.is_moe else None
        if expert is not None:
            layer, e, kind = expert
            if not 0 <= e < shape.num_experts:
                raise ConversionError(f"{name}: expert {e} of {shape.num_experts}")
            parts = pending.setdefault((layer, kind), {})
            parts[e] = tensor
            if len(parts) == shape.num_experts:
                del pending[(layer, kind)]
                stacked = torch.stack(
                    [_expert_to_hf(kind, parts[i], shape) for i in range(shape.num_experts)]
                )
                yield f"model.layers.{layer}.{_hf_experts(shape)[kind]}", stacked
        elif name in simple:
            yield simple[name], tensor
        elif name.endswith("self_attention.linear_qkv.weight") or name.endswith(
            "self_attention.linear_qkv.bias"
        ):
            kind = name.rsplit(".", 1)[1]
            prefix = "model.layers." + name.split(".")[2] + ".self_attn."
            for proj, part in zip("qkv", split_qkv(tensor, shape), strict=True):
                yield f"{prefix}{proj}_proj.{kind}", part
        elif name.endswith(SHARED_FC1):
            prefix = "model.layers." + name.split(".")[2] + ".feed_forward.shared_expert."
            gate, up = torch.chunk(tensor, 2, dim=0)
            yield prefix + "gate_proj.weight", gate.clone()
            yield prefix + "up_proj.weight", up.clone()
        elif name.endswith("mlp.linear_fc1.weight"):
            prefix = "model.layers." + name.split(".")[2] + ".mlp."
            gate, up = torch.chunk(tensor, 2, dim=0)
            yield prefix + "gate_proj.weight", gate.clone()
            yield prefix + "up_proj.weight", up.clone()
        elif name == "output_layer.weight" and shape.tie_word_embeddings:
            continue  # the shared embedding already produced model.embed_tokens.weight
        else:
            raise ConversionError(f"no Hugging Face name for Megatron tensor {name!r}")
    if pending:
        (layer, kind), parts = next(iter(pending.items()))
        raise ConversionError(
            f"layer {layer}'s {kind} came for experts {sorted(parts)} of {shape.num_experts} only"
        )


# ---------------------------------------------------------------------------------------------
# Tensor-parallel sharding

# How each Megatron tensor is split across tensor-parallel ranks: the dim, or None (replicated).
_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "word_embeddings.weight",
    "output_layer.weight",
    # One sink per attention head: each rank holds its heads' (gpt-oss).
    "core_attention.softmax_offset",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_split_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits Megatron tensor ``name`` (None: replicated).

    LoRA adapters (:mod:`nrl_megatron.lora`, ``<layer>.lora_A.<proj>``/``lora_B.<proj>``):
    a column-parallel layer's ``B`` is split along its rows, a row-parallel layer's ``A`` along
    its columns, the other factor is replicated."""
    if ".lora_B." in name and (".linear_qkv." in name or ".linear_fc1." in name):
        return 0
    if ".lora_A." in name and (".linear_proj." in name or ".linear_fc2." in name):
        return 1
    if ".lora_A." in name or ".lora_B." in name:
        return None
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


# ---------------------------------------------------------------------------------------------
# Expert-parallel sharding


def shard_for_ep(
    full: Mapping[str, torch.Tensor], ep_rank: int, ep_size: int, shape: ModelShape
) -> dict[str, torch.Tensor]:
    """This expert-parallel rank's part of a full Megatron state dict: every non-expert tensor,
    and its ``E / ep`` experts (``[ep_rank * E / ep, ...)``), renumbered from 0 as Megatron-Core's
    ``SequentialMLP`` names its local experts."""
    if not shape.is_moe or ep_size == 1:
        return dict(full)
    if shape.num_experts % ep_size:
        raise ConversionError(
            f"expert_model_parallel_size={ep_size} does not divide the {shape.num_experts} "
            "experts; lower policy.megatron.expert_model_parallel_size"
        )
    local = shape.num_experts // ep_size
    first = ep_rank * local
    out = {}
    for name, tensor in full.items():
        expert = expert_index(name)
        if expert is None:
            out[name] = tensor
        elif first <= expert[1] < first + local:
            layer, e, kind = expert
            out[f"decoder.layers.{layer}.{EXPERT_PREFIX}{e - first}.{kind}"] = tensor
    return out


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """The full-model name of local expert tensor ``name`` on expert-parallel rank ``ep_rank``
    (inverse of :func:`shard_for_ep`'s renumbering); other names unchanged."""
    expert = expert_index(name)
    if expert is None:
        return name
    layer, e, kind = expert
    return f"decoder.layers.{layer}.{EXPERT_PREFIX}{ep_rank * num_local_experts + e}.{kind}"
