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


def packing_refusal(model, device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot take packed rows exactly here, or ``None`` when it can.

    The packed path above keeps samples apart inside softmax attention only. Layers it cannot
    keep apart fall back to padded micro batches (``policy.sequence_packing=auto``) rather
    than mix samples silently:

    * Gated DeltaNet linear attention (Qwen3.5's ``linear_attention`` layers): its causal
      convolution and recurrent state run across the whole row; transformers keeps samples
      apart only through flash-linear-attention's kernels (``fla``, CUDA), and refuses without;
    * attention sinks (gpt-oss's ``sinks``): the packed kernels above have no sink term;
    * chunked attention (Llama 4's ``chunked_attention`` layers): its chunks live in the
      attention mask, which the packed path does not build;
    * sliding windows other than on CUDA in half precision (the only packed kernels with a
      window).
    """
    import importlib.util

    config = model.config
    types = set(getattr(config, "layer_types", None) or [])
    if "linear_attention" in types and importlib.util.find_spec("fla") is None:
        return "Gated DeltaNet layers need flash-linear-attention (fla) for packed sequences"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "the packed attention kernels have no attention-sink term (gpt-oss)"
    if "chunked_attention" in types:
        return "chunked attention (Llama 4) is expressed by a mask the packed path does not build"
    windowed = "sliding_attention" in types or getattr(config, "sliding_window", None)
    half = dtype in (torch.float16, torch.bfloat16)
    if windowed and not (device_type == "cuda" and half):
        return "packed sliding-window attention needs CUDA in half precision"
    if config._attn_implementation == "eager":
        return "the model runs transformers' eager attention, which the packed path cannot wrap"
    return None


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


def _grouped_sdpa(module, query, key, value, cu_seqlens, dropout, scaling) -> torch.Tensor:
    """Causal SDPA within each sample, samples of similar lengths in one right-padded call
    (:func:`nrl_core.packing.attend_within_samples`), the kernel the padded path runs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nrl_core.packing import attend_within_samples

    def attend(q, k, v):
        return sdpa_attention_forward(
            module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True
        )[0]  # [count, longest, heads, dim]

    # [total, heads, dim]: tokens first, so that a sample is a slice of the row.
    q_tok, k_tok, v_tok = (t[0].transpose(0, 1) for t in (query, key, value))
    return attend_within_samples(q_tok, k_tok, v_tok, cu_seqlens, attend).unsqueeze(0)


def varlen_options(varlen_attn, q, k, v, scaling, window):
    """The keyword arguments for torch's ``varlen_attn`` as the installed torch spells them, and
    ``k``/``v`` with their heads repeated where it cannot do grouped-query attention itself.

    torch 2.14 (the lock's) takes ``window_size`` (``(-1, 0)`` is causal) and ``enable_gqa``;
    older builds (2.11 on the GPU machines this ran on) take ``is_causal`` and neither of the
    others, and raised ``TypeError`` on them. A sliding window there is refused by name."""
    import inspect

    params = inspect.signature(varlen_attn).parameters
    options: dict = {"scale": scaling}
    if "window_size" in params:
        options["window_size"] = window
    elif window[0] >= 0:
        raise NotImplementedError(
            "sliding-window attention with packed sequences needs flash-attn or torch>=2.14 "
            "(this torch's varlen_attn has no window_size); set policy.sequence_packing=false"
        )
    else:
        options["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # grouped-query attention by hand: each key/value head serves q/kv query heads
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return k, v, options


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

        k, v, options = varlen_options(varlen_attn, q, k, v, scaling, window)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **options)
    return out.unsqueeze(0)
