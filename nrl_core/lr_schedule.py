"""The learning-rate schedule of ``policy.optimizer``: a linear warm-up, then constant, linear
or cosine decay. One function for every policy backend (dtensor keeps it in a torch
``LambdaLR``, Megatron sets the rate itself), so the two cannot drift."""

from __future__ import annotations

import math
from typing import Protocol

LR_DECAYS = ("constant", "linear", "cosine")
"""``policy.optimizer.decay`` values."""


class _Schedule(Protocol):
    warmup_steps: int
    decay: str
    decay_steps: int | None
    min_lr_ratio: float


def lr_scale(step: int, schedule: _Schedule) -> float:
    """The factor on the peak rate for optimizer step ``step`` (0-based, counting every
    optimizer step of the run: a supervised warm-up's too).

    Warm-up: ``(step + 1) / warmup_steps`` up to 1. Then, for ``decay_steps`` steps, from 1 down
    to ``min_lr_ratio`` (linearly, or along half a cosine), and ``min_lr_ratio`` after."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.decay == "constant" or not schedule.decay_steps:
        return 1.0
    progress = min(1.0, (step - warmup) / schedule.decay_steps)
    if schedule.decay == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * shape
