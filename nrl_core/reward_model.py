"""Reward models: the scalar-head forward, the Bradley-Terry training loss, and the
``reward_model`` environment that scores GRPO rollouts with a trained reward model.

A reward model is a causal LM with a one-output linear head on its hidden states (Hugging Face
``AutoModelForSequenceClassification`` with ``num_labels=1``). Its per-token values
``v[:, t]`` score the prefix ``input_ids[:, :t + 1]``; the score of a sequence is the value at
its LAST valid token. Policy workers in scalar-head mode return these values where a causal LM
returns logprobs, so the core's batching, sharding and micro batching serve both unchanged.

Imports torch lazily: the driver structures :class:`RewardModelEnvConfig` without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.config.schema import FINITE, ge, one_of, option
from nrl_core.errors import NrlError
from nrl_core.interfaces import EnvStep

if TYPE_CHECKING:
    import torch

    from nrl_core.data import Batch
    from nrl_core.interfaces import GlobalBatchStats


class RewardModelError(NrlError):
    """A reward model folder cannot be used."""


def token_values(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token scalar values ``[B, T]`` (float32) of a sequence-classification model.

    The head's output is captured with a forward hook while the WHOLE model runs, rather than
    by calling the backbone and the head separately: FSDP2 gathers the root module's own
    parameters (embeddings, head) only in the root's forward. The model's own (pooled) output
    joins the result with weight 0: FSDP2 starts its backward bookkeeping (reducing the root's
    gradients, resharding its weights) from hooks on the root's output, so a loss on the
    captured values alone would leave a model sharded as one FSDP unit untrained.
    """
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise RewardModelError(
            f"{type(model).__name__} has no `score` head; use a model that "
            "AutoModelForSequenceClassification supports"
        )
    captured: dict[str, Any] = {}
    handle = head.register_forward_hook(lambda _m, _i, out: captured.__setitem__("values", out))
    try:
        output = model(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    values = captured["values"]
    if hasattr(values, "full_tensor"):
        values = values.full_tensor()
    values = values[..., 0].float()
    pooled = output.logits
    if pooled.requires_grad:
        pooled = pooled.full_tensor() if hasattr(pooled, "full_tensor") else pooled
        values = values + 0.0 * pooled.float().sum()
    return values


def last_token_mask(lengths: Sequence[int], width: int) -> list[list[float]]:
    """A loss mask with one 1 per row, on its last valid token (the token a score reads)."""
    rows = []
    for length in lengths:
        row = [0.0] * width
        if length > 0:
            row[length - 1] = 1.0
        rows.append(row)
    return rows


def sequence_scores(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B]`` scores: each row's value where its ``loss_mask`` is 1 (the last valid token)."""
    import torch

    mask = batch["loss_mask"].to(device=values.device, dtype=values.dtype)
    return torch.where(mask != 0, values, torch.zeros_like(values)).mul(mask).sum(dim=1)


class BradleyTerryLoss:
    """Reward-model loss ``sum_pairs -log sigmoid(s_c - s_r) / N_pairs`` over the GLOBAL batch.

    Runs in the policy workers on scalar-head values (see the module docstring). Batch layout
    as for DPO: rows ``2i`` (chosen) and ``2i + 1`` (rejected) with ``loss_mask`` 1 only on each
    row's last valid token. ``N_pairs = stats.valid_sequences / 2``. Metrics (additive):
    ``loss``, ``accuracy`` (pairs with ``s_c > s_r``), ``margin`` (mean ``s_c - s_r``),
    ``score_chosen`` and ``score_rejected``.
    """

    needs_reference: bool = False
    needs_prev_logprobs: bool = False
    rows_per_sample: int = 2
    """A (chosen, rejected) pair is two consecutive rows (kept in one packed micro batch)."""

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.options = options
        self.context = context

    def __call__(
        self, values: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch of whole pairs."""
        import torch
        import torch.nn.functional as F

        if values.shape[0] % 2:
            raise ValueError(
                f"reward-model training needs (chosen, rejected) row pairs; got a micro batch "
                f"of {values.shape[0]} rows. Use even micro batch sizes."
            )
        scores = sequence_scores(values, batch)
        mask = batch["loss_mask"].to(device=values.device, dtype=values.dtype)
        weight = (mask.sum(dim=1) > 0).to(values.dtype)
        sample_mask = batch.get("sample_mask")
        if sample_mask is not None:
            weight = weight * (sample_mask.to(device=values.device, dtype=values.dtype) != 0)
        pair_weight = weight[0::2] * weight[1::2]
        margin = scores[0::2] - scores[1::2]
        num_pairs = max(stats.valid_sequences / 2, 1.0)
        loss = (pair_weight * -F.logsigmoid(margin)).sum() / num_pairs
        with torch.no_grad():

            def pair_mean(x: torch.Tensor) -> float:
                return float((pair_weight * x).sum() / num_pairs)

            metrics = {
                "loss": float(loss),
                "accuracy": pair_mean((margin > 0).to(margin.dtype)),
                "margin": pair_mean(margin),
                "score_chosen": pair_mean(scores[0::2]),
                "score_rejected": pair_mean(scores[1::2]),
            }
        return loss, metrics


# ---------------------------------------------------------------------------------------------
# The reward_model environment


@attrs.define
class RewardModelEnvConfig:
    """Options of the ``reward_model`` environment (``env.reward_model``)."""

    path: str | None = option(
        None, "Folder of a trained reward model (`nrl convert` of an `nrl run rm` checkpoint)."
    )
    batch_size: int = option(16, "Conversations scored per forward pass.", validator=ge(1))
    max_length: int = option(
        4096, "Longest scored conversation in tokens (longer: truncated).", validator=ge(1)
    )
    scale: float = option(1.0, "The reward is `scale * (score - offset)`.", validator=FINITE)
    offset: float = option(0.0, "Subtracted from the score before scaling.", validator=FINITE)
    device: str = option(
        "auto",
        "`auto` (GPU when available), `cpu` or `cuda`.",
        validator=one_of("auto", "cpu", "cuda"),
    )


class RewardModelEnvironment:
    """Scores each finished conversation with a reward model; single turn.

    The conversation (prompt and response messages) is rendered with the reward model's own
    tokenizer and chat template, exactly as ``nrl run rm`` encoded its training pairs, and the
    reward is the model's score at the last token (see :class:`RewardModelEnvConfig` for the
    scaling). Registered as ``reward_model``.
    """

    def __init__(self, options: RewardModelEnvConfig | None, context: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.options = options or RewardModelEnvConfig()
        if not self.options.path:
            raise RewardModelError(
                "env.reward_model.path is not set; point it at a reward model folder "
                "(`nrl convert <rm checkpoint> --to hf <folder>`)"
            )
        device = self.options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.options.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.options.path, num_labels=1
        )
        self.model.to(self.device).eval()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id

    def score(self, conversations: Sequence[Sequence[dict]]) -> list[float]:
        """The reward model's score of each conversation."""
        import torch

        from nrl_core.chat_data import encode_conversation

        encoded = [
            encode_conversation(
                self.tokenizer,
                [{"role": m["role"], "content": m["content"]} for m in conversation],
                max_length=self.options.max_length,
            )[0]
            for conversation in conversations
        ]
        scores: list[float] = []
        for start in range(0, len(encoded), self.options.batch_size):
            chunk = encoded[start : start + self.options.batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            for i, ids in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.tensor(ids)
            with torch.no_grad():
                values = token_values(self.model, input_ids.to(self.device)).cpu()
            scores.extend(float(values[i, len(ids) - 1]) for i, ids in enumerate(chunk))
        return scores

    def step(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[EnvStep]:
        """One terminal step per conversation with the scaled score as the reward."""
        o = self.options
        return [
            EnvStep(reward=o.scale * (s - o.offset), terminated=True)
            for s in self.score(conversations)
        ]
