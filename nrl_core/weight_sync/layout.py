"""Weight layouts: which tensors, under which names, an engine loads.

Transformers 5 loads some architectures into other tensors than their checkpoint files hold: a
mixture of experts' per-expert files ``model.layers.L.mlp.experts.{e}.gate_proj.weight`` (and
``up_proj``, ``down_proj``) become one stacked ``mlp.experts.gate_up_proj`` ``[experts, 2 *
intermediate, hidden]`` and one ``mlp.experts.down_proj``, and saving reverts that. A policy's
state dict (dtensor's, or Megatron's converted to Hugging Face names) is in the **in-memory**
layout; vLLM's and SGLang's loaders (``load_weights`` with ``make_expert_params_mapping``) only
accept the **checkpoint** layout, the one published folders hold. An engine declares which one
it loads (``weight_layout`` on its options class, :class:`nrl_core.generation.EngineOptions`);
the refit stream is converted here, once for every policy backend, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from nrl_core.weight_sync.interface import WeightSyncError

if TYPE_CHECKING:
    import torch

CHECKPOINT = "checkpoint"
"""The published checkpoint files' tensors and names (what ``save_pretrained`` writes): vLLM,
SGLang and any engine that reads a Hugging Face folder."""
IN_MEMORY = "in_memory"
"""Transformers' loaded model's ``state_dict()`` (nrl's torch engine, which loads the policy's
state dict into a transformers model)."""
WEIGHT_LAYOUTS = (CHECKPOINT, IN_MEMORY)
"""The layouts an engine may declare."""


def hf_skeleton(hf_config: Any) -> Any:
    """A weightless (meta-device) transformers causal LM of ``hf_config``'s architecture: enough
    for :func:`in_layout` to know the architecture's weight conversions, at no memory cost."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def in_layout(
    items: Iterable[tuple[str, torch.Tensor]], layout: str, model: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a transformers state dict (the in-memory layout) in ``layout``.

    ``checkpoint`` reverts transformers' load-time conversions of ``model``'s architecture (a
    transformers ``PreTrainedModel``; a meta-device one from :func:`hf_skeleton` will do) with
    transformers' own ``revert_weight_conversion``, one yielded tensor at a time: a stacked
    ``[experts, ...]`` tensor becomes its per-expert tensors as it passes (transformers'
    split copies them: at most one stacked tensor's size more is held, never the model).
    Tensors without a conversion pass unchanged (all of a dense model's). ``in_memory``
    passes everything unchanged.
    """
    if layout == IN_MEMORY:
        yield from items
        return
    if layout != CHECKPOINT:
        raise WeightSyncError(f"unknown weight layout {layout!r}; use one of {WEIGHT_LAYOUTS}")
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    # Reverting tensor by tensor needs every reverse conversion to read one in-memory tensor:
    # true where loading merges files into one tensor (experts), not where it splits one file
    # into several tensors (a fused qkv file of some vision models), which would need them all.
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        if isinstance(conversion, WeightConverter) and len(conversion.target_patterns) > 1:
            raise WeightSyncError(
                f"{type(model).__name__} loads one checkpoint tensor into several "
                f"({conversion.target_patterns}); streaming it back to the checkpoint layout "
                "is not supported"
            )
    for name, tensor in items:
        yield from revert_weight_conversion(model, {name: tensor}).items()
