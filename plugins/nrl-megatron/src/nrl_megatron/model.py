"""Building a Megatron-Core ``GPTModel`` for a Llama/Qwen2 (or Qwen3-MoE, gpt-oss) Hugging Face
config.

Two layer specs:

- GPU with ``policy.megatron.transformer_engine``: Megatron-Core's Transformer Engine spec
  (``get_gpt_layer_with_transformer_engine_spec``, extra ``te``).
- Otherwise the local spec (:func:`local_layer_spec`) with its core attention replaced by
  :class:`SDPAttention` (PyTorch scaled-dot-product attention) and, for MoE, its experts by
  :class:`~nrl_megatron.grouped_experts.GroupedMatmulExperts` (grouped GEMM).
  Megatron-Core's own local ``DotProductAttention`` takes its score buffer from
  ``parallel_state``'s global memory buffer and its dropout RNG from the CUDA RNG tracker, so
  it cannot run without a GPU.

gpt-oss (:func:`gpt_oss_settings`): megatron-core's own switches where its layers read them
(``add_bias_linear``, the experts' clamped gate ``activation_func_clamp_value`` and
``glu_linear_offset``), and :class:`SDPAttention` for what its local attention would do on a
GPU only: the learnable softmax offset (``softmax_type='learnable'``, one sink logit per head)
and the sliding window of the layers ``window_attn_skip_freq`` marks. YaRN RoPE
(:func:`yarn_inv_freq`): transformers' frequencies in the rotary embedding, its cos/sin factor
squared into ``softmax_scale``.

Llama 4 (:func:`llama4_settings`, :class:`Llama4Attention`): megatron-core's interleaved RoPE
(``rotary_interleaved``), its RoPE skipped on the NoPE layers (``no_rope_freq``, which
megatron-core's ``Attention.forward`` reads), the sigmoid top-1 router weighting the experts'
input (``moe_apply_probs_on_input``) and the shared expert; :class:`SDPAttention` for the
chunked attention, the q/k L2 norm of the RoPE layers and the attention temperature tuning of
the NoPE layers.

On CPU the rotary embedding is also replaced by :class:`DeviceRotaryEmbedding`: Megatron-Core
0.16's ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()`` on
the first forward; for the same reason an MoE layer's router is :class:`DeviceTopKRouter`.

Importing this module imports megatron-core (the plugin's ``engine`` extra).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from nrl_core.errors import NrlError
from nrl_megatron.convert import ModelShape, tp_split_dim
from nrl_megatron.grouped_experts import GroupedMatmulExperts


class MegatronModelError(NrlError):
    """The Hugging Face model uses a feature this Megatron builder does not reproduce."""


@attrs.frozen
class Llama4Attention:
    """What Llama 4's attention adds to a plain causal one, per layer (transformers 5's
    ``Llama4TextAttention``, ``create_chunked_causal_mask``), for :class:`SDPAttention`."""

    chunked: tuple[bool, ...]
    """Per layer: query ``i`` sees keys ``j <= i`` of its own chunk only (``i // chunk_size ==
    j // chunk_size``); the ``chunked_attention`` of ``layer_types``."""
    chunk_size: int
    rope: tuple[bool, ...]
    """Per layer: RoPE applied (``no_rope_layers``, 1: RoPE); the others are NoPE layers."""
    qk_norm_eps: float | None
    """On the RoPE layers: the weightless L2 norm ``x / sqrt(mean(x^2) + eps)`` of each query
    and key head after RoPE (``use_qk_norm``); None: off."""
    temperature: tuple[float, float] | None
    """``(floor_scale, attn_scale)``: on the NoPE layers each query at position ``p`` (from 0
    in its sample) is scaled by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``
    (``attn_temperature_tuning``); None: off."""

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Llama4Attention:
        """The settings of a ``Llama4TextConfig``."""
        layers = hf_config.num_hidden_layers
        types = list(hf_config.layer_types)
        rope = [bool(r) for r in hf_config.no_rope_layers]
        if len(types) != layers or len(rope) != layers:
            raise MegatronModelError(
                f"Llama 4 layer_types {types} / no_rope_layers {hf_config.no_rope_layers} do "
                f"not name each of the {layers} layers"
            )
        if not set(types) <= {"chunked_attention", "full_attention"}:
            raise MegatronModelError(
                f"Llama 4 layer_types {types}: only 'chunked_attention'/'full_attention' run"
            )
        tuning = bool(getattr(hf_config, "attn_temperature_tuning", False))
        return cls(
            chunked=tuple(t == "chunked_attention" for t in types),
            chunk_size=int(hf_config.attention_chunk_size or 0),
            rope=tuple(rope),
            qk_norm_eps=float(hf_config.rms_norm_eps) if hf_config.use_qk_norm else None,
            temperature=(float(hf_config.floor_scale), float(hf_config.attn_scale))
            if tuning
            else None,
        )


class SDPAttention(MegatronModule):
    """Causal core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for Megatron-Core's ``DotProductAttention`` (same constructor and forward
    signature, same ``[s, b, heads, dim]`` in and ``[s, b, heads * dim]`` out), without CUDA
    buffers. Grouped-query attention maps query head ``i`` to key/value head
    ``i // (heads / groups)``, as Megatron-Core and Hugging Face both do.

    Padding needs no mask: sequences are right-padded and attention is causal, so padding
    never influences a valid position.

    Two of megatron-core's attention options, read from the config as its own
    ``DotProductAttention`` reads them (which would build its offset on the GPU):

    - ``softmax_type='learnable'``: the parameter ``softmax_offset`` (``[heads]``, the heads of
      this tensor-parallel rank), one logit per head that joins every query's softmax
      denominator and attends to nothing (gpt-oss's sinks): ``softmax([scores, offset])``
      without its last column.
    - ``window_size=(left, right)`` on the layers :func:`is_layer_window_attention` selects
      (``window_attn_skip_freq``): query ``i`` sees keys ``i - left .. i`` (causal, so
      ``right`` must be 0). A Hugging Face ``sliding_window`` of ``w`` tokens is ``left = w -
      1`` (transformers' mask keeps ``kv > q - w``).

    And Llama 4's (``llama4``, a :class:`Llama4Attention`, given by the layer spec): on its
    chunked layers the chunk mask, on its RoPE layers the q/k L2 norm, on its NoPE layers the
    temperature tuning, each query's position counted from its sample's start (the packed path
    attends per sample).

    The sinks, a window, chunks or the temperature tuning run the attention as explicit
    float32 matrix products (``[b, heads, s, s]`` scores) instead of the fused kernel.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        llama4: Llama4Attention | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise MegatronModelError(
                "context parallelism needs the Transformer Engine spec; set "
                "policy.megatron.transformer_engine=true (GPU) or context_parallel_size=1"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise MegatronModelError(
                f"SDPAttention only implements causal masks, not {attn_mask_type}"
            )
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.heads_per_partition = divide(
            config.num_attention_heads, config.tensor_model_parallel_size
        )
        self.window = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            left, right = config.window_size
            if right != 0:
                raise MegatronModelError(
                    f"SDPAttention runs causal sliding windows only (window_size=({left}, "
                    f"{right}): right must be 0)"
                )
            self.window = left
        self.chunk = None
        self.qk_norm_eps = None
        self.temperature = None
        if llama4 is not None:
            layer = layer_number - 1  # Megatron numbers layers from 1
            if llama4.chunked[layer]:
                self.chunk = llama4.chunk_size
            if llama4.rope[layer]:
                self.qk_norm_eps = llama4.qk_norm_eps
            else:
                self.temperature = llama4.temperature
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            # Zeros until the checkpoint's sinks are loaded (perform_initialization is off).
            self.softmax_offset = torch.nn.Parameter(
                torch.zeros(
                    self.heads_per_partition,
                    dtype=config.params_dtype,
                    device="cpu" if config.use_cpu_initialization else torch.cuda.current_device(),
                )
            )
        elif config.softmax_type != "vanilla":
            raise MegatronModelError(
                f"SDPAttention implements softmax_type 'vanilla' and 'learnable', not "
                f"{config.softmax_type!r}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``[s, b, n, d]`` query and ``[s, b, g, d]`` key/value -> ``[s, b, n * d]``; packed
        (``packed_seq_params`` in the THD layout): ``[t, n, d]`` and ``[t, g, d]`` -> ``[t, n *
        d]``, each sample attending causally within itself only."""
        if attention_bias is not None:
            raise MegatronModelError("SDPAttention does not support attention biases")
        if self.qk_norm_eps is not None:
            # Per token and head, so the same in the padded and the packed layout.
            query, key = _l2_norm(query, self.qk_norm_eps), _l2_norm(key, self.qk_norm_eps)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA on ``[b, n, s, d]`` query and ``[b, g, s, d]`` key/value."""
        explicit = (self.softmax_offset, self.window, self.chunk, self.temperature)
        if any(option is not None for option in explicit):
            return self._explicit(q, k, v)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`_sdpa` with the sliding window, the sinks, the chunks and the temperature
        tuning (class docstring), the scores and softmax in float32."""
        s_q, s_k = q.shape[2], k.shape[2]
        if k.shape[1] != q.shape[1]:  # grouped-query attention: head i reads group i // rep
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Query i sits at key position i + s_k - s_q (the last queries of the keys).
        qi = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        kj = torch.arange(s_k, device=q.device)[None, :]
        allowed = kj <= qi
        if self.window is not None and self.window >= 0:  # -1: unbounded (megatron-core's)
            allowed &= kj >= qi - self.window
        if self.chunk is not None:
            allowed &= kj // self.chunk == qi // self.chunk
        q = q.float()
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            position = qi[:, 0].float()
            scale = torch.log1p(torch.floor((position + 1.0) / floor_scale)) * attn_scale + 1.0
            q = q * scale[:, None]  # [s_q, 1] against [b, n, s_q, d]
        scores = torch.matmul(q, k.float().transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.softmax_offset is not None:
            sink = self.softmax_offset.float().reshape(1, -1, 1, 1)
            scores = torch.cat([scores, sink.expand(q.shape[0], -1, s_q, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        return torch.matmul(probs.to(v.dtype), v)

    def _packed(self, query, key, value, params) -> torch.Tensor:
        """THD: Megatron's attention squeezed the dummy batch dimension (``[t, heads, dim]``).
        Megatron-Core's own local ``DotProductAttention`` refuses packed sequences (0.16.1,
        ``transformer/dot_product_attention.py:153``); this runs the padded path's SDPA kernel
        on the samples, batched by similar lengths (:func:`nrl_core.packing.attend_within_samples`),
        so packed and padded results agree to float rounding."""
        from nrl_core.packing import attend_within_samples

        if params.qkv_format != "thd":
            raise MegatronModelError(
                f"SDPAttention packs only the 'thd' layout, not {params.qkv_format!r}"
            )
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise MegatronModelError("SDPAttention does not support padded THD boundaries")
        same = params.cu_seqlens_q is params.cu_seqlens_kv  # the worker passes one tensor
        if not same and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise MegatronModelError("SDPAttention packs self-attention only (q and kv differ)")
        out = attend_within_samples(
            query,
            key,
            value,
            params.cu_seqlens_q,
            lambda q, k, v: self._sdpa(q, k, v).transpose(1, 2),
        )
        return out.reshape(out.shape[0], -1)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's weightless q/k norm over the head dimension, in float32 (transformers'
    ``Llama4TextL2Norm``; megatron-core's ``L2Norm`` computes the same before RoPE)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class DeviceRotaryEmbedding(RotaryEmbedding):
    """Megatron-Core's ``RotaryEmbedding`` that keeps its frequencies on their own device."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Same as the parent, minus the move to ``torch.cuda.current_device()``."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]


class DeviceTopKRouter(TopKRouter):
    """Megatron-Core's ``TopKRouter`` that computes its gate where its weight is.

    0.16.1's ``Router.gating`` moves a CPU weight to ``torch.cuda.current_device()`` before
    every forward (``transformer/moe/router.py:88-92``), and its ``router_gating_linear`` reads
    ``te_general_gemm``, a name defined only when Transformer Engine is installed
    (``moe_utils.py:1192``: ``NameError`` without it). The same product in plain torch: the
    logits ``input @ weight.T (+ bias)`` computed in ``moe_router_dtype``."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        bias = None if self.bias is None else self.bias.to(router_dtype)
        return F.linear(input.to(router_dtype), self.weight.to(router_dtype), bias)


def _gathered_sizes(n: int, device: torch.device, group: Any) -> list[int]:
    """Every rank's token count (data-parallel ranks may hold micro batches of other shapes)."""
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(group.size())]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.long, device=device), group=group)
    return [int(size) for size in sizes]


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """``x`` ``[sizes[rank], ...]`` of every rank, concatenated in rank order (padded to the
    largest for the collective, then trimmed)."""
    import torch.distributed as dist

    rows = max(sizes)
    padded = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _sum_own_rows(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """The sum over ranks of ``x`` ``[sum(sizes), ...]``, this rank's rows only (a
    reduce-scatter from an all-reduce: gloo has no reduce-scatter)."""
    import torch.distributed as dist

    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]]


class _GatherTokens(torch.autograd.Function):
    """Forward: every rank's rows gathered; backward: the sum of the ranks' gradients of this
    rank's rows (each rank's experts saw them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_own_rows(grad, ctx.sizes, ctx.group), None, None


class _ScatterSumTokens(torch.autograd.Function):
    """Forward: the ranks' partial outputs of every token summed, this rank's rows kept;
    backward: the rows' gradients gathered from every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _sum_own_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class DeviceAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron-Core's allgather token dispatcher with its two collectives on the tokens' own
    device, for expert parallelism on CPU (gloo).

    0.16.1's ``gather_from_sequence_parallel_region`` and ``reduce_scatter_to_...`` allocate
    their outputs on ``torch.cuda.current_device()`` (``tensor_parallel/mappings.py:141, 181``),
    need equal token counts on every rank, and reduce-scatter, which gloo lacks. Here: token
    counts exchanged first (data-parallel ranks' micro batches may differ in shape), rows
    gathered padded and trimmed, the combine an all-reduce keeping this rank's rows. The rest
    (which tokens go to which local expert, permutation, probabilities) is Megatron's own."""

    def token_dispatch(self, hidden_states, probs):
        if self.tp_size > 1 or self.ep_size > 1:
            group = self.tp_ep_group
            self._sizes = _gathered_sizes(hidden_states.shape[0], hidden_states.device, group)
            with torch.no_grad():
                self.routing_map = _all_gather_rows(self.routing_map, self._sizes, group)
            probs = _GatherTokens.apply(probs, self._sizes, group)
            hidden_states = _GatherTokens.apply(hidden_states, self._sizes, group)
        return hidden_states, probs

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            out = hidden_states.to(self.local_probs.dtype)
            out = _ScatterSumTokens.apply(out, self._sizes, self.tp_ep_group)
            hidden_states = out.to(hidden_states.dtype)
        return hidden_states


def _rope_parameters(hf_config: Any) -> tuple[str, dict[str, Any]]:
    """``(rope type, RoPE parameters)`` of a HF config: transformers 5's ``rope_parameters``
    over older configs' ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return rope_type, {**scaling, **params}


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """``rotary_base`` (and Llama 3 scaling) for ``GPTModel`` from a HF config.

    transformers 5 keeps RoPE settings in ``rope_parameters``; older configs use ``rope_theta``
    and ``rope_scaling``. Only the default RoPE and Llama 3.1's scaling (Megatron-Core's
    ``rope_scaling`` hard-codes low/high frequency factors 1 and 4 and an original context of
    8192) are reproduced exactly; anything else is refused rather than silently approximated.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type, merged = _rope_parameters(hf_config)
    # YaRN (checked for gpt-oss only): these base frequencies are replaced by yarn_inv_freq's
    # in build_gpt_model.
    yarn = rope_type == "yarn" and getattr(hf_config, "model_type", None) == "gpt_oss"
    if rope_type == "default" or yarn:
        return {"rotary_base": int(theta), "rope_scaling": False}
    if rope_type == "llama3" and (
        merged.get("low_freq_factor") == 1
        and merged.get("high_freq_factor") == 4
        and merged.get("original_max_position_embeddings") == 8192
    ):
        return {
            "rotary_base": int(theta),
            "rope_scaling": True,
            "rope_scaling_factor": float(merged.get("factor", 8.0)),
        }
    raise MegatronModelError(
        f"RoPE type {rope_type!r} with {merged} is not reproduced by Megatron-Core's GPTModel; "
        "use policy.backend=dtensor for this model"
    )


def yarn_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """YaRN's ``([head_dim / 2] inverse frequencies, attention factor)`` as transformers 5
    computes them for ``rope_type='yarn'`` (``modeling_rope_utils``): each frequency blends the
    original ``1 / theta^(2i/d)`` (fast dimensions, many rotations over the original context)
    with it divided by ``factor`` (slow ones), along a linear ramp between the dimensions
    where the original context makes ``beta_fast`` and ``beta_slow`` rotations; the ramp ends
    rounded outwards to whole dimensions unless ``truncate`` is false (gpt-oss). The attention
    factor (``0.1 ln(factor) + 1`` unless the config sets it or ``mscale``/``mscale_all_dim``)
    multiplies transformers' cos and sin, so it scales every query-key product by its
    square.

    Megatron-Core's ``YarnRotaryEmbedding`` has the same blend but reads its parameters from
    MLA config fields and applies the factor inside the rotary kernels; here the frequencies go
    into the plain rotary embedding and the factor into ``softmax_scale``."""
    p = _rope_parameters(hf_config)[1]
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise MegatronModelError("YaRN with partial_rotary_factor != 1 is not reproduced")
    dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    theta = float(p.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or hf_config.max_position_embeddings / original

    def ramp_end(rotations: float) -> float:
        # The dimension whose wavelength fits ``rotations`` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = ramp_end(p.get("beta_fast") or 32), ramp_end(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    original_freq, scaled_freq = 1.0 / base, 1.0 / (factor * base)
    inv_freq = scaled_freq * ramp + original_freq * (1 - ramp)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return inv_freq, float(attention_factor)


def _is_yarn(hf_config: Any) -> bool:
    """Whether ``hf_config`` uses YaRN RoPE (:func:`rope_settings` refuses it but for gpt-oss)."""
    return _rope_parameters(hf_config)[0] == "yarn"


def gpt_oss_quick_glu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """gpt-oss's gate activation ``x * sigmoid(alpha x)`` (megatron-core's ``quick_gelu`` is
    this at ``alpha = 1.702``, gpt-oss's published value; the config may say otherwise)."""
    return x * torch.sigmoid(alpha * x)


def gpt_oss_settings(hf_config: Any, shape: ModelShape) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that make a Megatron layer a gpt-oss one (empty for
    other families), checked against transformers 5's ``modeling_gpt_oss``:

    - every linear biased (q/k/v/o, router, experts): ``add_bias_linear``;
    - the experts' clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g =
      clamp(gate, max=l)``: megatron-core's gated unit with ``activation_func_clamp_value=l``,
      ``glu_linear_offset=1`` and :func:`gpt_oss_quick_glu` (the converter de-interleaves
      transformers' gate/up columns into Megatron's ``[gate; up]``);
    - attention sinks: ``softmax_type='learnable'``; the sliding window of the
      ``sliding_attention`` layers: ``window_size=(sliding_window - 1, 0)`` with
      ``window_attn_skip_freq`` the per-layer list (1: windowed); both run in
      :class:`SDPAttention`;
    - YaRN's attention factor ``f`` (:func:`yarn_inv_freq`): ``softmax_scale = f^2 /
      sqrt(head_dim)``.
    """
    if shape.model_type != "gpt_oss":
        return {}
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    if len(layer_types) != shape.num_layers or not set(layer_types) <= {
        "sliding_attention",
        "full_attention",
    }:
        raise MegatronModelError(
            f"gpt-oss layer_types {layer_types} are not one of 'sliding_attention'/"
            f"'full_attention' per layer ({shape.num_layers} layers)"
        )
    windowed = [int(t == "sliding_attention") for t in layer_types]
    window = getattr(hf_config, "sliding_window", None)
    if any(windowed) and not window:
        raise MegatronModelError("gpt-oss has sliding_attention layers but no sliding_window")
    return {
        "softmax_type": "learnable",
        "window_size": (window - 1, 0) if any(windowed) else None,
        "window_attn_skip_freq": windowed if any(windowed) else None,
        "activation_func": functools.partial(gpt_oss_quick_glu, alpha=hf_config.swiglu_alpha),
        "activation_func_clamp_value": float(hf_config.swiglu_limit),
        "glu_linear_offset": 1.0,
    }


def llama4_settings(hf_config: Any, shape: ModelShape) -> dict[str, Any]:
    """The ``TransformerConfig`` attention fields that make a Megatron layer a Llama 4 one
    (empty for other families), checked against transformers 5's ``modeling_llama4``:

    - RoPE on (query, key) pairs of adjacent dimensions (transformers multiplies them as
      complex numbers): ``rotary_interleaved``;
    - no RoPE on the NoPE layers: ``no_rope_freq`` (1: skipped), the complement of
      transformers' ``no_rope_layers`` (1: applied).

    Its MoE fields are :func:`moe_settings`'; the chunks, the L2 norm and the temperature
    tuning are :class:`Llama4Attention`'s, given to :class:`SDPAttention` by the layer spec.
    """
    if shape.model_type != "llama4_text":
        return {}
    no_rope = [0 if rope else 1 for rope in Llama4Attention.from_hf_config(hf_config).rope]
    return {
        "rotary_interleaved": True,
        "no_rope_freq": no_rope if any(no_rope) else None,
    }


UNFUSED: dict[str, bool] = {
    "persist_layer_norm": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "bias_activation_fusion": False,
    "gradient_accumulation_fusion": False,
}
"""Megatron-Core's fusion switches, all off on CPU *and* GPU (they are also 0.16.1's defaults,
``transformer/transformer_config.py:354-371``, ``model_parallel_config.py:168``). Checked
against what the layer specs this module builds do with each:

- ``persist_layer_norm``: the local spec's RMSNorm is ``WrappedTorchNorm``
  (``models/backends.py:104-111``), which asserts it is off (``transformer/torch_norm.py:30``,
  with ``layernorm_zero_centered_gamma``, ``sequence_parallel`` and
  ``memory_efficient_layer_norm``, all off here). Turning it on for GPU stopped the GPU path at
  the first layer.
- ``masked_softmax_fusion``: read only by Megatron's own ``DotProductAttention``
  (``transformer/dot_product_attention.py:104``), which the local spec here replaces with
  :class:`SDPAttention`; the Transformer Engine spec does not read it.
- ``bias_dropout_fusion``: selects ``torch.compile``-d bias-dropout-add functions
  (``fusions/fused_bias_dropout.py:67-90``, ``jit.py:21``). These layers have no linear bias and
  ``hidden_dropout=0``, so there is nothing to fuse, and each new sequence length would
  recompile.
- ``bias_activation_fusion``: fuses fc1's bias into the activation (``transformer/mlp.py:171``,
  jit-compiled kernels); these layers have no linear bias.
- ``gradient_accumulation_fusion``: needs APEX's ``fused_weight_gradient_mlp_cuda``
  (``tensor_parallel/layers.py:924``), which is no dependency of this plugin.
"""


def transformer_config(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dtype: torch.dtype = torch.float32,
    on_gpu: bool = False,
) -> TransformerConfig:
    """The ``TransformerConfig`` equivalent of a Llama/Qwen2/Qwen3-MoE HF config (MoE fields:
    :func:`moe_settings`)."""
    shape = ModelShape.from_hf_config(hf_config)
    # gpt-oss names hidden_act 'silu' but uses its own clamped gate (gpt_oss_settings).
    if shape.model_type != "gpt_oss" and getattr(hf_config, "hidden_act", "silu") != "silu":
        raise MegatronModelError(f"hidden_act={hf_config.hidden_act!r} is not supported (silu)")
    family = {
        "activation_func": F.silu,
        "add_bias_linear": shape.linear_bias,
        **gpt_oss_settings(hf_config, shape),
        **llama4_settings(hf_config, shape),
    }
    if _is_yarn(hf_config):
        family["softmax_scale"] = yarn_inv_freq(hf_config)[1] ** 2 / math.sqrt(shape.head_dim)
    return TransformerConfig(
        **moe_settings(shape, tp=tp, ep=ep, on_gpu=on_gpu),
        **family,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        add_qkv_bias=shape.qkv_bias,
        # Qwen3's q/k RMSNorm. The local spec carries the norm modules; megatron-core 0.16 built
        # them whatever the config said, 0.19 refuses a spec with them unless the config asks
        # ("spec sets q_layernorm=... but qk_layernorm/qk_l2_norm are disabled").
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0) or 0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # Weights come from the HF checkpoint: skip Megatron's random init, build on the host.
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
        **UNFUSED,
    )


def moe_dispatcher(on_gpu: bool) -> str:
    """Megatron-Core's token dispatcher: ``alltoall`` on GPU (each token goes only to the ranks
    of its experts; Megatron's recommended one with expert parallelism), ``allgather`` on CPU.

    0.16.1's ``MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream()`` in its constructor
    (``transformer/moe/token_dispatcher.py:445``), so it cannot even be built without CUDA;
    ``flex`` needs DeepEP. ``allgather`` (every rank gathers the expert-parallel group's tokens
    and probabilities, runs its local experts on the tokens routed to them, and
    reduce-scatters the outputs back) runs over gloo: ``tests/test_moe.py``'s EP=2 test."""
    return "alltoall" if on_gpu else "allgather"


def moe_settings(
    shape: ModelShape, *, tp: int = 1, ep: int = 1, on_gpu: bool = False
) -> dict[str, Any]:
    """The ``TransformerConfig`` MoE fields reproducing a Qwen3-MoE layer (empty for a dense
    model), checked against transformers 5.19's ``Qwen3MoeSparseMoeBlock``/``TopKRouter``:

    - router: ``softmax(logits)`` over all experts, top-k, renormalised when
      ``norm_topk_prob`` (``softmax`` of the top-k *logits*, Megatron's
      ``moe_router_pre_softmax=False``, equals that exactly); without it, softmax before top-k
      and no renormalisation (``pre_softmax=True``). Router in float32 like HF's softmax;
    - no shared expert, no capacity factor (dropless: every token reaches its top-k experts, as
      in HF; no token is ever dropped), no expert bias, no token-drop padding;
    - auxiliary loss off (``moe_router_load_balancing_type="none"``, ``moe_aux_loss_coeff=0``;
      docs/moe.md gives why), no z-loss.

    Llama 4 (``Llama4TextMoe``): the router's top-1 logit through a sigmoid, that score
    multiplying the expert's *input* (``moe_router_score_function='sigmoid'``,
    ``moe_apply_probs_on_input``; top-1 only, :class:`~nrl_megatron.convert.ModelShape`
    refuses more), and a shared expert of its width added to every token's output
    (``moe_shared_expert_intermediate_size``, ungated, not overlapped: the overlap's CUDA
    stream cannot be built on CPU).
    """
    if not shape.is_moe:
        return {}
    if tp != 1:
        raise MegatronModelError(
            "MoE models run with tensor_model_parallel_size=1 in the megatron policy (expert "
            "tensor parallelism is not wired); use expert_model_parallel_size instead"
        )
    if shape.num_experts % ep:
        raise MegatronModelError(
            f"expert_model_parallel_size={ep} does not divide the {shape.num_experts} experts; "
            "lower policy.megatron.expert_model_parallel_size"
        )
    return {
        "num_moe_experts": shape.num_experts,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_topk": shape.num_experts_per_tok,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not shape.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": moe_dispatcher(on_gpu),
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_shared_expert_intermediate_size": None,
        **_llama4_moe(shape),
    }


def _llama4_moe(shape: ModelShape) -> dict[str, Any]:
    """:func:`moe_settings`' Llama 4 fields (empty for other families)."""
    if shape.model_type != "llama4_text":
        return {}
    return {
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_apply_probs_on_input": True,
        "moe_shared_expert_intermediate_size": shape.shared_expert_size,
        "moe_shared_expert_overlap": False,
    }


def local_layer_spec(shape: ModelShape, hf_config: Any = None) -> ModuleSpec:
    """Megatron-Core's local layer spec with :class:`SDPAttention` (for Llama 4 given its
    :class:`Llama4Attention` from ``hf_config``); for MoE, the
    :class:`DeviceTopKRouter` and :class:`~nrl_megatron.grouped_experts.GroupedMatmulExperts`
    (on CPU and GPU alike: on CPU its float32 output and gradients equal ``SequentialMLP``'s
    bit for bit, and it is faster there too, see docs/megatron.md)."""
    spec = get_gpt_layer_local_spec(
        # MoE: SequentialMLP's experts (one ColumnParallel/RowParallel pair per expert; the
        # legacy GroupedMLP that moe_grouped_gemm=True selects needs the grouped_gemm package),
        # TopKRouter, no shared expert (config has no shared size).
        num_experts=shape.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=shape.qk_norm,
        normalization="RMSNorm",
    )
    attention: ModuleSpec = spec.submodules.self_attention
    attention.submodules.core_attention = SDPAttention
    if shape.model_type == "llama4_text":
        if hf_config is None:
            raise MegatronModelError("a Llama 4 layer spec needs its Hugging Face config")
        attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"llama4": Llama4Attention.from_hf_config(hf_config)}
        )
    if shape.is_moe:
        moe = moe_submodules(spec.submodules.mlp)
        # On GPU too: without Transformer Engine Megatron's own gate raises NameError.
        moe.router = DeviceTopKRouter
        # Same modules and parameter names as SequentialMLP, one grouped GEMM per projection
        # instead of a Python loop over the experts (GPU review 3, M3).
        if isinstance(moe.experts, functools.partial):
            moe.experts = functools.partial(
                GroupedMatmulExperts, *moe.experts.args, **moe.experts.keywords
            )
        else:
            moe.experts.module = GroupedMatmulExperts
    return spec


def moe_submodules(mlp: Any) -> Any:
    """The ``MoESubmodules`` (router, experts, shared experts) of a layer spec's MoE ``mlp``:
    a ``ModuleSpec``'s ``submodules`` in megatron-core 0.16, the ``submodules`` keyword of a
    ``functools.partial(MoELayer, ...)`` builder since 0.17 (``get_moe_module_spec_for_backend``
    in models/gpt/moe_module_specs.py, 0.19.2)."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules


def experts_submodules(moe: Any) -> Any:
    """The ``MLPSubmodules`` of each expert in ``moe`` (:func:`moe_submodules`'s result):
    a ``ModuleSpec``'s in 0.16, the experts builder's ``submodules`` keyword since 0.17."""
    experts = moe.experts
    if isinstance(experts, functools.partial):
        return experts.keywords["submodules"]
    return experts.submodules


VALUE_HEAD = "output_layer.value.weight"
"""The state-dict name of a critic's value head (:class:`ValueHead`), a ``[1, hidden]`` weight
replicated on every tensor-parallel rank: not ``output_layer.weight``, which names the
vocab-sharded LM head (:func:`nrl_megatron.convert.tp_split_dim` splits it)."""


class ValueHead(torch.nn.Module):
    """A PPO critic's per-token scalar head in place of the ``GPTModel``'s LM output layer:
    ``hidden -> 1``, no bias, on the final-norm hidden states, as dtensor's
    ``AutoModelForSequenceClassification`` ``score`` head (``num_labels=1``). Starts at zero,
    as dtensor's critic head does (a fresh critic values every prefix at 0: no opinion rather
    than noise the first advantages would carry).

    Replicated, not split, over tensor parallelism: its input (the residual stream after the
    final norm) is whole on every tensor-parallel rank, so each computes the same values and
    the same gradient for the head, and the gradient it sends back into the stream is already
    the whole one (a column-parallel layer all-reduces it because each rank holds only part
    of the columns; here every rank holds all). Pipeline parallelism: on the last stage only,
    as the output layer. Called by ``GPTModel._postprocess`` as the output layer is:
    ``(output, bias)`` of ``[s, b, 1]``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = torch.nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
        torch.nn.init.zeros_(self.value.weight)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return self.value(hidden_states), None


def build_gpt_model(
    hf_config: Any,
    config: TransformerConfig,
    *,
    transformer_engine: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    value_head: bool = False,
) -> GPTModel:
    """A ``GPTModel`` matching ``hf_config`` (weights uninitialised: load them afterwards).

    ``parallel_output=True`` keeps the logits vocab-sharded under tensor parallelism: the
    worker computes logprobs with a vocab-parallel log-softmax instead of gathering them.

    ``value_head``: a PPO critic, whose last stage ends in a :class:`ValueHead` (zeros; the
    model returns ``[B, T, 1]`` values) instead of the LM output layer. Its embeddings are then
    never tied to an output layer, whatever ``hf_config`` says.
    """
    shape = ModelShape.from_hf_config(hf_config)
    if transformer_engine and (shape.is_moe or shape.qk_norm or shape.attention_sinks):
        raise MegatronModelError(
            "mixture-of-experts and Qwen3 models run on the local layer spec only; set "
            "policy.megatron.transformer_engine=false"
        )
    if transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = local_layer_spec(shape, hf_config)
    rope = rope_settings(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **rope,
    )
    if config.use_cpu_initialization:
        model.rotary_pos_emb = DeviceRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=rope["rotary_base"],
            rope_scaling=rope["rope_scaling"],
            rope_scaling_factor=rope.get("rope_scaling_factor", 8.0),
            use_cpu_initialization=True,
        )
    if _is_yarn(hf_config):
        rotary = model.rotary_pos_emb
        # Before any forward: the embedding caches its cos/sin per length (lru_cache).
        rotary.inv_freq = yarn_inv_freq(hf_config)[0].to(rotary.inv_freq.device)
    if shape.is_moe and config.use_cpu_initialization:
        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if type(dispatcher) is MoEAllGatherTokenDispatcher:
                # Same state, CPU-capable collectives (no new attributes to initialise).
                dispatcher.__class__ = DeviceAllGatherTokenDispatcher
    if value_head and post_process:
        # The LM output layer GPTModel built (vocab x hidden) is dropped here, unread.
        model.output_layer = ValueHead(config.hidden_size, config.params_dtype)
    if config.params_dtype != torch.float32:
        # The local spec's RMSNorm (torch.nn.RMSNorm through WrappedTorchNorm) ignores
        # params_dtype and is built in float32. Megatron's trainer casts the whole model for
        # bf16 (Float16Module: ``module.bfloat16()``, megatron-core 0.16.1
        # ``transformer/module.py:440``); cast it the same way, keeping the GPTModel itself
        # (its state-dict names are what the converter and checkpoints use).
        model = model.to(config.params_dtype)
    mark_tensor_parallel_params(model)
    return model


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Set Megatron's ``tensor_model_parallel`` attributes on the split parameters.

    Megatron-Core 0.16 sets them only inside its weight initialisers, which
    ``perform_initialization=False`` skips (weights come from the checkpoint). Without them its
    gradient-norm code (and ours) would count sharded parameters as replicated duplicates.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = tp_split_dim(name)
        if dim is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
