"""The data that crosses process boundaries: token-id batches, messages, samples, and what an
agent returns (its model calls and trajectory) with the endpoint it is given.

Only token ids, masks, logprobs and scalars travel between the driver and the workers; text
exists only at the environment boundary.

Alignment convention for every per-token tensor ``[B, T]`` in a :class:`Batch`: position ``t``
describes token ``input_ids[:, t]``. ``logprobs[:, t]`` is the log-probability of that token
given ``input_ids[:, :t]``; position 0 has no logprob and holds 0. ``loss_mask[:, t]`` is 1 on
tokens the policy generated (and that count), 0 on prompts, observations, glue and padding.
Sequences are right-padded; ``lengths`` holds each sequence's valid length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import attrs

if TYPE_CHECKING:
    # Imported where tensors are made: samples and messages are read by commands that never
    # touch a tensor (`nrl config show`, `nrl doctor`), and torch takes seconds to import.
    import torch


ROUTED_EXPERTS = "routed_experts"
"""The rollout batch's key for the generation engine's routing: integer ``[B, T, layers, k]``,
``[b, t, l]`` the top-k expert ids MoE layer ``l`` chose for token ``input_ids[b, t]`` when the
engine ran it (as a prompt token in a prefill or as the input of a decode step), in the
router's order; :data:`NOT_RECORDED` where the engine never ran the token (each turn's last
generated token, padding). Sharded, micro-batched and packed with the other per-token fields."""

VERSION_GAPS = "version_gaps"
"""The rollout batch's key (asynchronous GRPO) for how many optimizer steps older than the
trainer's weights the weights that generated each token were: integer ``[B, T]``, aligned with
``loss_mask``; -1 where unknown (prompt, observation and padding positions, or an engine that
recorded no versions). The clipped PG loss reports its mismatch per gap from it."""

VERSION_GAP_BUCKETS = 4
"""Gaps 0 .. this - 2 are reported one by one, this - 1 and more together (fixed keys: every
micro batch and rank reports the same metrics)."""

ROUTING_WEIGHTS = "routing_weights"
"""The rollout batch's key for the engine's gate weights of :data:`ROUTED_EXPERTS`' experts
(float32, same shape and order), present when the engine gives them (the torch engine; vLLM's
capture returns ids only). Where present, replay uses them as the forward's gate weights."""

NOT_RECORDED = -1
"""The expert id of a position the engine did not route (see :data:`ROUTED_EXPERTS`): the
trainer uses its own routing there."""


class Message(TypedDict, total=False):
    """One chat message. ``token_ids`` are exactly the ids that were generated or fed to the
    model for this message (template glue included) — never a re-tokenisation."""

    role: str
    content: str
    token_ids: list[int]


@attrs.define
class Sample:
    """One dataset row before tokenisation."""

    messages: list[Message]
    """The prompt as chat messages (system and user)."""
    answer: Any = None
    """The reference answer the environment checks against."""
    task: str = "default"
    """Routes the sample to its environment in multi-environment runs."""
    metadata: dict[str, Any] = attrs.field(factory=dict)
    """Anything else the environment needs (passed to its first ``step``)."""


class Batch:
    """A dict of tensors sharing the first (batch) dimension, plus per-sample metadata.

    Standard keys (see the module docstring for alignment): ``input_ids`` (long ``[B, T]``),
    ``lengths`` (long ``[B]``), ``loss_mask`` (float ``[B, T]``), ``advantages`` (float
    ``[B, T]``), ``prev_logprobs``, ``gen_logprobs``, ``ref_logprobs`` (float ``[B, T]``),
    ``sample_mask`` (float ``[B]``, 0 drops a whole sample from the loss).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch tensors disagree on the batch size: {sizes}")
        size = next(iter(sizes.values()), len(metadata or []))
        self.metadata: list[dict[str, Any]] = (
            list(metadata) if metadata is not None else [{} for _ in range(size)]
        )
        if len(self.metadata) != size:
            raise ValueError(f"{len(self.metadata)} metadata entries for a batch of {size}")

    def __len__(self) -> int:
        return len(self.metadata)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.shape[0] != len(self):
            raise ValueError(f"{key!r} has {value.shape[0]} rows; the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.tensors.get(key, default)

    def keys(self) -> Iterator[str]:
        return iter(self.tensors)

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The rows at ``indices``, in that order."""
        import torch

        index = torch.as_tensor(indices, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, index) for k, v in self.tensors.items()},
            [self.metadata[i] for i in index.tolist()],
        )

    def slice(self, start: int, stop: int) -> Batch:
        return Batch({k: v[start:stop] for k, v in self.tensors.items()}, self.metadata[start:stop])

    def shard(self, num_shards: int) -> list[Batch]:
        """Split into ``num_shards`` contiguous shards of equal size.

        Raises ``ValueError`` when the batch does not divide evenly: uneven shards would make
        data-parallel ranks disagree on the number of micro batches (and deadlock collectives).
        """
        if len(self) % num_shards:
            raise ValueError(
                f"a batch of {len(self)} samples cannot be split evenly over {num_shards} "
                "data-parallel ranks; choose batch sizes divisible by the data-parallel size"
            )
        step = len(self) // num_shards
        return [self.slice(i * step, (i + 1) * step) for i in range(num_shards)]

    def micro_batches(self, size: int) -> Iterator[Batch]:
        for start in range(0, len(self), size):
            yield self.slice(start, min(start + size, len(self)))

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.metadata)

    def trimmed(self) -> Batch:
        """The same batch with trailing all-padding columns removed (from ``lengths``)."""
        if "lengths" not in self or len(self) == 0:
            return self
        width = int(self.tensors["lengths"].max())
        return Batch(
            {
                k: (v[:, :width] if v.dim() >= 2 and k != "lengths" else v)
                for k, v in self.tensors.items()
            },
            self.metadata,
        )

    @staticmethod
    def concat(batches: Sequence[Batch], pad_values: Mapping[str, float] | None = None) -> Batch:
        """Concatenate along the batch dimension, right-padding ``[B, T, ...]`` tensors to one
        width ``T``."""
        if not batches:
            return Batch()
        import torch

        pad_values = pad_values or {}
        keys = list(batches[0].tensors)
        tensors = {}
        for key in keys:
            parts = [b.tensors[key] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                # The engine's routing pads with "not recorded".
                fill = pad_values.get(key, NOT_RECORDED if key == ROUTED_EXPERTS else 0)
                # Pad dimension 1 (``[B, T, ...]``: F.pad lists the last dimension first).
                parts = [
                    torch.nn.functional.pad(
                        p, [0, 0] * (p.dim() - 2) + [0, width - p.shape[1]], value=fill
                    )
                    if p.shape[1] < width
                    else p
                    for p in parts
                ]
            tensors[key] = torch.cat(parts, dim=0)
        return Batch(tensors, [m for b in batches for m in b.metadata])

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Batch(size={len(self)}, {shapes})"


def pad_sequences(
    sequences: Sequence[Sequence[int]] | Sequence[Sequence[float]],
    pad_value: float = 0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Right-pad variable-length sequences into one ``[B, max_len]`` tensor (``dtype``:
    ``torch.long`` unless given)."""
    import torch

    dtype = torch.long if dtype is None else dtype
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), pad_value, dtype=dtype)
    for i, seq in enumerate(sequences):
        if len(seq):
            out[i, : len(seq)] = torch.as_tensor(seq, dtype=dtype)
    return out


def split_even(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Split ``items`` into ``parts`` contiguous chunks whose sizes differ by at most one (some
    may be empty): how prompts and environment batches are spread over workers."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


# ---------------------------------------------------------------------------------------------
# What an agent gets and returns (nrl_core.agents runs agents; the types sit here, below the
# interfaces that name them)


@attrs.frozen
class Endpoint:
    """Where an agent reaches the policy."""

    base_url: str
    """The OpenAI base URL, ending in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``)."""
    model: str
    """The model id to send (``GET /v1/models`` lists it)."""
    api_key: str | None = None
    """The bearer token the endpoint expects, or None when it expects none."""

    @property
    def root_url(self) -> str:
        """The server's root (``base_url`` without ``/v1``), where ``/tokenize`` and
        ``/inference/v1/generate`` live."""
        return self.base_url.removesuffix("/").removesuffix("/v1")


def token_id_problem(ids: Sequence[Any], what: str, vocab: int) -> str | None:
    """None when every item of ``ids`` is a token id of the vocabulary (an int in
    ``0..vocab-1``); else one line naming ``what`` and the first item that is not. The one
    check both the policy endpoint (a request's ids) and the core (an agent's trajectory)
    apply: an id outside the vocabulary cannot be decoded or embedded."""
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab:
            return f"{what} must hold token ids in 0..{vocab - 1} (the vocabulary), got {i!r:.40}"
    return None


@attrs.frozen
class ModelCall:
    """One call of the policy, with the exact ids it saw and produced."""

    prompt_token_ids: list[int]
    """Every id the model was conditioned on, in order."""
    generation_token_ids: list[int]
    """The ids it generated (the stop token included when hit)."""
    generation_log_probs: list[float]
    """The logprob of each generated id under the sampling policy (same length)."""

    def __attrs_post_init__(self) -> None:
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"a model call has {len(self.generation_token_ids)} generated ids but "
                f"{len(self.generation_log_probs)} logprobs; they must pair up"
            )


@attrs.frozen
class Trajectory:
    """What an agent made of one row."""

    calls: list[ModelCall]
    """The model calls in the order they were made (empty when the row failed before any)."""
    reward: float = 0.0
    """The verifier's reward for the finished conversation."""
    failure_reason: str | None = None
    """Why the row failed (the agent's or a server's error), or None. A failed row is masked
    out of the loss and counted in ``train/agent_failures``."""
    finish_reason: str = "stop"
    """How the LAST call ended: ``"stop"`` or ``"length"`` (for overlong filtering)."""
    metrics: dict[str, float] = attrs.field(factory=dict)
    """The environment's own numbers for this row (NeMo Gym: what its verifier returned next
    to the reward), logged per task as ``<split>/<task>/agent/<name>`` (mean over the rows
    that have it)."""
