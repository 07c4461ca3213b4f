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
