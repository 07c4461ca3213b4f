"""Mixture-of-experts models in the megatron policy: router statistics of the training forwards.

Megatron-Core's ``TopKRouter`` returns ``(probs, routing_map)`` for the ``[s * b]`` tokens of
its ``[s, b, hidden]`` input (sequence first): ``routing_map`` ``[tokens, experts]`` marks each
token's top-k experts. The policy builds dropless MoE layers (no capacity factor,
:func:`nrl_megatron.model.moe_settings`): every token reaches its top-k experts whatever their
load, so no token is ever dropped and there is no dropped-token fraction to report.

The statistics are the dtensor policy's ``moe/*`` (same names, same meaning, same reductions
over ranks; docs/moe.md), counted from Megatron's routing: each rank counts the tokens of its
own micro batches (before the token dispatcher moves them to the ranks of their experts).

Router auxiliary loss: off (``moe_router_load_balancing_type="none"``,
``moe_aux_loss_coeff=0``; docs/moe.md gives why). Its load-balancing value is still measured
and logged (``moe/aux_loss``).
"""

from __future__ import annotations

import torch

from nrl_core.moe import METRIC_REDUCTIONS
from nrl_core.moe import RouterStatistics as _CoreRouterStatistics

__all__ = ["METRIC_REDUCTIONS", "RouterStatistics", "routers"]


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``TopKRouter`` modules of a Megatron ``GPTModel`` (one per MoE layer), in order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterStatistics(_CoreRouterStatistics):
    """The core's router statistics (:class:`nrl_core.moe.RouterStatistics`, what
    :data:`~nrl_core.moe.METRIC_REDUCTIONS` reports), counted from a forward hook on each
    ``TopKRouter`` of ``model`` (tokens sequence-major: Megatron's ``[s, b, h]``).

    The probabilities over *all* experts need the router's logits, which 0.16.1's
    ``TopKRouter.forward`` computes (``gating``) and hands to ``self.routing(logits,
    padding_mask)`` but does not return. Each router's ``routing`` is wrapped (on the instance)
    to keep a reference to those logits while counting, so the hook reuses them instead of
    running the router GEMM a second time (review m3)."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = routers(model)
        super().__init__(found, [r.config.num_moe_experts for r in found], sequence_first=True)
        self._logits: dict[int, torch.Tensor] = {}
        for router in found:
            self._keep_logits(router)

    def _keep_logits(self, router: torch.nn.Module) -> None:
        routing = router.routing  # the bound method, called as before

        def routing_keeping_logits(logits: torch.Tensor, *args, **kwargs):
            if self.active:
                self._logits[id(router)] = logits.detach()
            return routing(logits, *args, **kwargs)

        router.routing = routing_keeping_logits

    def routing(self, router, args, output) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's ``TopKRouter`` returns ``(probs, routing_map)``; the softmax over all
        experts comes from the logits its forward routed (kept by the wrapped ``routing``; if
        a release stops calling it, from ``gating`` again: correct, one GEMM slower)."""
        _, routing_map = output
        logits = self._logits.pop(id(router), None)
        if logits is None:
            with torch.no_grad():
                logits = router.gating(args[0])
        return torch.softmax(logits.reshape(routing_map.shape).float(), dim=-1), routing_map
