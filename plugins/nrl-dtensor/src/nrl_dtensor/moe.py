"""Mixture-of-experts models in the dtensor policy: router statistics of the training forwards.

Hugging Face MoE layers (Qwen3-MoE, Mixtral, ... in transformers 5) route each token through a
router module that returns ``(router_logits, top_k_weights, top_k_indices)``; the experts are
one module holding 3-D weights (``[experts, ...]``), which FSDP2 shards along the expert
dimension like any other parameter. These layers are *dropless*: every token reaches its top-k
experts whatever their load (no capacity factor), so no token is ever dropped and there is no
dropped-token fraction to report.

Router auxiliary loss: not added (see docs/moe.md). The HF
models add ``router_aux_loss_coef * aux_loss`` only when called with ``labels``; the policy calls
them without, so the router learns from the RL (or SFT) loss alone, through the top-k weights.
Its load-balancing value is still measured and logged (``moe/aux_loss``).
"""

from __future__ import annotations

import torch

from nrl_core.moe import METRIC_REDUCTIONS
from nrl_core.moe import RouterStatistics as _CoreRouterStatistics

__all__ = ["METRIC_REDUCTIONS", "RouterStatistics", "is_moe_model", "is_router"]


def is_router(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a top-k router of a Hugging Face MoE layer: it has ``top_k`` and
    ``num_experts`` and an ``[experts, hidden]`` weight."""
    weight = getattr(module, "weight", None)
    experts = getattr(module, "num_experts", None)
    return (
        isinstance(getattr(module, "top_k", None), int)
        and isinstance(experts, int)
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.shape[0] == experts
    )


def is_moe_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds at least one router (:func:`is_router`)."""
    return any(is_router(m) for m in model.modules())


class RouterStatistics(_CoreRouterStatistics):
    """The core's router statistics (:class:`nrl_core.moe.RouterStatistics`, what
    :data:`~nrl_core.moe.METRIC_REDUCTIONS` reports), counted from a forward hook on each
    Hugging Face router of ``model`` (tokens batch-major, as the router sees them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = [m for m in model.modules() if is_router(m)]
        super().__init__(found, [r.num_experts for r in found])

    def routing(self, router, args, output) -> tuple[torch.Tensor, torch.Tensor]:
        """A Hugging Face router returns ``(router_logits, top_k_weights, top_k_indices)``;
        Llama 4's returns ``(router_scores, router_logits)``, its top-k the logits' (the
        statistics then measure its choice against the logits' softmax, as for the others)."""
        if len(output) == 2:
            logits = output[1]
            indices = logits.topk(router.top_k, dim=-1).indices
        else:
            logits, _, indices = output
        probs = torch.softmax(logits.detach().float(), dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, indices.reshape(probs.shape[0], -1), 1.0)
        return probs, chosen
