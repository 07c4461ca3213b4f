"""Token sampling shared by the colocated generators (``nrl_dtensor.generation.TorchGenerator``,
``nrl_megatron.generation.MegatronGenerator``), so both draw tokens and report logprobs the
same way.

- :func:`sample`: one token per row of ``logits [B, V]``: greedy (argmax) when the temperature is
  0, otherwise a draw from ``softmax(logits / T)`` after top-k then top-p filtering. The logprob
  is ``log_softmax(logits / T)`` at the chosen id (``T = 1`` when greedy), taken *before* the
  top-k/top-p truncation, i.e. not renormalised: the trainer's ``get_logprobs`` convention.
- :func:`seeded_generator`: the random stream of one data-parallel rank, offset from the seed by
  :data:`RANK_SEED_STRIDE` per rank so equal prompts on two ranks sample differently.

Imported by the generators only (never by ``nrl_core/__init__`` or the CLI's import path): it
imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nrl_core.interfaces import SamplingParams

RANK_SEED_STRIDE = 1_000_003
"""Offsets a seed per data-parallel rank so equal prompts on two ranks sample differently."""


def seeded_generator(seed: int, rank: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed + RANK_SEED_STRIDE * rank``."""
    rng = torch.Generator(device=device)
    rng.manual_seed(seed + RANK_SEED_STRIDE * rank)
    return rng


def sample(
    logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of full-vocabulary ``logits [B, V]``; return
    ``(tokens, logprobs)``, both ``[B]`` (see the module docstring).

    Uses ``params.temperature``, ``params.top_k`` (``0`` or ``>= V``: off) and ``params.top_p``
    (``1.0``: off); a greedy call consumes nothing from ``rng``, a sampled one draws once
    (``torch.multinomial``) per call.
    """
    logits = logits.float()
    if params.temperature <= 0:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    token = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=rng).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


__all__ = ["RANK_SEED_STRIDE", "sample", "seeded_generator"]
