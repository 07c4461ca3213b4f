"""The driver's view of a policy: one object over the worker group of its ranks.

It owns what is written once for every policy plugin: sharding batches over data-parallel
ranks (padding them to equal shards with masked rows), the global loss normalisers, splitting a
step's samples into optimizer steps and each rank's shard into micro batches, and reducing
metrics (the per-rank half is :mod:`nrl_core.training`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from nrl_core.data import Batch, split_even
from nrl_core.distributed.worker_group import ParallelLayout, Sharded
from nrl_core.errors import NrlError
from nrl_core.interfaces import GenerationOutput, GlobalBatchStats, LossFunction, SamplingParams
from nrl_core.training import (
    combine_optimizer_steps,
    declared_reductions,
    logprobs_on_rank,
    pack_micro_batches,
    reduce_metrics,
    rows_per_sample,
    split_micro_batches,
    topk_on_rank,
    train_on_rank,
)


def policy_layout(options: Any) -> ParallelLayout:
    """The model-parallel layout a policy's options ask for.

    Policy option classes declare their sizes under the usual names (``tensor_parallel_size``
    or Megatron's ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``context_parallel_size``, ``expert_model_parallel_size``); model-parallel peers then
    receive the same data shard (expert parallelism splits the data-parallel ranks' experts and
    receives distinct data).
    """

    def size(*names: str) -> int:
        for name in names:
            value = getattr(options, name, None)
            if value:
                return int(value)
        return 1

    return ParallelLayout(
        tp=size("tensor_parallel_size", "tensor_model_parallel_size"),
        pp=size("pipeline_parallel_size", "pipeline_model_parallel_size"),
        cp=size("context_parallel_size"),
        ep=size("expert_parallel_size", "expert_model_parallel_size"),
    )


def global_batch_stats(batch: Batch, max_sequence_length: int) -> GlobalBatchStats:
    """The loss normalisers of ``batch`` taken as one global batch."""
    mask = batch["loss_mask"].float()
    if "sample_mask" in batch:
        mask = mask * batch["sample_mask"].float()[:, None]
    valid_per_sample = mask.sum(dim=1)
    return GlobalBatchStats(
        valid_tokens=float(valid_per_sample.sum()),
        valid_sequences=float((valid_per_sample > 0).sum()),
        max_sequence_length=max_sequence_length,
    )


def pad_to_multiple(batch: Batch, multiple: int) -> tuple[Batch, int]:
    """Append masked copies of the first row until ``len(batch)`` divides by ``multiple``.

    Returns the padded batch and the number of real rows. Padded rows carry ``sample_mask`` 0
    and ``loss_mask`` 0, so they change neither the loss nor its normalisers.
    """
    real = len(batch)
    missing = (-real) % multiple
    if not missing:
        return batch, real
    filler = batch.select([0] * missing)
    if "loss_mask" in filler:
        filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
    filler["sample_mask"] = torch.zeros(missing, dtype=torch.float32)
    if "sample_mask" not in batch:
        batch = Batch({**batch.tensors, "sample_mask": torch.ones(real)}, batch.metadata)
    return Batch.concat([batch, filler]), real


def padded_peak_tokens(shards: Sequence[Batch], size: int) -> int:
    """The most tokens one padded micro batch of ``size`` samples takes over ``shards``: the
    largest ``rows x longest`` of the chunks :func:`~nrl_core.training.split_micro_batches`
    cuts (each chunk is trimmed to its longest sample before the forward), at least 1.

    Sequence packing bins to this by default: its largest bin then never holds more tokens
    than the padded path's largest micro batch of the same data. A budget of
    ``size x max_total_sequence_length`` would fill every bin to the worst case a padded
    micro batch reaches only when one of its samples has the maximum length.
    """
    peak = 1
    for shard in shards:
        if len(shard) == 0:
            continue
        if "lengths" in shard:
            lengths = shard["lengths"].to(torch.long)
        else:
            lengths = torch.full((len(shard),), shard["input_ids"].shape[1], dtype=torch.long)
        for start in range(0, len(lengths), max(1, size)):
            chunk = lengths[start : start + max(1, size)]
            peak = max(peak, len(chunk) * int(chunk.max()))
    return peak


def _unpermute(values: Any, order: Sequence[int]) -> Any:
    """Rows computed in ``order`` (a tensor, or a tuple of tensors) back in shard order."""
    if isinstance(values, tuple):
        return tuple(_unpermute(v, order) for v in values)
    if not order:
        return values
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return values.index_select(0, inverse)


class Policy:
    """A policy's worker group, seen as one model.

    Args:
        group: the policy ranks (workers honouring :class:`nrl_core.interfaces.PolicyWorker`):
            a :class:`~nrl_core.distributed.worker_group.WorkerGroup`, or an
            :class:`~nrl_core.distributed.worker_group.InProcessGroup` around one worker.
        max_sequence_length: the Dr. GRPO length normaliser (``policy.max_total_sequence_length``).
        train_global_batch_size: samples per optimizer step.
        train_micro_batch_size: samples per forward/backward on one rank.
        logprob_batch_size: samples per forward when computing logprobs.
        micro_batch_token_budget: pack training micro batches up to this many tokens instead
            (``None``: by ``train_micro_batch_size``); with sequence packing, the bin size.
        sequence_packing: ``auto`` (pack where the workers declare
            ``supports_sequence_packing``), ``true`` (pack; an error where they do not) or
            ``false`` (padded micro batches). See :mod:`nrl_core.packing`.
        values: the workers return per-token values (a PPO critic's value head, whose section
            declares ``value_head``) where a causal LM returns logprobs: packed, each sample's
            position 0 then holds its value (of the prefix ending at its first token), which
            unpacking keeps (:attr:`nrl_core.packing.PackedSequences.first_position`).
    """

    def __init__(
        self,
        group: Any,
        *,
        max_sequence_length: int,
        train_global_batch_size: int,
        train_micro_batch_size: int = 4,
        logprob_batch_size: int = 8,
        micro_batch_token_budget: int | None = None,
        sequence_packing: str | bool = "auto",
        values: bool = False,
    ) -> None:
        from nrl_core.packing import packing_mode

        self.group = group
        self.values = values
        self.sequence_packing = packing_mode(sequence_packing)
        self._packing: bool | None = None
        self.max_sequence_length = max_sequence_length
        self.train_global_batch_size = train_global_batch_size
        self.train_micro_batch_size = train_micro_batch_size
        self.logprob_batch_size = logprob_batch_size
        self.micro_batch_token_budget = micro_batch_token_budget
        self.offloaded: set[str] = set()
        """What the ranks hold in CPU memory for colocated engines (see :meth:`offload`)."""
        self._device_sharers: list[Callable[[], None]] = []

    @classmethod
    def from_config(cls, group: Any, policy: Any) -> Policy:
        """A facade with the batch sizes of a ``policy`` config section."""
        return cls(
            group,
            max_sequence_length=policy.max_total_sequence_length,
            train_global_batch_size=policy.train_global_batch_size,
            train_micro_batch_size=policy.train_micro_batch_size,
            logprob_batch_size=policy.logprob_batch_size,
            micro_batch_token_budget=policy.micro_batch_token_budget,
            sequence_packing=policy.sequence_packing,
            values=bool(getattr(policy, "value_head", False)),
        )

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    @property
    def packing(self) -> bool:
        """Whether micro batches go to the workers packed (``sequence_packing`` resolved
        against what the workers declare; asked once, of rank 0)."""
        if self._packing is None:
            from nrl_core.packing import supports_sequence_packing

            supported = self.sequence_packing != "false" and bool(
                self.group.run_one(0, supports_sequence_packing)
            )
            if self.sequence_packing == "true" and not supported:
                raise NrlError(
                    "policy.sequence_packing=true, and this policy's workers do not take packed "
                    "sequences (no `supports_sequence_packing`); set policy.sequence_packing="
                    "auto or false"
                )
            self._packing = supported
        return self._packing

    @property
    def _packed(self) -> bool | str:
        """The ``packed`` argument of the per-rank functions (:mod:`nrl_core.training`) when
        packing: ``"values"`` for per-token values (position 0 kept), else ``True``."""
        return "values" if self.values else True

    def _shards(self, batch: Batch) -> tuple[list[Batch], int]:
        padded, real = pad_to_multiple(batch, self.dp_size)
        return padded.shard(self.dp_size), real

    def offload(self, what: Sequence[str]) -> None:
        """Move ``what`` (``"optimizer"``, ``"weights"``) of every rank to CPU memory, for
        engines colocated on the policy's GPUs; every call below that needs them on the GPU
        brings them back first (:meth:`onload`)."""
        todo = [w for w in what if w not in self.offloaded]
        if todo:
            self.group.run_all("offload", todo)
            self.offloaded.update(todo)

    def add_device_sharer(self, release: Callable[[], None]) -> None:
        """Register ``release``, which frees what colocated engines hold on the policy's GPUs
        (:meth:`nrl_core.generation.GenerationEngines.release`: the engines sleep); every
        :meth:`onload` runs it first. Registering the same callable again does nothing."""
        if release not in self._device_sharers:
            self._device_sharers.append(release)

    def onload(self) -> None:
        """Make the policy's GPUs its own again before a call that needs them: colocated
        engines sleep (:meth:`add_device_sharer`), then what :meth:`offload` moved to CPU
        memory comes back (nothing to do if nothing was)."""
        for release in self._device_sharers:
            release()
        if self.offloaded:
            self.group.run_all("onload")
            self.offloaded.clear()

    def _score(self, on_rank: Callable[..., Any], batch: Batch, *args: Any) -> tuple[list, int]:
        """Run the no-grad pass ``on_rank`` over ``batch``'s data-parallel shards in chunks of
        ``logprob_batch_size``; each rank's result and the number of real (unpadded) rows."""
        self.onload()
        shards, real = self._shards(batch)
        width = batch["input_ids"].shape[1]
        if not self.packing:
            chunks = [split_micro_batches(s, size=self.logprob_batch_size) for s in shards]
            num_chunks = max(len(c) for c in chunks)
            return self.group.run_sharded(on_rank, chunks, num_chunks, width, *args), real
        # Bins of at most the tokens the padded path's largest chunk of this same data takes
        # (not logprob_batch_size x max length: every bin would reach that worst case); each
        # rank's result comes back in bin order, put back in the shard's.
        budget = padded_peak_tokens(shards, self.logprob_batch_size)
        plans = [pack_micro_batches(shard, token_budget=budget) for shard in shards]
        chunks = [bins for bins, _ in plans]
        num_chunks = max(len(c) for c in chunks)
        parts = self.group.run_sharded(on_rank, chunks, num_chunks, width, *args, self._packed)
        return [
            _unpermute(part, order) for part, (_, order) in zip(parts, plans, strict=True)
        ], real

    def get_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` of ``batch`` (under the reference weights if asked)."""
        parts, real = self._score(logprobs_on_rank, batch, reference)
        return torch.cat(parts)[:real]

    def get_topk_logprobs(
        self, batch: Batch, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``batch`` scored by this (frozen) model, for distillation: ``[B, T]`` logprobs of
        its tokens and ``[B, T, k']`` logprobs and ids of the ``k' = min(k, vocabulary)``
        most likely tokens at each position (position ``t``: the distribution of token ``t``).
        Only ``k'`` numbers per position cross Ray, never the vocabulary."""
        parts, real = self._score(topk_on_rank, batch, k)
        tokens, values, ids = (torch.cat(p)[:real] for p in zip(*parts, strict=True))
        return tokens, values, ids

    def train(self, batch: Batch, loss_fn: LossFunction) -> dict[str, float]:
        """Optimizer steps over ``batch`` in chunks of ``train_global_batch_size`` samples.

        Each optimizer step's loss is normalised over that step's samples (on every rank).
        Returns the step's metrics reduced over micro batches and ranks as each metric declares
        (see :func:`nrl_core.training.reduce_metrics`), combined over the optimizer steps by
        :func:`nrl_core.training.combine_optimizer_steps`, plus ``grad_norm`` and ``lr``.
        """
        self.onload()
        declared = declared_reductions(loss_fn)
        per_step = []
        for start in range(0, len(batch), self.train_global_batch_size):
            chunk = batch.slice(start, min(start + self.train_global_batch_size, len(batch)))
            stats = global_batch_stats(chunk, self.max_sequence_length)
            shards, _ = self._shards(chunk)
            if self.packing:
                # Bins of micro_batch_token_budget tokens, or of at most the tokens the
                # padded path's largest micro batch of this same data takes (its peak, not
                # train_micro_batch_size x max length, which every bin would fill).
                budget = self.micro_batch_token_budget or padded_peak_tokens(
                    shards, self.train_micro_batch_size
                )
                group = rows_per_sample(loss_fn)
                plans = [
                    pack_micro_batches(shard, token_budget=budget, rows_per_sample=group)[0]
                    for shard in shards
                ]
            else:
                plans = [
                    split_micro_batches(
                        shard,
                        size=self.train_micro_batch_size,
                        token_budget=self.micro_batch_token_budget,
                    )
                    for shard in shards
                ]
            num_micro_batches = max(len(p) for p in plans)
            results = self.group.run_sharded(
                train_on_rank,
                plans,
                num_micro_batches,
                loss_fn,
                stats,
                float(self.dp_size),
                self._packed if self.packing else False,
            )
            metrics = reduce_metrics(
                [m for result in results for m in result.micro_batch_metrics], declared
            )
            # The workers' own per-rank metrics (router statistics), reduced over ranks.
            declared = {**declared, **results[0].step_reductions}
            metrics.update(reduce_metrics([result.step_metrics for result in results], declared))
            metrics.update(grad_norm=results[0].grad_norm, lr=results[0].lr)
            per_step.append(metrics)
        return combine_optimizer_steps(per_step, declared)

    def snapshot_reference(self, path: str) -> None:
        """Make the current weights the frozen reference from now on.

        They are exported to the Hugging Face folder ``path`` (kept, so that a resumed run
        loads the same reference; written under a temporary name and renamed when complete)
        and every rank rebuilds its reference from it.
        """
        from nrl_core import atomic

        with atomic.new_dir(path) as tmp:
            self.export_hf(str(tmp))
        self.set_reference(str(path))

    def set_reference(self, path: str) -> None:
        """Use the Hugging Face folder ``path`` as the frozen reference model."""
        self.onload()
        self.group.run_all("set_reference", path)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Colocated generation on the policy ranks: each DP shard continues its prompts."""
        self.onload()
        prompt_shards = split_even(list(prompts), self.dp_size)
        stop_shards = split_even(
            list(stop_strings) if stop_strings is not None else [None] * len(prompts), self.dp_size
        )
        outputs = self.group.run_sharded("generate", prompt_shards, params, Sharded(stop_shards))
        return GenerationOutput.concat(outputs)

    def save_checkpoint(self, path: str) -> None:
        self.onload()
        self.group.run_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.onload()
        self.group.run_all("load_checkpoint", path)

    def export_hf(self, path: str) -> None:
        self.onload()
        self.group.run_all("export_hf", path)

    def shutdown(self) -> None:
        self.group.shutdown()
