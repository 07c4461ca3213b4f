"""The loop shared by the trainers that learn from a fixed dataset: SFT, DPO and reward models.

:class:`SupervisedTrainer` runs over a :class:`~nrl_core.algorithms.runtime.RunSession` (set-up,
checkpoints, resume and metrics come from there, exactly as for GRPO). Each step draws
``policy.train_global_batch_size / rows_per_sample`` samples from the training stream, builds a
batch from them and takes one optimizer step (``session.policy.train(batch, loss_fn)``).
Validation runs at step 0 (on a fresh run), every ``<algo>.val_period`` steps and at the last
step; checkpoints follow ``checkpointing``; the run ends with a summary table.

A subclass says only what differs (see ``sft.py``, ``dpo.py``, ``rm.py``):

- :attr:`~SupervisedTrainer.algorithm` (its config section), :attr:`rows_per_sample` and
  :attr:`progress_fields` (:class:`PairTrainer` sets them for preference pairs);
- :meth:`~SupervisedTrainer.batch`: how a batch is built from samples;
- :meth:`~SupervisedTrainer.build_loss`: the loss (default: the session's ``loss`` section);
- :meth:`~SupervisedTrainer.step_metrics`: the timing metrics of a step besides ``train/*``;
- :meth:`~SupervisedTrainer.val_metrics`: the validation metrics (default: the loss's own
  metrics on the validation batch, without an update);
- :meth:`~SupervisedTrainer.check_config`: config checks before anything starts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from nrl_core.algorithms.runtime import RunSession, train_in_session
from nrl_core.chat_data import encode_conversation
from nrl_core.config.schema import RunConfig
from nrl_core.data import Batch, Message, Sample, pad_sequences
from nrl_core.errors import ConfigError
from nrl_core.policy import global_batch_stats
from nrl_core.registry import Registry

Row = tuple[list[int], list[float]]
"""One encoded conversation: token ids and the loss mask over them."""


def masked_batch(rows: Sequence[Row], pad_token_id: int) -> Batch:
    """``(ids, loss mask)`` rows as a right-padded training batch."""
    return Batch(
        {
            "input_ids": pad_sequences([ids for ids, _ in rows], pad_value=pad_token_id),
            "lengths": torch.tensor([len(ids) for ids, _ in rows]),
            "loss_mask": pad_sequences([mask for _, mask in rows], dtype=torch.float32),
        }
    )


def masked_nll(logprobs: torch.Tensor, batch: Batch) -> tuple[float, float]:
    """Token-mean negative log-likelihood over ``loss_mask`` and the token count."""
    mask = batch["loss_mask"].float()
    tokens = float(mask.sum())
    return float(-(logprobs * mask).sum() / max(tokens, 1.0)), tokens


def check_pair_layout(config: RunConfig) -> None:
    """Pairs are consecutive rows; every split of a batch must keep them together."""
    policy = config.policy
    if policy.train_global_batch_size % 2 or policy.train_micro_batch_size % 2:
        raise ConfigError(
            f"policy.train_global_batch_size ({policy.train_global_batch_size}) and "
            f"train_micro_batch_size ({policy.train_micro_batch_size}) must be even: each "
            "(chosen, rejected) pair is two rows"
        )
    pairs = policy.train_global_batch_size // 2
    if pairs % policy.num_workers:
        raise ConfigError(
            f"policy.train_global_batch_size / 2 = {pairs} pairs cannot be split evenly over "
            f"{policy.num_workers} policy ranks; make it a multiple of {2 * policy.num_workers}"
        )
    if policy.micro_batch_token_budget:
        raise ConfigError(
            "policy.micro_batch_token_budget packs rows by length and would split (chosen, "
            "rejected) pairs; unset it for preference training"
        )


class SupervisedTrainer:
    """The supervised loop over a :class:`~nrl_core.algorithms.runtime.RunSession` (see the
    module docstring); subclasses implement :meth:`batch` and override what differs."""

    algorithm = ""
    """The algorithm's name: its config section and ``nrl run`` command."""
    rows_per_sample = 1
    """Batch rows per sample (2 for preference pairs): a step draws
    ``train_global_batch_size // rows_per_sample`` samples."""
    progress_fields: tuple[tuple[str, str], ...] = (
        ("train/loss", "loss"),
        ("val/loss", "val loss"),
        ("timing/step_s", "s/step"),
    )
    """``(metric key, label)`` pairs shown on the progress bar."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.config = session.config
        self.section = getattr(self.config, self.algorithm)
        self.tokenizer = session.tokenizer
        self.pad_token_id = self.tokenizer.pad_token_id
        self.loss_fn = self.build_loss()

    # -- what the algorithms set ------------------------------------------------------------

    @staticmethod
    def check_config(config: RunConfig) -> None:
        """Refuse a config this algorithm cannot train with (before anything starts)."""

    def build_loss(self) -> Any:
        """The loss of every training step: the one the ``loss`` section selects."""
        return self.session.loss_fn

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """The training (or validation) batch of ``samples``."""
        raise NotImplementedError

    def step_metrics(self, batch: Batch, batch_s: float, train_s: float) -> dict[str, float]:
        """A step's metrics besides ``train/*``: ``batch_s`` built the batch, ``train_s`` trained."""
        return {"timing/train_s": train_s}

    def val_metrics(self, batch: Batch, logprobs: torch.Tensor) -> dict[str, float]:
        """Validation metrics (reported as ``val/<key>``) of the batch and the policy's
        ``get_logprobs`` on it: by default the loss's own metrics, without an update."""
        stats = global_batch_stats(batch, self.config.policy.max_total_sequence_length)
        with torch.no_grad():
            _, metrics = self.loss_fn(logprobs, batch, stats)
        return metrics

    # -- shared by all ------------------------------------------------------------------------

    def encode(self, messages: Sequence[Message]) -> Row:
        """Token ids and assistant-token mask of a conversation, within the length budget."""
        codec = self.session.codec
        return encode_conversation(
            self.tokenizer,
            codec.prompt_messages(Sample(messages=list(messages))),
            use_template=bool(codec.use_template),
            max_length=self.config.policy.max_total_sequence_length,
        )

    def train_step(self, step: int) -> dict[str, float]:
        """Draw a step's samples, build their batch and take one optimizer step."""
        s = self.session
        samples = s.train_stream.take(
            self.config.policy.train_global_batch_size // self.rows_per_sample
        )
        start = time.perf_counter()
        batch = self.batch(samples)
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        metrics = {f"train/{k}": v for k, v in s.policy.train(batch, self.loss_fn).items()}
        metrics.update(self.step_metrics(batch, batch_s, time.perf_counter() - start))
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """:meth:`val_metrics` on the validation samples ({} when there are none)."""
        s = self.session
        if not s.val_samples:
            return {}
        batch = self.batch(s.val_samples)
        logprobs = s.policy.get_logprobs(batch)
        return {f"val/{k}": v for k, v in self.val_metrics(batch, logprobs).items()}

    def fit(self) -> int:
        """Train from the session's start step to ``max_num_steps``; validate and checkpoint
        on schedule (validation also at step 0 and at the last step)."""
        s, section = self.session, self.section
        if s.start_step == 0 and section.val_period > 0:
            s.log(0, self.validate(0))
        with s.progress(section.max_num_steps, s.start_step, self.progress_fields) as advance:
            for step in range(s.start_step + 1, section.max_num_steps + 1):
                start = time.perf_counter()
                metrics = self.train_step(step)
                metrics["timing/step_s"] = time.perf_counter() - start
                last = step == section.max_num_steps
                if section.val_period > 0 and (step % section.val_period == 0 or last):
                    metrics.update(self.validate(step))
                s.log(step, metrics)
                if s.should_checkpoint(step, last):
                    s.save_checkpoint(step)
                advance(metrics)
        self.summary()
        return 0

    def summary(self) -> None:
        """The session's summary with the first and last training loss and validation
        metrics."""
        history = self.session.history
        rows = []
        for key in ("train/loss", *sorted({k for h in history for k in h if k[:4] == "val/"})):
            seen = [h for h in history if key in h]
            if seen:
                rows.append(
                    (
                        f"{key} (first -> last)",
                        f"{seen[0][key]:.4f} (step {seen[0]['step']}) -> "
                        f"{seen[-1][key]:.4f} (step {seen[-1]['step']})",
                    )
                )
        self.session.summary(rows)

    @classmethod
    def run(
        cls, config: RunConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
    ) -> int:
        """``nrl run <algorithm>``: check the config, seed, open the session, train."""
        cls.check_config(config)
        return train_in_session(
            cls, config, registry, algorithm=cls.algorithm, verbose=verbose, quiet=quiet
        )


class PairTrainer(SupervisedTrainer):
    """Training on preference pairs (DPO, reward models): a sample is a (prompt, chosen,
    rejected) triple laid out as rows ``2i`` (chosen) and ``2i + 1`` (rejected)."""

    rows_per_sample = 2
    check_config = staticmethod(check_pair_layout)
    accuracy_metric = "accuracy"
    """The loss metric shown as the accuracy on the progress bar (train and validation)."""

    @property
    def progress_fields(self) -> tuple[tuple[str, str], ...]:
        return (
            ("train/loss", "loss"),
            (f"train/{self.accuracy_metric}", "acc"),
            (f"val/{self.accuracy_metric}", "val acc"),
            ("timing/step_s", "s/step"),
        )

    def pair_rows(self, samples: Sequence[Sample]) -> list[Row]:
        """Preference samples as rows ``2i`` (prompt + chosen) and ``2i + 1`` (+ rejected)."""
        return [
            self.encode([*sample.messages, *sample.metadata[key]])
            for sample in samples
            for key in ("chosen", "rejected")
        ]


__all__ = [
    "PairTrainer",
    "SupervisedTrainer",
    "check_pair_layout",
    "masked_batch",
    "masked_nll",
]
