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

from nrl_core.errors import NrlError
from nrl_core.moe import METRIC_REDUCTIONS, RouterReplay, replayed_weights
from nrl_core.moe import RouterStatistics as _CoreRouterStatistics

__all__ = [
    "METRIC_REDUCTIONS",
    "RouterStatistics",
    "RoutingRecorder",
    "is_moe_model",
    "is_router",
    "replay_routers",
]


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


# -- router replay (R3) and the torch engine's routing record -----------------------------------

_REPLAYABLE = {"Qwen3MoeTopKRouter": "norm_topk_prob", "Qwen3_5MoeTopKRouter": None}
"""The routers whose forward is softmax over all experts, top-k, then (per the attribute named
here, None: always) renormalisation of the k weights, returning ``(router_logits,
top_k_weights, top_k_indices)``: the ones :func:`replay_routers` can replay exactly
(transformers 5.24's Qwen3-MoE and Qwen3.5-MoE)."""


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_router(m)]


def replay_routers(model: torch.nn.Module, *, replay: bool) -> RouterReplay:
    """A :class:`~nrl_core.moe.RouterReplay` over ``model``'s MoE layers: a forward hook on
    each router routes with what :meth:`~nrl_core.moe.RouterReplay.choose` returns, with the
    engine's gate weights where it gave them (the torch engine), else weights recomputed from
    this router's logits over the replayed experts (:func:`~nrl_core.moe.replayed_weights`,
    vLLM); either way the router's gradient is its own weights'
    (:meth:`~nrl_core.moe.RouterReplay.gate_weights`). Refuses (one line) a router whose replay is not known to be exact
    (``replay`` only; measuring agreement works for any :func:`is_router`)."""
    routers = _routers(model)
    state = RouterReplay(len(routers), replay=replay)
    for layer, router in enumerate(routers):
        name = type(router).__name__
        if replay and name not in _REPLAYABLE:
            raise NrlError(
                f"policy.moe.router_replay=true: the router {name} is not one nrl replays "
                f"(known: {', '.join(sorted(_REPLAYABLE))}); set policy.moe.router_replay=false"
            )
        router.register_forward_hook(_replay_hook(state, layer))
    return state


def _replay_hook(state: RouterReplay, layer: int):
    def hook(router: torch.nn.Module, args: tuple, output):
        if not state.active or len(output) != 3:
            return None
        logits, _, own = output
        chosen = state.choose(layer, own)
        if chosen is own:
            return None
        norm = _REPLAYABLE.get(type(router).__name__, "norm_topk_prob")
        normalize = True if norm is None else bool(getattr(router, norm, True))
        recomputed = replayed_weights(logits, chosen, normalize=normalize)
        return logits, state.gate_weights(layer, chosen, recomputed), chosen

    return hook


class RoutingRecorder:
    """Records, for the torch engine, the top-k ids and gate weights every router of ``model``
    chooses in each forward (hooks that do nothing between :meth:`stop` and :meth:`start`):
    what the engine returns as :attr:`~nrl_core.interfaces.GenerationOutput.routed_experts`
    and ``routing_weights``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = _routers(model)
        self._steps: list[list[torch.Tensor]] | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def record(router, args, output) -> None:
            if self._steps is None:
                return
            if len(output) == 2:  # Llama 4: (scores, logits), its top-k the logits'
                indices = output[1].topk(router.top_k, dim=-1).indices
                weights = output[0].reshape(indices.shape[0], -1).gather(1, indices)
            else:
                weights, indices = output[1], output[2]
            if layer == 0:
                self._steps.append([])
            self._steps[-1].append((indices.detach().to(torch.int16), weights.detach().float()))

        return record

    def start(self) -> None:
        """Record the forwards from now on (each forward's layers in order)."""
        self._steps = []

    def stop(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Stop; each recorded forward's ids and weights ``[tokens, layers, k]`` (tokens
        batch-major)."""
        steps, self._steps = self._steps or [], None
        return [
            (torch.stack([i for i, _ in layers], 1), torch.stack([w for _, w in layers], 1))
            for layers in steps
        ]
