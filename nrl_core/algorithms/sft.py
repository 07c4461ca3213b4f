"""SFT: supervised fine-tuning on chat data, the loss on the assistant tokens only.

One step: draw ``policy.train_global_batch_size`` conversations, encode them with the chat
template (the loss mask covers exactly the assistant messages' tokens, see
:func:`nrl_core.chat_data.encode_conversation`), and take one optimizer step with the ``nll``
loss (token mean over the global batch). Validation reports the same token-mean NLL on the
validation conversations (``val/loss``). Set-up, checkpoints and resume come from
:class:`~nrl_core.algorithms.runtime.RunSession`, exactly as for GRPO.

:class:`OfflineTrainer` holds the loop shared with DPO and reward-model training: they differ
only in how a step's batch is built and which loss trains on it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import torch
from rich.table import Table

from nrl_core.algorithms.runtime import RunSession
from nrl_core.chat_data import encode_conversation
from nrl_core.config.schema import SFTConfig
from nrl_core.data import Batch, Message, Sample, pad_sequences
from nrl_core.errors import ConfigError
from nrl_core.registry import Registry


def masked_batch(rows: Sequence[tuple[list[int], list[float]]], pad_token_id: int) -> Batch:
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


class OfflineTrainer:
    """The loop of the trainers that learn from a fixed dataset (SFT, DPO, reward models).

    Subclasses set :attr:`algorithm` and :attr:`progress_fields` and implement
    :meth:`train_step` and :meth:`validate`.
    """

    algorithm = ""
    progress_fields: tuple[tuple[str, str], ...] = (
        ("train/loss", "loss"),
        ("val/loss", "val loss"),
        ("timing/step_s", "s/step"),
    )

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.config = session.config
        self.section = getattr(self.config, self.algorithm)
        self.tokenizer = session.tokenizer
        self.pad_token_id = self.tokenizer.pad_token_id

    def encode(self, messages: Sequence[Message]) -> tuple[list[int], list[float]]:
        """Token ids and assistant-token mask of a conversation, within the length budget."""
        codec = self.session.codec
        return encode_conversation(
            self.tokenizer,
            codec.prompt_messages(Sample(messages=list(messages))),
            use_template=bool(codec.use_template),
            max_length=self.config.policy.max_total_sequence_length,
        )

    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def validate(self, step: int) -> dict[str, float]:
        raise NotImplementedError

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
        """One table: the first and last training loss and validation metrics."""
        s = self.session
        table = Table(title=f"nrl {self.algorithm}: summary", show_header=False)
        table.add_row("run directory", str(s.run_dir))
        for key in ("train/loss", *sorted({k for h in s.history for k in h if k[:4] == "val/"})):
            seen = [h for h in s.history if key in h]
            if seen:
                table.add_row(
                    f"{key} (first -> last)",
                    f"{seen[0][key]:.4f} (step {seen[0]['step']}) -> "
                    f"{seen[-1][key]:.4f} (step {seen[-1]['step']})",
                )
        if s.step_times:
            table.add_row("median step time", f"{statistics.median(s.step_times):.2f} s")
        latest = s.checkpoints.latest()
        if latest is not None:
            table.add_row("latest checkpoint", str(latest))
        s.console.print(table)


class SFTTrainer(OfflineTrainer):
    """Supervised fine-tuning over a :class:`~nrl_core.algorithms.runtime.RunSession`."""

    algorithm = "sft"

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """The conversations as a batch with the loss on the assistant tokens."""
        return masked_batch([self.encode(s.messages) for s in samples], self.pad_token_id)

    def train_step(self, step: int) -> dict[str, float]:
        s = self.session
        samples = s.train_stream.take(self.config.policy.train_global_batch_size)
        batch = self.batch(samples)
        start = time.perf_counter()
        metrics = {f"train/{k}": v for k, v in s.policy.train(batch, s.loss_fn).items()}
        train_s = time.perf_counter() - start
        tokens = int(batch["lengths"].sum())
        metrics["timing/train_s"] = train_s
        metrics["throughput/tokens_per_s"] = tokens / train_s if train_s > 0 else 0.0
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """``val/loss``: token-mean NLL of the validation conversations' assistant tokens."""
        s = self.session
        if not s.val_samples:
            return {}
        batch = self.batch(s.val_samples)
        loss, tokens = masked_nll(s.policy.get_logprobs(batch), batch)
        return {"val/loss": loss, "val/num_valid_tokens": tokens}


def check_loss(config: SFTConfig) -> None:
    """SFT trains with a token-level loss over ``loss_mask`` (``nll``, or a compatible one)."""
    if config.loss.name in ("dpo", "clipped_pg"):
        raise ConfigError(
            f"loss.name={config.loss.name} does not fit SFT (it needs pairs or advantages); "
            "use loss.name=nll"
        )


def run(
    config: SFTConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run sft``."""
    check_loss(config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with RunSession.open(config, registry, algorithm="sft", verbose=verbose, quiet=quiet) as s:
        if s.finished_early:
            return 0
        return SFTTrainer(s).fit()


__all__ = ["OfflineTrainer", "SFTTrainer", "masked_batch", "masked_nll", "run"]
