"""The driver's view of a policy: one object over the worker group of its ranks.

It owns what is written once for every policy plugin: sharding batches over data-parallel
ranks (padding them to equal shards with masked rows), the global loss normalisers, splitting a
step's samples into optimizer steps, and reducing metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nrl_core.data import Batch, split_even
from nrl_core.distributed.worker_group import ParallelLayout, Sharded, WorkerGroup
from nrl_core.interfaces import GenerationOutput, GlobalBatchStats, LossFunction, SamplingParams
from nrl_core.losses import reduce_metrics


def policy_layout(options: Any) -> ParallelLayout:
    """The model-parallel layout a policy's options ask for.

    Policy option classes declare their sizes under the usual names (``tensor_parallel_size``
    or Megatron's ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``context_parallel_size``); model-parallel peers then receive the same data shard.
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
    filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
    filler["sample_mask"] = torch.zeros(missing, dtype=torch.float32)
    if "sample_mask" not in batch:
        batch = Batch({**batch.tensors, "sample_mask": torch.ones(real)}, batch.metadata)
    return Batch.concat([batch, filler]), real


class Policy:
    """A policy's worker group, seen as one model.

    Args:
        group: the policy ranks (workers honouring :class:`nrl_core.interfaces.PolicyWorker`).
        max_sequence_length: the Dr. GRPO length normaliser (``policy.max_total_sequence_length``).
        train_global_batch_size: samples per optimizer step.
    """

    def __init__(
        self, group: WorkerGroup, *, max_sequence_length: int, train_global_batch_size: int
    ) -> None:
        self.group = group
        self.max_sequence_length = max_sequence_length
        self.train_global_batch_size = train_global_batch_size

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    def _sharded_call(self, method: str, batch: Batch, *args: Any) -> tuple[list[Any], int]:
        padded, real = pad_to_multiple(batch, self.dp_size)
        return self.group.run_sharded(method, padded.shard(self.dp_size), *args), real

    def get_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` of ``batch`` (under the reference weights if asked)."""
        method = "get_reference_logprobs" if reference else "get_logprobs"
        parts, real = self._sharded_call(method, batch)
        width = batch["input_ids"].shape[1]
        out = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
        return out[:real]

    def train(self, batch: Batch, loss_fn: LossFunction) -> dict[str, float]:
        """Optimizer steps over ``batch`` in chunks of ``train_global_batch_size`` samples.

        Each optimizer step's loss is normalised over that step's samples (on every rank).
        Returns the metrics of the steps: losses and additive metrics averaged over the steps,
        ``*_max``/``*_min`` reduced with max/min, and ``lr`` after the last step.
        """
        per_step = []
        for start in range(0, len(batch), self.train_global_batch_size):
            chunk = batch.slice(start, min(start + self.train_global_batch_size, len(batch)))
            stats = global_batch_stats(chunk, self.max_sequence_length)
            results, _ = self._sharded_call("train", chunk, loss_fn, stats)
            # Workers all-reduce their metrics; every DP shard reports the global values.
            per_step.append(results[0])
        return average_steps(per_step)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Colocated generation on the policy ranks: each DP shard continues its prompts."""
        prompt_shards = split_even(list(prompts), self.dp_size)
        stop_shards = split_even(
            list(stop_strings) if stop_strings is not None else [None] * len(prompts), self.dp_size
        )
        outputs = self.group.run_sharded("generate", prompt_shards, params, Sharded(stop_shards))
        return GenerationOutput(
            token_ids=[ids for out in outputs for ids in out.token_ids],
            logprobs=[lps for out in outputs for lps in out.logprobs],
            finish_reasons=[fr for out in outputs for fr in out.finish_reasons],
        )

    def save_checkpoint(self, path: str) -> None:
        self.group.run_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.group.run_all("load_checkpoint", path)

    def export_hf(self, path: str) -> None:
        self.group.run_all("export_hf", path)

    def shutdown(self) -> None:
        self.group.shutdown()


def average_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of several optimizer steps of one RL step."""
    if not per_step:
        return {}
    last = per_step[-1]
    out = reduce_metrics(per_step)
    for key in out:
        if not key.endswith(("_max", "_min")):
            out[key] /= len(per_step)
    if "lr" in last:
        out["lr"] = last["lr"]  # the schedule's value after the step, not an average
    return out
