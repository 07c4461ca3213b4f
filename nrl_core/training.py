"""One training step, written once for every policy plugin.

A policy plugin implements per-rank compute only (:class:`nrl_core.interfaces.PolicyWorker`:
``compute_logprobs`` for one micro batch, ``forward_backward`` for one micro batch,
``optimizer_step``). Everything between micro batches and between ranks lives here:

* **micro batches** — :func:`split_micro_batches` cuts each data-parallel shard by sample count
  or by a token budget, or, with sequence packing, into bins of a token budget
  (:func:`nrl_core.packing.first_fit_decreasing`) that each rank packs into one padding-free row
  (:mod:`nrl_core.packing`) and unpacks to ``[rows, width]`` before the loss; the driver plans every shard, so each rank knows how many forward /
  backward passes the busiest rank runs, and ranks with fewer run masked ones (collectives such
  as FSDP's all-gathers must line up on every rank);
* **loss normalisation** — the loss functions divide by the GLOBAL normalisers
  (:class:`~nrl_core.interfaces.GlobalBatchStats`); :func:`train_on_rank` multiplies each
  micro batch's loss by the data-parallel size, because the plugin's gradient reduction (FSDP,
  Megatron DDP) averages over data-parallel ranks where the global loss needs a sum;
* **metrics** — each micro batch's metrics travel back to the driver, which reduces them over
  micro batches and ranks with the reduction each metric declares (:func:`reduce_metrics`). The
  ``loss`` metric is always the value of the loss that was back-propagated.

The ``*_on_rank`` functions run inside the policy actors: the driver passes them to
:meth:`~nrl_core.distributed.worker_group.WorkerGroup.run_sharded`, which calls them with the
rank's worker object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    import torch

    from nrl_core.data import Batch
    from nrl_core.interfaces import GlobalBatchStats, LossFunction, PolicyWorker
    from nrl_core.packing import PackedSequences

Reduction = Literal["sum", "mean", "max", "min"]
"""How a metric combines over micro batches and ranks.

``sum``: additive contributions (a loss already divided by the global normaliser, a count).
``mean``: the plain mean of the values reported. ``max`` / ``min``: extremes (``ratio_max``).
"""

REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "min")


# ---------------------------------------------------------------------------------------------
# Metric reduction


def metric_reduction(key: str, declared: Mapping[str, str] | None = None) -> Reduction:
    """The reduction of metric ``key``: the declared one, else ``max`` for keys ending in
    ``_max``, ``min`` for keys ending in ``_min``, else ``sum`` (the loss contract)."""
    if declared and key in declared:
        reduction = declared[key]
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"metric {key!r} declares reduction {reduction!r}; use one of {REDUCTIONS}"
            )
        return reduction  # type: ignore[return-value]
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "sum"


def reduce_metrics(
    parts: Sequence[Mapping[str, float]], declared: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Combine the metrics of several micro batches (of one or several ranks).

    A key missing from some parts is reduced over the parts that have it.
    """
    values: dict[str, list[float]] = {}
    for part in parts:
        for key, value in part.items():
            values.setdefault(key, []).append(float(value))
    out: dict[str, float] = {}
    for key, seen in values.items():
        reduction = metric_reduction(key, declared)
        if reduction == "sum":
            out[key] = sum(seen)
        elif reduction == "mean":
            out[key] = sum(seen) / len(seen)
        elif reduction == "max":
            out[key] = max(seen)
        else:
            out[key] = min(seen)
    return out


def declared_reductions(loss_fn: Any) -> dict[str, str]:
    """What a loss function declares in its optional ``metric_reductions`` mapping."""
    return dict(getattr(loss_fn, "metric_reductions", None) or {})


def combine_optimizer_steps(
    per_step: Sequence[Mapping[str, float]], declared: Mapping[str, str] | None = None
) -> dict[str, float]:
    """The metrics of one RL step that took several optimizer steps.

    Each optimizer step's ``sum`` metrics are already global values of that step, so they (and
    ``mean`` metrics, ``grad_norm``) are averaged over the steps; ``max`` / ``min`` take the
    extreme; ``lr`` is the rate of the last step.
    """
    if not per_step:
        return {}
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for step in per_step for k in step):
        seen = [float(step[key]) for step in per_step if key in step]
        reduction = metric_reduction(key, declared)
        if reduction == "max":
            out[key] = max(seen)
        elif reduction == "min":
            out[key] = min(seen)
        else:
            out[key] = sum(seen) / len(seen)
    if "lr" in per_step[-1]:
        out["lr"] = float(per_step[-1]["lr"])
    return out


# ---------------------------------------------------------------------------------------------
# Micro batches (driver side)


def split_micro_batches(batch: Batch, *, size: int, token_budget: int | None = None) -> list[Batch]:
    """Cut one rank's shard into micro batches.

    By count: ``size`` samples each (the last may be smaller). By token budget: samples are
    packed longest first into micro batches of at most ``token_budget`` unpadded tokens (a
    longer sample gets one of its own); similar lengths together waste less padding, and the
    order does not change the summed loss. An empty shard has no micro batch.
    """
    if len(batch) == 0:
        return []
    if not token_budget:
        return list(batch.micro_batches(max(1, size)))
    lengths = batch["lengths"].tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and tokens + lengths[i] > token_budget:
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    groups.append(current)
    return [batch.select(group) for group in groups]


def pack_micro_batches(
    batch: Batch, *, token_budget: int, rows_per_sample: int = 1
) -> tuple[list[Batch], list[int]]:
    """Cut one rank's shard into bins of at most ``token_budget`` unpadded tokens for sequence
    packing (first-fit decreasing over units of ``rows_per_sample`` rows; a longer unit gets a
    bin of its own). Returns the bins and the shard's row order over them (the bins' rows
    concatenated), which the logprob passes undo. An empty shard has no bin."""
    from nrl_core.packing import first_fit_decreasing

    if len(batch) == 0:
        return [], []
    lengths = batch["lengths"].tolist()
    bins = first_fit_decreasing(lengths, token_budget, rows_per_sample)
    return [batch.select(rows) for rows in bins], [row for rows in bins for row in rows]


@attrs.frozen
class RankStepResult:
    """What one rank reports of one optimizer step."""

    micro_batch_metrics: list[dict[str, float]]
    """The metrics of each of this rank's real (not filler) micro batches."""
    grad_norm: float
    """Gradient norm before clipping (the same on every rank)."""
    lr: float
    """The learning rate the step used."""
    step_metrics: dict[str, float] = attrs.field(factory=dict)
    """This rank's own metrics of the step: what ``optimizer_step`` returned besides
    ``grad_norm`` and ``lr`` (a mixture of experts' router statistics, ``moe/*``)."""
    step_reductions: dict[str, str] = attrs.field(factory=dict)
    """How :attr:`step_metrics` combine over ranks: the worker's optional
    ``metric_reductions`` mapping (undeclared keys reduce by :func:`metric_reduction`)."""


# ---------------------------------------------------------------------------------------------
# Inside the policy actors


def valid_token_mask(batch: Batch, width: int) -> torch.Tensor:
    """``[B, width]`` booleans: positions inside each sample's ``lengths``."""
    import torch

    if "lengths" not in batch:
        return torch.ones((len(batch), width), dtype=torch.bool)
    lengths = batch["lengths"]
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


FILLER = "nrl_filler"
"""The metadata key (``True`` on each row) of a filler micro batch (:func:`is_filler`)."""


def _filler(micro_batches: Sequence[Batch], rows: int = 1) -> Batch:
    """A one-sample micro batch (``rows`` rows: a preference pair is two) for a rank that has
    run out: it runs the same collectives and contributes nothing (its loss is multiplied by
    0, and it is marked :func:`is_filler` so that no statistic counts its tokens)."""
    if not micro_batches:
        raise ValueError("a rank received an empty shard; the driver pads shards to >= 1 sample")
    first = micro_batches[0].slice(0, rows)
    return type(first)(first.tensors, [{**row, FILLER: True} for row in first.metadata])


def is_filler(micro_batch: Batch | PackedSequences) -> bool:
    """Whether ``micro_batch`` (padded or packed) is a filler pass: copies of a real sample that
    a rank out of micro batches runs only to keep collectives aligned. A worker's own
    statistics (a mixture of experts' router counts, :mod:`nrl_core.moe`) leave it out."""
    from nrl_core.packing import PackedSequences

    if isinstance(micro_batch, PackedSequences):
        return micro_batch.filler
    return bool(micro_batch.metadata) and bool(micro_batch.metadata[0].get(FILLER, False))


def _packed(micro_batch: Batch, packed: bool | str) -> PackedSequences | None:
    """The packed form of a (trimmed) micro batch when packing is on (a filler stays one).
    ``packed="values"``: the worker returns per-token values (a critic's value head), whose
    position 0 :meth:`~nrl_core.packing.PackedSequences.unpack` keeps."""
    if not packed:
        return None
    from nrl_core.packing import pack

    return attrs.evolve(
        pack(micro_batch), filler=is_filler(micro_batch), first_position=packed == "values"
    )


def train_on_rank(
    worker: PolicyWorker,
    micro_batches: Sequence[Batch],
    num_micro_batches: int,
    loss_fn: LossFunction,
    stats: GlobalBatchStats,
    loss_scale: float,
    packed: bool | str = False,
) -> RankStepResult:
    """One optimizer step of one rank: ``num_micro_batches`` forward/backward passes (this
    rank's micro batches, then fillers), then the worker's optimizer step. With ``packed``,
    the worker receives each micro batch as :class:`~nrl_core.packing.PackedSequences`.

    A worker that must see all micro batches of the step at once (a pipeline schedule, which
    interleaves micro batches across stages) defines ``forward_backward_micro_batches(items)``
    with ``items`` the ``(micro batch, loss closure)`` pairs in order; it returns whether this
    rank called the closures (a pipeline's last stage does, the others hold no logits and
    report no metrics; the driver reads each shard's result from its last stage,
    :meth:`~nrl_core.distributed.worker_group.ParallelLayout.result_rank`)."""
    items, records, real_flags = [], [], []
    for index in range(num_micro_batches):
        real = index < len(micro_batches)
        # Packed bins differ in number between ranks more often than count micro batches do.
        filler = None if real else _filler(micro_batches, rows_per_sample(loss_fn))
        micro_batch = (micro_batches[index] if real else filler).trimmed()
        record: dict[str, float] = {}
        packed_batch = _packed(micro_batch, packed)
        items.append(
            (
                micro_batch if packed_batch is None else packed_batch,
                _loss_closure(
                    micro_batch, loss_fn, stats, loss_scale if real else 0.0, record, packed_batch
                ),
            )
        )
        records.append(record)
        real_flags.append(real)
    all_at_once = getattr(worker, "forward_backward_micro_batches", None)
    if all_at_once is not None:
        computes_loss = bool(all_at_once(items))
    else:
        computes_loss = True
        for micro_batch, closure in items:
            worker.forward_backward(micro_batch, closure)
    if computes_loss and not all(records):
        raise RuntimeError(
            f"{type(worker).__name__}.forward_backward never called the loss closure"
        )
    results = [r for r, real in zip(records, real_flags, strict=True) if real and computes_loss]
    step = worker.optimizer_step()
    return RankStepResult(
        results,
        grad_norm=float(step["grad_norm"]),
        lr=float(step["lr"]),
        step_metrics={k: float(v) for k, v in step.items() if k not in ("grad_norm", "lr")},
        step_reductions=dict(getattr(worker, "metric_reductions", None) or {}),
    )


def _loss_closure(
    micro_batch: Batch,
    loss_fn: LossFunction,
    stats: GlobalBatchStats,
    scale: float,
    record: dict[str, float],
    packed: PackedSequences | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function a worker's ``forward_backward`` calls with its logprobs: masks padding,
    applies the loss, records the metrics, and returns the scaled loss to back-propagate.

    With ``packed`` the worker ran on the packed micro batch: the closure takes its
    ``[1, total]`` logprobs (and ``[1, total, K]`` ones at the ids) and unpacks them to the
    micro batch's ``[B, T]`` first, so the loss sees what it sees unpacked.

    A loss that declares ``logprobs_at_key`` (distillation: the teacher's top-k ids) also needs
    the policy's logprobs at the ``[B, T, K]`` ids in that batch key: the closure carries them
    as :attr:`logprobs_at_ids` and the worker passes ``[B, T, K]`` logprobs as the second
    argument, which the loss finds in ``batch["logprobs_at"]``."""
    ids_key = logprobs_at_key(loss_fn)

    def loss_of(logprobs: torch.Tensor, logprobs_at: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        if packed is not None:
            logprobs = packed.unpack(logprobs)
            if logprobs_at is not None:
                logprobs_at = packed.unpack(logprobs_at)
        batch = micro_batch.to(logprobs.device)
        valid = valid_token_mask(batch, logprobs.shape[1])
        logprobs = logprobs * valid
        if ids_key is not None:
            if logprobs_at is None:
                raise RuntimeError(
                    f"{type(loss_fn).__name__} needs the policy's logprobs at "
                    f"batch[{ids_key!r}], and the policy worker passed none (see "
                    "nrl_core.interfaces.PolicyWorker.forward_backward)"
                )
            # where, not a product: padding may hold -inf, and 0 * -inf is NaN.
            batch["logprobs_at"] = torch.where(valid[:, :, None], logprobs_at, 0.0)
        loss, metrics = loss_fn(logprobs, batch, stats)
        record.update({k: float(v) for k, v in metrics.items()})
        # The value that is back-propagated, whatever the loss function calls `loss`.
        record["loss"] = float(loss.detach())
        return loss * scale

    ids = None if ids_key is None else micro_batch[ids_key]
    loss_of.logprobs_at_ids = ids if ids is None or packed is None else packed.pack(ids)
    return loss_of


def rows_per_sample(loss_fn: Any) -> int:
    """Batch rows per sample of ``loss_fn`` (its optional ``rows_per_sample``: 2 for
    (chosen, rejected) pairs), which one micro batch must hold together."""
    return int(getattr(loss_fn, "rows_per_sample", 1) or 1)


def logprobs_at_key(loss_fn: Any) -> str | None:
    """The batch key of ``[B, T, K]`` token ids at which ``loss_fn`` needs the policy's
    logprobs as well (its optional ``logprobs_at_key``), or None."""
    return getattr(loss_fn, "logprobs_at_key", None)


def logprobs_on_rank(
    worker: PolicyWorker,
    chunks: Sequence[Batch],
    num_chunks: int,
    width: int,
    reference: bool,
    packed: bool | str = False,
) -> torch.Tensor:
    """``[B, width]`` logprobs of this rank's shard, in ``chunks`` (fillers after the last, so
    every rank runs ``num_chunks`` forwards); padding and position 0 hold 0. With ``packed``,
    each chunk goes to the worker packed (:mod:`nrl_core.packing`); ``packed="values"``: a
    critic's per-token values, whose position 0 is kept as it is unpacked.

    A worker that defines ``compute_logprobs_micro_batches(micro_batches, *, reference)`` gets
    all ``num_chunks`` micro batches, fillers included, in one call (a pipeline schedule
    overlaps its stages only across micro batches); others get one ``compute_logprobs`` call
    per micro batch."""
    import torch

    real: list[Batch | None] = []  # each micro batch's trimmed chunk; None for a filler
    packs: list[PackedSequences | None] = []
    sent: list[Batch | PackedSequences] = []  # what the worker receives
    for index in range(num_chunks):
        filler = index >= len(chunks)
        chunk = (_filler(chunks) if filler else chunks[index]).trimmed()
        packed_chunk = _packed(chunk, packed)
        real.append(None if filler else chunk)
        packs.append(packed_chunk)
        sent.append(chunk if packed_chunk is None else packed_chunk)
    out = []
    with torch.no_grad():
        all_at_once = getattr(worker, "compute_logprobs_micro_batches", None)
        if all_at_once is not None:
            results = list(all_at_once(sent, reference=reference))
            if len(results) != len(sent):
                raise RuntimeError(
                    f"{type(worker).__name__}.compute_logprobs_micro_batches returned "
                    f"{len(results)} results for {len(sent)} micro batches"
                )
        else:  # one at a time, each result consumed before the next forward
            results = (worker.compute_logprobs(mb, reference=reference) for mb in sent)
        for chunk, packed_chunk, lp in zip(real, packs, results, strict=True):
            if chunk is None:
                continue  # a filler: run for the collectives, its result unused
            lp = lp.detach()
            if packed_chunk is not None:
                lp = packed_chunk.unpack(lp)
            lp = lp.float().cpu()
            lp = lp * valid_token_mask(chunk, lp.shape[1])
            out.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
    return torch.cat(out) if out else torch.zeros((0, width))


def topk_on_rank(
    worker: PolicyWorker,
    chunks: Sequence[Batch],
    num_chunks: int,
    width: int,
    k: int,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's shard scored by a frozen model (a distillation teacher), in ``chunks``:
    ``[B, width]`` logprobs of the tokens, and ``[B, width, k]`` logprobs and ids of the ``k``
    most likely tokens at each position (every rank runs ``num_chunks`` forwards; padding and
    position 0 hold 0, with id 0). With ``packed``, each chunk goes to the worker packed."""
    import torch

    tokens, values, ids = [], [], []
    with torch.no_grad():
        for index in range(num_chunks):
            if index >= len(chunks):
                filler = _filler(chunks).trimmed()
                worker.compute_topk_logprobs(_packed(filler, packed) or filler, k)
                continue
            chunk = chunks[index].trimmed()
            packed_chunk = _packed(chunk, packed)
            lp, top_lp, top_ids = worker.compute_topk_logprobs(packed_chunk or chunk, k)
            if packed_chunk is not None:
                lp, top_lp, top_ids = (packed_chunk.unpack(t) for t in (lp, top_lp, top_ids))
            valid = valid_token_mask(chunk, lp.shape[1])
            valid[:, 0] = False
            pad = width - lp.shape[1]
            tokens.append(torch.nn.functional.pad(lp.detach().float().cpu() * valid, (0, pad)))
            top_lp = torch.where(valid[..., None], top_lp.detach().float().cpu(), 0.0)
            top_ids = torch.where(valid[..., None], top_ids.detach().long().cpu(), 0)
            values.append(torch.nn.functional.pad(top_lp, (0, 0, 0, pad)))
            ids.append(torch.nn.functional.pad(top_ids, (0, 0, 0, pad)))
    if not tokens:
        empty = torch.zeros((0, width, k))
        return torch.zeros((0, width)), empty, empty.long()
    return torch.cat(tokens), torch.cat(values), torch.cat(ids)
