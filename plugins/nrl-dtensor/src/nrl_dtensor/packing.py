"""Packed sequences through Hugging Face attention: exact per-sample results, no padding.

The core hands the worker one row of back-to-back samples (:class:`nrl_core.packing.
PackedSequences`). The model runs on it with the samples' restarted ``position_ids`` (rotary
embeddings) and, passed down to every attention layer as keyword arguments, the boundaries
``cu_seq_lens_q/k`` and ``max_length_q/k`` (Hugging Face's ``FlashAttentionKwargs``).

:func:`install` gives the model an attention implementation that wraps the one it was loaded
with: a call that carries ``cu_seq_lens_q`` attends within each sample only,

* on CUDA in half precision: one varlen flash-attention kernel over the whole row
  (``flash_attn.flash_attn_varlen_func`` when installed, else torch's
  ``torch.nn.attention.varlen.varlen_attn``);
* otherwise (CPU, float32): causal SDPA within each sample, samples of similar lengths batched
  into one padded call (the kernel the unpacked path runs on each row, so packed and padded
  logprobs agree to float rounding; the linear layers, most of the work, see no padding). Hugging Face's own
  packed path (a block-diagonal mask built from ``position_ids``) computes the ``total x total``
  scores of the whole row instead, most of them masked;

every other call (generation with its padding masks, unpacked training) goes to the wrapped
implementation unchanged. The causal mask the model would build for the packed row is skipped
(:func:`packed_forward`): the attention above needs none.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator

import torch

_PREFIX = "nrl_packed_"
_IN_PACKED_FORWARD = contextvars.ContextVar("nrl_packed_forward", default=False)


def install(model) -> None:
    """Route ``model``'s attention through the packed-aware wrapper (idempotent)."""
    config = model.config
    current = config._attn_implementation
    if current.startswith(_PREFIX):
        return
    name = _register(current)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        config._attn_implementation = name


def _register(original: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = _PREFIX + original
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    wrapped = ALL_ATTENTION_FUNCTIONS[original]
    wrapped_mask = ALL_MASK_ATTENTION_FUNCTIONS[original]

    def attention(module, query, key, value, attention_mask, **kwargs):
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cu_seqlens is None:
            return wrapped(module, query, key, value, attention_mask, **kwargs)
        return packed_attention(module, query, key, value, cu_seqlens, **kwargs)

    def mask(*args, **kwargs):
        return None if _IN_PACKED_FORWARD.get() else wrapped_mask(*args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """Around a forward on packed inputs: the model builds no causal mask (none is read)."""
    token = _IN_PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_PACKED_FORWARD.reset(token)


def model_inputs(packed) -> dict:
    """The keyword arguments of a Hugging Face forward on ``packed`` (already on its device)."""
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "cu_seq_lens_q": packed.cu_seqlens,
        "cu_seq_lens_k": packed.cu_seqlens,
        "max_length_q": packed.max_seqlen,
        "max_length_k": packed.max_seqlen,
    }


def packed_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    max_length_q: int | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sample of a packed row. ``query`` is ``[1, heads, total,
    dim]`` and ``key``/``value`` ``[1, kv_heads, total, dim]`` (Hugging Face's layout);
    returns ``[1, total, heads, dim]`` as Hugging Face attention functions do."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        return _varlen_kernel(
            query, key, value, cu_seqlens, dropout, scaling, sliding_window, max_length_q
        ), None
    if sliding_window is not None:
        raise NotImplementedError(
            "packed sequences with sliding-window attention need CUDA in half precision; "
            "set policy.sequence_packing=false"
        )
    return _grouped_sdpa(module, query, key, value, cu_seqlens, dropout, scaling), None


SLACK = 1.5
"""A group of samples attends in one padded SDPA call while its padded ``count x longest^2``
score matrix is at most this many times its samples' own ``sum(length^2)``."""


def _groups(lengths: list[int]) -> list[list[int]]:
    """Samples longest first, in groups of similar lengths (see :data:`SLACK`)."""
    groups: list[list[int]] = []
    squares = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            longest = lengths[groups[-1][0]]
            grown = squares + lengths[index] ** 2
            if (len(groups[-1]) + 1) * longest**2 <= SLACK * grown:
                groups[-1].append(index)
                squares = grown
                continue
        groups.append([index])
        squares = lengths[index] ** 2
    return groups


def _grouped_sdpa(module, query, key, value, cu_seqlens, dropout, scaling) -> torch.Tensor:
    """Causal SDPA within each sample: samples of similar lengths are gathered into one
    right-padded ``[count, heads, longest, dim]`` batch per group (causal attention never reads
    the padding after a token), the kernel the padded path runs; one call per sample would pay
    a CPU kernel's fixed cost (its threads' start-up) per sample and layer."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = cu_seqlens.tolist()
    starts = bounds[:-1]
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    device = query.device
    # [total, heads, dim]: tokens first, so that gathering a sample's tokens is one index.
    q_tok, k_tok, v_tok = (t[0].transpose(0, 1) for t in (query, key, value))
    outputs, positions = [], []
    for group in _groups(lengths):
        longest = lengths[group[0]]
        src = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in group])
        dst = torch.cat([slot * longest + torch.arange(lengths[i]) for slot, i in enumerate(group)])
        src, dst = src.to(device), dst.to(device)
        shape = (len(group), longest)

        def padded(tokens, shape=shape, src=src, dst=dst):
            flat = tokens.new_zeros((shape[0] * shape[1], *tokens.shape[1:]))
            flat = flat.index_copy(0, dst, tokens.index_select(0, src))
            return flat.view(*shape, *tokens.shape[1:]).transpose(1, 2)

        out, _ = sdpa_attention_forward(
            module,
            padded(q_tok),
            padded(k_tok),
            padded(v_tok),
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )  # [count, longest, heads, dim]
        outputs.append(out.reshape(-1, *out.shape[2:]).index_select(0, dst))
        positions.append(src)
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return torch.cat(outputs).index_select(0, inverse).unsqueeze(0)


def _varlen_kernel(query, key, value, cu_seqlens, dropout, scaling, sliding_window, max_length):
    """One flash-attention varlen call over the packed row (``[1, total, heads, dim]``)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, heads, dim]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int(max_length) if max_length is not None else int((cu[1:] - cu[:-1]).max())
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu,
            longest,
            longest,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
            window_size=(window[0], -1 if window[0] < 0 else 0),  # causal=True bounds the right
        )
    else:
        if dropout:
            raise NotImplementedError(
                "attention dropout with packed sequences needs flash-attn; set "
                "policy.sequence_packing=false"
            )
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(
            q,
            k,
            v,
            cu,
            cu,
            longest,
            longest,
            scale=scaling,
            window_size=window,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    return out.unsqueeze(0)
