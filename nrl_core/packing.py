"""Sequence packing: micro batches without padding.

A padded micro batch is ``[rows, width]`` with ``width`` its longest sample; on a GRPO batch
whose response lengths vary tenfold most of its positions are padding, and every layer computes
on them. Packed, the same samples are one row ``[1, total]`` of their concatenated tokens with

* ``cu_seqlens`` (int32 ``[rows + 1]``): where each sample starts and ends in that row, the
  boundary tensor of varlen attention kernels (flash-attention's ``cu_seqlens_q/k``,
  Megatron's THD ``PackedSeqParams``, and what context parallelism splits by);
* ``position_ids`` (long ``[1, total]``): restarting at 0 at every sample, so rotary embeddings
  see what they see unpacked.

A policy worker that declares ``supports_sequence_packing`` receives
:class:`PackedSequences` in ``compute_logprobs`` / ``forward_backward`` /
``compute_topk_logprobs`` and returns ``[1, total]`` (``[1, total, K]``) values, each sample's
first position holding anything (it is the prediction of that sample's first token from the
previous sample, which no loss reads). :meth:`PackedSequences.unpack` puts them back into
``[rows, width]`` with padding and position 0 at 0, so losses, metrics and normalisers are
those of the unpacked path. A PPO critic's per-token values (a value head) are the exception:
position 0 values the sample's first token, computed within the sample, and is kept
(:attr:`PackedSequences.first_position`).

Which samples share a micro batch (a "bin") is planned on the driver by
:func:`first_fit_decreasing`; the core's training step (:mod:`nrl_core.training`) packs each
bin on its rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from nrl_core.data import Batch

PACKING_MODES: tuple[str, ...] = ("auto", "true", "false")
"""``policy.sequence_packing`` (``auto``, ``true``, ``false``) as :func:`packing_mode` names it."""


def packing_mode(value: str | bool) -> str:
    """``policy.sequence_packing`` (YAML gives ``true``/``false`` as booleans) as one of
    :data:`PACKING_MODES`; ``ValueError`` otherwise."""
    mode = {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value
    if mode not in PACKING_MODES:
        raise ValueError(f"sequence_packing={value!r}; use one of auto, true, false")
    return mode


def first_fit_decreasing(
    lengths: Sequence[int], budget: int, group_size: int = 1
) -> list[list[int]]:
    """Plan bins of at most ``budget`` tokens (first-fit decreasing; deterministic).

    Units of ``group_size`` consecutive rows (2 for a preference loss's (chosen, rejected)
    pairs, which one micro batch must hold together) are taken longest first (ties: lower index
    first) and each goes into the first bin it fits in, else a new bin; a unit longer than the
    budget gets a bin of its own. Returns the row indices of each bin, units in placement order.
    FFD never uses more than 11/9 of the optimal number of bins plus one.
    """
    if budget < 1:
        raise ValueError(f"a packing budget must be >= 1 token, got {budget}")
    if group_size < 1 or len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} rows do not split into units of {group_size}")
    units = [
        (sum(lengths[start : start + group_size]), start)
        for start in range(0, len(lengths), group_size)
    ]
    units.sort(key=lambda unit: (-unit[0], unit[1]))
    bins: list[list[int]] = []
    room: list[int] = []
    for size, start in units:
        index = next((i for i, free in enumerate(room) if size <= free), len(bins))
        if index == len(bins):
            bins.append([])
            room.append(budget)
        bins[index].extend(range(start, start + group_size))
        room[index] -= size
    return bins


@attrs.frozen
class PackedSequences:
    """One micro batch of ``rows`` samples packed into one row of ``total`` tokens."""

    input_ids: torch.Tensor
    """Long ``[1, total]``: the samples' tokens (each cut at its length), back to back."""
    position_ids: torch.Tensor
    """Long ``[1, total]``: ``0 .. length - 1`` for each sample."""
    cu_seqlens: torch.Tensor
    """Int32 ``[rows + 1]``: sample ``i`` is ``input_ids[0, cu_seqlens[i]:cu_seqlens[i+1]]``."""
    max_seqlen: int
    """The longest sample's length (varlen kernels want it as a Python int)."""
    width: int
    """The width of the padded micro batch this came from (what :meth:`unpack` restores)."""
    first_position: bool = False
    """Whether each sample's position 0 holds a result that :meth:`unpack` keeps: per-token
    values (a PPO critic's value head: position 0 values the prefix ending at the sample's
    first token, computed within the sample). Logprobs have none there (position 0 would
    predict the sample's first token from the previous sample): dropped, the default."""
    filler: bool = False
    """Whether this is a filler pass (:func:`nrl_core.training.is_filler`): real tokens run only
    to keep a rank's collectives aligned, which no statistic may count."""
    routed_experts: torch.Tensor | None = None
    """``[1, total, layers, k]``: the generation engine's routing of each packed token
    (:data:`nrl_core.data.ROUTED_EXPERTS`) when the micro batch carries it, else None."""
    routing_weights: torch.Tensor | None = None
    """``[1, total, layers, k]``: the engine's gate weights of those experts
    (:data:`nrl_core.data.ROUTING_WEIGHTS`), else None."""

    @property
    def rows(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def total(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedSequences:
        """The tensors on ``device`` (``cu_seqlens`` too: kernels read it there). The
        boundaries stay known on the host (:func:`host_boundaries` of the moved ``cu_seqlens``
        reads no device memory), so the attention of every layer needs no host sync."""
        moved = self.cu_seqlens.to(device)
        if moved is not self.cu_seqlens:
            _remember_boundaries(moved, host_boundaries(self.cu_seqlens))
        return attrs.evolve(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=moved,
            routed_experts=(
                None if self.routed_experts is None else self.routed_experts.to(device)
            ),
            routing_weights=(
                None if self.routing_weights is None else self.routing_weights.to(device)
            ),
        )

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, width, ...]`` per-token values (e.g. a teacher's top-k ids) in packed
        layout ``[1, total, ...]``."""
        import torch

        index = self._flat_index(values.device)
        flat = values.reshape(values.shape[0] * values.shape[1], *values.shape[2:])
        return torch.index_select(flat, 0, index).unsqueeze(0)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, total, ...]`` per-token values back to ``[rows, width, ...]``, padding and each
        sample's position 0 (no prediction) at 0, unless :attr:`first_position`; differentiable."""
        import torch

        flat = values[0]
        index = self._flat_index(flat.device)
        keep = torch.ones(index.numel(), dtype=torch.bool, device=flat.device)
        if not self.first_position:
            # Position 0 of each sample predicts it from the previous sample: dropped.
            keep[self.cu_seqlens[:-1].to(device=flat.device, dtype=torch.long)] = False
        out = flat.new_zeros((self.rows * self.width, *flat.shape[1:]))
        out = out.index_copy(0, index[keep], flat[keep])
        return out.view(self.rows, self.width, *flat.shape[1:])

    def _flat_index(self, device: torch.device) -> torch.Tensor:
        """For each packed position, its index in the flattened ``[rows * width]`` layout."""
        import torch

        starts = self.cu_seqlens[:-1].to(device=device, dtype=torch.long)
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(device=device, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(self.rows, device=device), lengths)
        positions = torch.arange(self.total, device=device) - torch.repeat_interleave(
            starts, lengths
        )
        return rows * self.width + positions


def pack(batch: Batch) -> PackedSequences:
    """Pack ``batch`` (``input_ids`` ``[rows, width]`` cut at ``lengths``)."""
    import torch

    input_ids = batch["input_ids"]
    rows, width = input_ids.shape
    if "lengths" in batch:
        lengths = batch["lengths"].to(torch.long).clamp(min=1, max=width)
    else:
        lengths = torch.full((rows,), width, dtype=torch.long)
    cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    position_ids = torch.arange(width).expand(rows, width)[valid]
    from nrl_core.data import ROUTED_EXPERTS, ROUTING_WEIGHTS

    routed, weights = batch.get(ROUTED_EXPERTS), batch.get(ROUTING_WEIGHTS)
    return PackedSequences(
        input_ids=input_ids[valid].unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if rows else 0,
        width=width,
        routed_experts=None if routed is None else routed[:, :width][valid].unsqueeze(0),
        routing_weights=None if weights is None else weights[:, :width][valid].unsqueeze(0),
    )


_BOUNDARIES: Any = None
"""``cu_seqlens`` tensor (by identity, weakly held) -> (its ``_version``, its values as a host
list): built on first use (torch's ``WeakIdKeyDictionary``; importing it here would load torch
with the core)."""


def _remember_boundaries(cu_seqlens: torch.Tensor, bounds: list[int]) -> None:
    global _BOUNDARIES
    if _BOUNDARIES is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _BOUNDARIES = WeakIdKeyDictionary()
    _BOUNDARIES[cu_seqlens] = (cu_seqlens._version, bounds)


def host_boundaries(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a host list, read from the tensor once: every layer of a packed
    forward receives the same boundary tensor, and reading a GPU tensor's values waits for
    the stream (a host sync per layer). Remembered per tensor object while it lives and is not
    modified in place (its ``_version``); :meth:`PackedSequences.to` remembers the device copy's
    values from the host tensor, so a forward on it reads nothing from the device."""
    known = None if _BOUNDARIES is None else _BOUNDARIES.get(cu_seqlens)
    if known is not None and known[0] == cu_seqlens._version:
        return known[1]
    bounds = cu_seqlens.tolist()
    _remember_boundaries(cu_seqlens, bounds)
    return bounds


SLACK = 1.5
""":func:`attend_within_samples` batches samples into one padded attention call while the
padded ``count x longest^2`` score matrix is at most this many times the samples' own
``sum(length^2)``."""


def similar_length_groups(lengths: Sequence[int], slack: float = SLACK) -> list[list[int]]:
    """Sample indices longest first (ties: lower index first), cut into groups of similar
    lengths: a sample joins the current group while ``count x longest^2 <= slack x
    sum(length^2)`` holds for it (see :data:`SLACK`)."""
    groups: list[list[int]] = []
    squares = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            longest = lengths[groups[-1][0]]
            grown = squares + lengths[index] ** 2
            if (len(groups[-1]) + 1) * longest**2 <= slack * grown:
                groups[-1].append(index)
                squares = grown
                continue
        groups.append([index])
        squares = lengths[index] ** 2
    return groups


def attend_within_samples(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    bounds: Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention within each sample of a packed row, through a padded-batch kernel.

    ``query`` is ``[total, heads, dim]`` and ``key``/``value`` ``[total, kv_heads, dim]``
    (tokens first, sample ``i`` at ``cu_seqlens[i]:cu_seqlens[i+1]``); returns ``[total,
    heads, dim]``. ``attend(q, k, v)`` is the padded path's causal attention: it takes
    right-padded ``[count, heads, longest, dim]`` (``kv_heads`` for ``k``, ``v``) and returns
    ``[count, longest, heads, dim]``; causal attention never reads the padding after a token,
    so each sample's result is what the padded path computes for it.

    Samples of similar lengths (:func:`similar_length_groups`) share one call: one call per
    sample would pay a CPU kernel's fixed cost per sample and layer. A group of equal-length
    samples lying back to back in the row (first-fit-decreasing bins put a bin's samples
    longest first, so equal lengths are adjacent) is a view of the row: no copy at all. Other
    groups are padded from slices of the row and their outputs sliced back, which autograd
    undoes with slices too (an ``index_select`` gather's backward, an ``index_add`` over the
    row, cost more than the attention itself on CPU), each sample on its own rows only.

    ``bounds``: ``cu_seqlens``' values as a host list, if the caller has them; else
    :func:`host_boundaries` (read once per boundary tensor, not once per layer).
    """
    import torch
    import torch.nn.functional as F

    bounds = list(bounds) if bounds is not None else host_boundaries(cu_seqlens)
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    samples = torch.split(query, lengths), torch.split(key, lengths), torch.split(value, lengths)
    chunks: list[tuple[int, torch.Tensor]] = []  # (where in the row it starts, [n, heads, dim])
    for group in similar_length_groups(lengths):
        longest = lengths[group[0]]
        count = len(group)
        first = bounds[group[0]]
        if all(lengths[i] == longest for i in group) and group == list(
            range(group[0], group[0] + count)
        ):
            span = slice(first, first + count * longest)
            q, k, v = (
                t[span].view(count, longest, *t.shape[1:]).transpose(1, 2)
                for t in (query, key, value)
            )
            out = attend(q, k, v)  # [count, longest, heads, dim]
            chunks.append((first, out.reshape(count * longest, *out.shape[2:])))
            continue
        # pad + stack, unbind + slice: each backward is as linear in the group as its forward
        # (a copy into, or a slice of, the whole padded batch per sample would be quadratic).
        q, k, v = (
            torch.stack(
                [F.pad(pieces[i], (0, 0, 0, 0, 0, longest - lengths[i])) for i in group]
            ).transpose(1, 2)
            for pieces in samples
        )
        rows = attend(q, k, v).unbind(0)
        chunks.extend((bounds[i], rows[slot][: lengths[i]]) for slot, i in enumerate(group))
    chunks.sort(key=lambda chunk: chunk[0])
    return chunks[0][1] if len(chunks) == 1 else torch.cat([chunk for _, chunk in chunks])


def supports_sequence_packing(worker: object) -> bool:
    """Whether a policy worker takes :class:`PackedSequences` (its optional
    ``supports_sequence_packing`` attribute; absent means no). Runs on a rank."""
    return bool(getattr(worker, "supports_sequence_packing", False))
