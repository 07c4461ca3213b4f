"""Router statistics of mixture-of-experts models, the same for every policy backend.

A policy plugin finds its routers and hooks their forwards (each library's router returns a
different tuple); per forward it hands this module the router's softmax probabilities over all
experts and which experts each token was sent to (:meth:`RouterStatistics.count`). The counting
over a step's micro batches, the padding mask, the statistics and how they combine over ranks
live here once, so that ``train/moe/*`` means the same thing in every backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# The routing's batch keys live with the batch (packing reads them without this module);
# re-exported here, where the rest of router replay is.
from nrl_core.data import NOT_RECORDED as NOT_RECORDED
from nrl_core.data import ROUTED_EXPERTS as ROUTED_EXPERTS
from nrl_core.data import ROUTING_WEIGHTS as ROUTING_WEIGHTS

METRIC_REDUCTIONS = {
    "moe/load_cv": "mean",
    "moe/max_load": "max",
    "moe/aux_loss": "mean",
    "moe/routing_agreement": "mean",
}
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
* ``moe/routing_agreement``: the fraction of (token, MoE layer) pairs whose top-k expert *set*
  in the trainer's training forward equals the one the generation engine recorded
  (:data:`ROUTED_EXPERTS`), over the tokens the engine recorded; 1 = the trainer routes every
  token as the engine did. Reported only when the batch carries the engine's routing
  (``policy.moe.record_routing`` or ``router_replay``); the trainer's *own* choice is compared,
  also when it replays the engine's. Mean over ranks.
"""


class RouterStatistics:
    """Counts, over the training forwards of one optimizer step, the tokens each MoE layer sends
    to each expert (padding excluded) and the sums of its router's softmax probabilities;
    :meth:`metrics` reports :data:`METRIC_REDUCTIONS`' statistics.

    ``routers``: the router module of each MoE layer, in order; a forward hook on each counts
    what :meth:`routing` reads from its output (a backend subclasses this class and defines
    it). ``num_experts``: the experts of each of those layers. ``sequence_first``: whether the
    router sees the micro batch's tokens sequence-major (Megatron's ``[s, b, h]``) rather than
    batch-major (Hugging Face's ``[b, s, h]``), which decides how the padding mask is
    flattened.
    """

    def __init__(
        self,
        routers: Sequence[torch.nn.Module],
        num_experts: Sequence[int],
        *,
        sequence_first: bool = False,
    ) -> None:
        self.routers = list(routers)
        self.num_experts = list(num_experts)
        self.sequence_first = sequence_first
        self._mask: torch.Tensor | None = None
        self.active = False
        self._reset()
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def routing(
        self, router: torch.nn.Module, args: tuple, output: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From one forward of ``router`` (its positional ``args`` and ``output``): the softmax
        probabilities ``[tokens, experts]`` over all experts, and ``[tokens, experts]`` with 1
        where a token was sent to the expert (see :meth:`count`)."""
        raise NotImplementedError

    def _hook(self, index: int):
        def record(router: torch.nn.Module, args: tuple, output: Any) -> None:
            if self.active:
                self.count(index, *self.routing(router, args, output))

        return record

    def _reset(self) -> None:
        # Per layer, on the device of its router's output (None until counted): accumulating
        # there keeps every forward free of host syncs; metrics() copies once.
        self._counts: list[torch.Tensor | None] = [None] * len(self.num_experts)
        self._probs: list[torch.Tensor | None] = [None] * len(self.num_experts)
        self._tokens: list[torch.Tensor | None] = [None] * len(self.num_experts)

    @contextlib.contextmanager
    def collecting(self, micro_batch: Any) -> Iterator[None]:
        """Count the router forwards run inside, for ``micro_batch`` (a padded
        :class:`~nrl_core.data.Batch`, whose padding is left out, or packed sequences, which
        have none). A filler pass (:func:`nrl_core.training.is_filler`) counts nothing. Not a
        recomputation in the backward: call it around the forward only."""
        from nrl_core.packing import PackedSequences
        from nrl_core.training import is_filler, valid_token_mask

        if is_filler(micro_batch):
            yield
            return
        mask = None
        if not isinstance(micro_batch, PackedSequences) and "lengths" in micro_batch:
            valid = valid_token_mask(micro_batch, micro_batch["input_ids"].shape[1])
            mask = (valid.t() if self.sequence_first else valid).reshape(-1)
        self._mask, self.active = mask, True
        try:
            yield
        finally:
            self._mask, self.active = None, False

    def count(self, layer: int, probs: torch.Tensor, chosen: torch.Tensor) -> None:
        """Add one router forward of MoE layer ``layer``: ``probs`` ``[tokens, experts]``, the
        softmax over all experts; ``chosen`` ``[tokens, experts]``, 1 where a token was sent to
        the expert (its top-k). Tokens in the router's order; padding is dropped here. Sums stay
        on ``probs``' device (no host sync per layer)."""
        if not self.active:
            return
        with torch.no_grad():
            probs, chosen = probs.detach().float(), chosen.detach()
            if self._mask is not None:
                if self._mask.device != probs.device:
                    # Once per micro batch: every layer reuses the moved mask.
                    self._mask = self._mask.to(probs.device, non_blocking=True)
                # Zeroed rows, not a boolean index: indexing would sync to size its output.
                keep = self._mask[:, None]
                probs, chosen = probs * keep, chosen * keep
                tokens = self._mask.sum(dtype=torch.float64)
            else:
                # Filled on the device: a host tensor copied there would wait for the stream.
                tokens = torch.full((), probs.shape[0], dtype=torch.float64, device=probs.device)
            sums = (chosen.sum(0, dtype=torch.float64), probs.sum(0, dtype=torch.float64), tokens)
            if self._counts[layer] is None:
                self._counts[layer], self._probs[layer], self._tokens[layer] = sums
            else:
                self._counts[layer] += sums[0]
                self._probs[layer] += sums[1]
                self._tokens[layer] += sums[2]

    def _host_sums(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """Each counted layer's (counts, probability sums, tokens) on the host, in one copy."""
        layers = [i for i, counts in enumerate(self._counts) if counts is not None]
        if not layers:
            return []
        device = self._counts[layers[0]].device
        flat = torch.cat(
            [
                torch.cat([self._counts[i], self._probs[i], self._tokens[i].reshape(1)]).to(device)
                for i in layers
            ]
        ).cpu()
        out, start = [], 0
        for i in layers:
            experts = self.num_experts[i]
            piece = flat[start : start + 2 * experts + 1]
            out.append((piece[:experts], piece[experts : 2 * experts], float(piece[-1])))
            start += 2 * experts + 1
        return out

    def metrics(self) -> dict[str, float]:
        """This rank's statistics since the last call (then reset); empty when nothing was
        counted. The one host copy of the step's sums happens here."""
        cvs, max_loads, aux = [], [], []
        for counts, probs, tokens in self._host_sums():
            experts = counts.numel()
            if tokens == 0:
                continue
            mean = counts.mean()
            cvs.append(float(counts.std(correction=0) / mean))
            max_loads.append(float(counts.max() / mean))
            fraction = counts / tokens  # sums to top_k, as transformers' tokens_per_expert
            aux.append(float(experts * (fraction * probs / tokens).sum()))
        self._reset()
        if not cvs:
            return {}
        return {
            "moe/load_cv": sum(cvs) / len(cvs),
            "moe/max_load": max(max_loads),
            "moe/aux_loss": sum(aux) / len(aux),
        }


# -- router replay (R3) -------------------------------------------------------------------------


def routing_array(experts: Any, length: int) -> torch.Tensor:
    """One sample's engine routing as int16 ``[length, layers, k]`` (an engine's
    ``[n, layers, k]`` array, numpy or torch): cut to ``length`` positions, or extended with
    :data:`NOT_RECORDED` rows for the positions the engine never ran (vLLM leaves out the last
    generated token; the torch engine too)."""
    values = torch.as_tensor(experts).to(torch.int16)
    if values.dim() != 3:
        raise ValueError(f"routed experts must be [tokens, layers, k], got {tuple(values.shape)}")
    if values.shape[0] >= length:
        return values[:length].clone()
    missing = values.new_full((length - values.shape[0], *values.shape[1:]), NOT_RECORDED)
    return torch.cat([values, missing])


def routing_weight_array(weights: Any, length: int) -> torch.Tensor:
    """:func:`routing_array` for the engine's gate weights (float32, 0 where not recorded)."""
    values = torch.as_tensor(weights).to(torch.float32)
    if values.shape[0] >= length:
        return values[:length].clone()
    missing = values.new_zeros((length - values.shape[0], *values.shape[1:]))
    return torch.cat([values, missing])


def merge_routing(
    old: torch.Tensor | None, new: torch.Tensor, recorded_before: torch.Tensor | None = None
) -> torch.Tensor:
    """An episode's routing after another turn: ``new`` covers the whole sequence so far (the
    turn's prompt prefill and its decode steps); positions ``old`` recorded keep their value
    (the routing under which their tokens were sampled), the others (observations, the last
    turn's final token) take ``new``'s. ``recorded_before`` (the old expert ids) decides which
    positions were recorded when merging weights; by default ``old`` itself."""
    if old is None:
        return new
    merged = new.clone()
    keep = old[: new.shape[0]]
    ids = keep if recorded_before is None else recorded_before[: new.shape[0]]
    recorded = (ids != NOT_RECORDED).all(-1, keepdim=True)
    merged[: keep.shape[0]] = torch.where(recorded, keep, merged[: keep.shape[0]])
    return merged


def replayed_weights(
    logits: torch.Tensor, experts: torch.Tensor, *, normalize: bool
) -> torch.Tensor:
    """The gate weights of ``experts`` ``[tokens, k]`` under the trainer's router ``logits``
    ``[tokens, E]``: the softmax over all experts at those ids, renormalised over the ``k``
    when the model's router renormalises its top-k (``normalize``). The same operations as a
    softmax-then-top-k router (Qwen3-MoE), so for the router's own choice the weights are
    bit-identical to its own; differentiable, so the router keeps learning under replay."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


class RouterReplay:
    """The engine's expert choices of one micro batch, handed to each MoE layer's router
    (R3, ``policy.moe.router_replay``), and the routing agreement between engine and trainer
    (``moe/routing_agreement``, :data:`METRIC_REDUCTIONS`).

    A backend hooks its routers and calls :meth:`choose` with layer ``l``'s own top-k ids; it
    routes with what comes back. Inside :meth:`using` a micro batch's
    :data:`ROUTED_EXPERTS` (``[B, T, layers, k]`` padded, ``[1, total, layers, k]`` packed:
    the tokens in the router's order when batch-major) are the engine's; outside it, or
    where a token holds :data:`NOT_RECORDED`, the router's own choice stands. ``replay``
    False only measures the agreement. Sums stay on the device (no host sync per layer).
    """

    def __init__(self, num_layers: int, *, replay: bool) -> None:
        self.num_layers = num_layers
        self.replay = replay
        self._routed: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._count = False
        self._agree: torch.Tensor | None = None
        self._total: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        """Whether a micro batch with the engine's routing is being run."""
        return self._routed is not None

    @contextlib.contextmanager
    def using(
        self,
        routed: torch.Tensor | None,
        weights: torch.Tensor | None = None,
        *,
        count: bool,
    ) -> Iterator[None]:
        """Run the forwards inside with ``routed`` (None: nothing to replay or compare) and
        the engine's gate ``weights`` of those experts (None: the engine gave none);
        ``count`` adds their agreement to :meth:`metrics` (the training forward, not a filler
        pass nor a logprob pass, which would count the same tokens twice)."""
        if routed is not None and routed.shape[-2] != self.num_layers:
            raise ValueError(
                f"the engine recorded routing for {routed.shape[-2]} MoE layers; the model "
                f"has {self.num_layers}: policy and generation must load the same model"
            )
        self._routed = None if routed is None else routed.reshape(-1, *routed.shape[-2:])
        self._weights = (
            None if routed is None or weights is None else weights.reshape(self._routed.shape)
        )
        self._count = count
        try:
            yield
        finally:
            self._routed, self._weights, self._count = None, None, False

    def choose(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """The expert ids ``[tokens, k]`` MoE layer ``layer`` routes with, given its own top-k
        ``own``: the engine's where recorded (with replay), else ``own``."""
        if self._routed is None:
            return own
        if self._routed.shape[0] != own.shape[0] or self._routed.shape[-1] != own.shape[-1]:
            raise ValueError(
                f"MoE layer {layer} routes {tuple(own.shape)} (tokens, k); the engine's routing "
                f"of this micro batch is {tuple(self._routed[:, layer].shape)}"
            )
        if self._routed.device != own.device:
            self._routed = self._routed.to(own.device, non_blocking=True)
        engine = self._routed[:, layer].to(own.dtype)
        recorded = (engine != NOT_RECORDED).all(-1)
        if self._count:
            with torch.no_grad():
                same = (engine.sort(-1).values == own.sort(-1).values).all(-1) & recorded
                sums = (same.sum(dtype=torch.float64), recorded.sum(dtype=torch.float64))
                if self._agree is None:
                    self._agree, self._total = sums
                else:
                    self._agree += sums[0]
                    self._total += sums[1]
        if not self.replay:
            return own
        return torch.where(recorded[:, None], engine, own)

    def gate_weights(
        self, layer: int, chosen: torch.Tensor, recomputed: torch.Tensor
    ) -> torch.Tensor:
        """The gate weights ``[tokens, k]`` layer ``layer`` applies to ``chosen`` (what
        :meth:`choose` returned): the engine's where it gave them, with the gradient of
        ``recomputed`` (the trainer's own weights of ``chosen``, :func:`replayed_weights`):
        ``engine + (recomputed - recomputed.detach())``, so the forward is the engine's and
        the router still learns. ``recomputed`` where the engine gave none."""
        if not self.replay or self._weights is None:
            return recomputed
        if self._weights.device != recomputed.device:
            self._weights = self._weights.to(recomputed.device, non_blocking=True)
        engine = self._weights[:, layer].to(recomputed.dtype)
        recorded = (self._routed[:, layer].to(chosen.device) != NOT_RECORDED).all(-1)
        straight = engine + (recomputed - recomputed.detach())
        return torch.where(recorded[:, None], straight, recomputed)

    def metrics(self) -> dict[str, float]:
        """``moe/routing_agreement`` since the last call (then reset); empty when no recorded
        token was counted."""
        agree, total = self._agree, self._total
        self._agree = self._total = None
        if total is None:
            return {}
        total_value = float(total)
        if total_value == 0:
            return {}
        return {"moe/routing_agreement": float(agree) / total_value}
