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

import contextlib
from collections.abc import Iterator

import torch

METRIC_REDUCTIONS = {"moe/load_cv": "mean", "moe/max_load": "max", "moe/aux_loss": "mean"}
"""How the router statistics combine over ranks (each rank reports its own tokens'):

* ``moe/load_cv``: coefficient of variation (standard deviation / mean) of the tokens routed to
  each expert, averaged over MoE layers; 0 is a perfect balance, ``sqrt(E/k - 1)`` (``E``
  experts, top-``k``) all tokens on the same ``k`` experts. Mean over ranks.
* ``moe/max_load``: the busiest expert's tokens over the mean per expert, the largest over
  layers (1 = balanced, at most ``E/k``). Max over ranks.
* ``moe/aux_loss``: the Switch-Transformer load-balancing loss as transformers computes it
  (``E * sum_e f_e * P_e``, ``f_e`` the fraction of routed tokens per expert times ``k``,
  ``P_e`` the mean softmax probability over all experts), averaged over layers: ``k`` when
  balanced. Mean over ranks.
"""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``TopKRouter`` modules of a Megatron ``GPTModel`` (one per MoE layer), in order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterStatistics:
    """Counts, over the training forwards of one optimizer step, the tokens each router of
    ``model`` sends to each expert (padding excluded) and the sums of its softmax
    probabilities; :meth:`metrics` reports :data:`METRIC_REDUCTIONS`' statistics."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self.num_experts = [r.config.num_moe_experts for r in self.routers]
        self._mask: torch.Tensor | None = None
        self._active = False
        self._reset()
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _reset(self) -> None:
        self._counts = [torch.zeros(e, dtype=torch.float64) for e in self.num_experts]
        self._probs = [torch.zeros(e, dtype=torch.float64) for e in self.num_experts]
        self._tokens = [0.0 for _ in self.num_experts]

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            if not self._active:
                return
            _, routing_map = output
            with torch.no_grad():
                # The router's own logits again (its forward does not return them): the
                # probabilities over *all* experts that the auxiliary loss uses.
                logits = module.gating(args[0]).reshape(routing_map.shape)
                probs = torch.softmax(logits.float(), dim=-1)
                chosen = routing_map
                if self._mask is not None:
                    keep = self._mask.to(chosen.device)
                    probs, chosen = probs[keep], chosen[keep]
                self._counts[index] += chosen.sum(0).to("cpu", torch.float64)
                self._probs[index] += probs.sum(0).to("cpu", torch.float64)
                self._tokens[index] += probs.shape[0]

        return record

    @contextlib.contextmanager
    def collecting(self, valid: torch.Tensor | None) -> Iterator[None]:
        """Count the router forwards run inside. ``valid``: ``[B, T]`` booleans of real tokens
        of the padded micro batch, or None when all are (packed sequences)."""
        # Megatron's hidden states are [s, b, h]: the router's tokens are sequence-major.
        self._mask = None if valid is None else valid.t().reshape(-1)
        self._active = True
        try:
            yield
        finally:
            self._mask, self._active = None, False

    def metrics(self) -> dict[str, float]:
        """This rank's statistics since the last call (then reset); empty when nothing was
        counted."""
        cvs, max_loads, aux = [], [], []
        for counts, probs, tokens, experts in zip(
            self._counts, self._probs, self._tokens, self.num_experts, strict=True
        ):
            if tokens == 0:
                continue
            mean = counts.mean()
            cvs.append(float(counts.std(correction=0) / mean))
            max_loads.append(float(counts.max() / mean))
            fraction = counts / tokens  # sums to top_k
            aux.append(float(experts * (fraction * probs / tokens).sum()))
        self._reset()
        if not cvs:
            return {}
        return {
            "moe/load_cv": sum(cvs) / len(cvs),
            "moe/max_load": max(max_loads),
            "moe/aux_loss": sum(aux) / len(aux),
        }
