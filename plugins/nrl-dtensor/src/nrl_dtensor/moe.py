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
  (``E * sum_e f_e * P_e`` with ``f_e`` the fraction of routed tokens per expert times ``k`` and
  ``P_e`` the mean router probability), averaged over layers: ``k`` when balanced. Mean over
  ranks.
"""


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


class RouterStatistics:
    """Counts, over the training forwards of one optimizer step, the tokens each router of
    ``model`` sends to each expert (padding excluded) and the router probabilities' sums; see
    :data:`METRIC_REDUCTIONS` for what :meth:`metrics` reports."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if is_router(m)]
        self._mask: torch.Tensor | None = None
        self._active = False
        self._reset()
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _reset(self) -> None:
        experts = [r.num_experts for r in self.routers]
        self._counts = [torch.zeros(e, dtype=torch.float64) for e in experts]
        self._probs = [torch.zeros(e, dtype=torch.float64) for e in experts]
        self._tokens = [0.0 for _ in experts]

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            if not self._active:
                return
            logits, _, indices = output
            with torch.no_grad():
                probs = torch.softmax(logits.detach().float(), dim=-1)
                if self._mask is not None:
                    keep = self._mask.reshape(-1).to(indices.device)
                    probs, indices = probs[keep], indices[keep]
                self._counts[index] += torch.bincount(
                    indices.reshape(-1), minlength=module.num_experts
                ).to("cpu", torch.float64)
                self._probs[index] += probs.sum(0).to("cpu", torch.float64)
                self._tokens[index] += probs.shape[0]

        return record

    @contextlib.contextmanager
    def collecting(self, valid: torch.Tensor | None) -> Iterator[None]:
        """Count the forwards run inside (not a recomputation in the backward: activation
        checkpointing runs the forward twice). ``valid``: ``[B, T]`` booleans of real tokens,
        or None when all are (packed sequences)."""
        self._mask, self._active = valid, True
        try:
            yield
        finally:
            self._mask, self._active = None, False

    def metrics(self) -> dict[str, float]:
        """This rank's statistics since the last call (then reset); empty when nothing was
        counted."""
        cvs, max_loads, aux = [], [], []
        for counts, probs, tokens, router in zip(
            self._counts, self._probs, self._tokens, self.routers, strict=True
        ):
            if tokens == 0:
                continue
            mean = counts.mean()
            cvs.append(float(counts.std(correction=0) / mean))
            max_loads.append(float(counts.max() / mean))
            fraction = counts / tokens  # sums to top_k, as transformers' tokens_per_expert
            aux.append(float(router.num_experts * (fraction * probs / tokens).sum()))
        self._reset()
        if not cvs:
            return {}
        return {
            "moe/load_cv": sum(cvs) / len(cvs),
            "moe/max_load": max(max_loads),
            "moe/aux_loss": sum(aux) / len(aux),
        }
