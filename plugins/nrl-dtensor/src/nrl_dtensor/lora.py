"""LoRA adapters under tensor parallelism: where peft's ``lora_A`` / ``lora_B`` of an adapted
projection go in the dtensor policy's TP plan.

peft wraps an adapted ``nn.Linear`` as ``<name>.base_layer`` (the frozen weight) plus
``<name>.lora_A.default`` (``rank x in``) and ``<name>.lora_B.default`` (``out x rank``); its
forward is ``base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank``. The adapter path is
split the way the base weight is, so that both sum on the same shards and the math is the
single process's:

- a column-parallel base (output features sharded, input replicated): ``lora_A`` stays whole
  (its input is the replicated ``x``), ``lora_B`` is column-parallel (its output features
  sharded like the base's). ``lora_B``'s input enters as a replicated DTensor, so the gradient
  reaching ``lora_A`` is summed over the TP ranks, as for any column-parallel input.
- a row-parallel base (input features sharded, output all-reduced): ``lora_A`` is row-parallel
  (its input is the same local shard of ``x``; its ``rank``-wide output is all-reduced),
  ``lora_B`` stays whole (its input, and the output it adds, are replicated).

The adapters' full tensors (refits, ``lora_adapter_tensors``, ``export_hf``) come from
``full_tensor()`` of the sharded ones, as every other weight's.
"""

from __future__ import annotations

from typing import Any

ADAPTER = "default"
"""The name peft gives the one adapter a policy trains."""


def lora_tensor_parallel_plan(layer: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (module path in ``layer`` -> ``ColwiseParallel()`` / ``RowwiseParallel()``)
    for a decoder ``layer`` whose projections peft may have wrapped: an adapted projection's
    entry becomes entries for its ``base_layer`` and adapter (see the module docstring); a
    projection without an adapter keeps its entry."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    expanded: dict[str, Any] = {}
    for path, style in plan.items():
        module = layer.get_submodule(path)
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            expanded[path] = style
            continue
        expanded[f"{path}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            expanded[f"{path}.lora_B.{ADAPTER}"] = ColwiseParallel()
        elif isinstance(style, RowwiseParallel):
            expanded[f"{path}.lora_A.{ADAPTER}"] = RowwiseParallel()
        else:  # a plan entry this module does not know how to split an adapter for
            raise TypeError(f"no LoRA placement for {type(style).__name__} at {path}")
    return expanded
