"""SFT: supervised fine-tuning on chat data, the loss on the assistant tokens only.

One step: draw ``policy.train_global_batch_size`` conversations, encode them with the chat
template (the loss mask covers exactly the assistant messages' tokens, see
:func:`nrl_core.chat_data.encode_conversation`), and take one optimizer step with the ``nll``
loss (token mean over the global batch). Validation reports the same token-mean NLL on the
validation conversations (``val/loss``). The loop, set-up, checkpoints and resume are those of
:class:`~nrl_core.algorithms.supervised.SupervisedTrainer`, shared with DPO and reward models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nrl_core.algorithms.supervised import SupervisedTrainer, masked_batch, masked_nll
from nrl_core.config.schema import SFTConfig
from nrl_core.data import Batch, Sample
from nrl_core.errors import ConfigError
from nrl_core.registry import Registry


def check_loss(config: SFTConfig) -> None:
    """SFT trains with a token-level loss over ``loss_mask`` (``nll``, or a compatible one)."""
    if config.loss.name in ("dpo", "clipped_pg"):
        raise ConfigError(
            f"loss.name={config.loss.name} does not fit SFT (it needs pairs or advantages); "
            "use loss.name=nll"
        )


class SFTTrainer(SupervisedTrainer):
    """Supervised fine-tuning with the ``loss`` section's loss (``nll``)."""

    algorithm = "sft"
    check_config = staticmethod(check_loss)

    def batch(self, samples: Sequence[Sample]) -> Batch:
        """The conversations as a batch with the loss on the assistant tokens."""
        return masked_batch([self.encode(s.messages) for s in samples], self.pad_token_id)

    def step_metrics(self, batch: Batch, batch_s: float, train_s: float) -> dict[str, float]:
        tokens = int(batch["lengths"].sum())
        return {
            "timing/train_s": train_s,
            "throughput/tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
        }

    def val_metrics(self, batch: Batch, logprobs: torch.Tensor) -> dict[str, float]:
        """``val/loss``: token-mean NLL of the validation conversations' assistant tokens."""
        loss, tokens = masked_nll(logprobs, batch)
        return {"loss": loss, "num_valid_tokens": tokens}


def run(
    config: SFTConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run sft``."""
    return SFTTrainer.run(config, registry, verbose=verbose, quiet=quiet)


__all__ = ["SFTTrainer", "check_loss", "masked_batch", "masked_nll", "run"]
