"""Checks that span several config sections, run once the config is structured.

A field's own range is checked by its attrs validator, and a section's internal consistency by
its ``__attrs_post_init__``; what needs two sections at once lives here. Each problem is a
:class:`~nrl_core.errors.ConfigError` with one line naming every setting involved and the fix.
"""

from __future__ import annotations

import math
from typing import Any

from nrl_core.errors import ConfigError


def validate_run_config(config: Any) -> None:
    """Raise :class:`ConfigError` when settings of different sections contradict each other."""
    _check_on_policy_shortcut(config)


def optimizer_steps_per_rollout(config: Any) -> int:
    """How many optimizer steps :meth:`nrl_core.policy.Policy.train` takes on one GRPO step's
    batch: it cuts ``num_prompts_per_step * num_generations_per_prompt`` samples (dynamic
    sampling never gives more) into chunks of ``policy.train_global_batch_size``."""
    samples = config.grpo.num_prompts_per_step * config.grpo.num_generations_per_prompt
    return max(1, math.ceil(samples / max(1, config.policy.train_global_batch_size)))


def _check_on_policy_shortcut(config: Any) -> None:
    # The shortcut takes old = sg(logp) instead of recomputing prev_logprobs. That is exact for
    # the first optimizer step of a rollout only: after it the weights have moved, the true
    # ratio is no longer 1, and every later step would train unclipped without saying so.
    if not (hasattr(config, "grpo") and hasattr(config, "loss")):
        return
    loss = config.loss
    options = loss.options_for()
    if not getattr(options, "on_policy_shortcut", False):
        return
    steps = optimizer_steps_per_rollout(config)
    if steps <= 1:
        return
    grpo = config.grpo
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    raise ConfigError(
        f"loss.{loss.selected}.on_policy_shortcut=true needs one optimizer step per rollout, but "
        f"policy.train_global_batch_size={config.policy.train_global_batch_size} is less than "
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {samples} ({steps} "
        "steps; every step after the first would run with ratio 1, i.e. without clipping); "
        f"set policy.train_global_batch_size={samples} or "
        f"loss.{loss.selected}.on_policy_shortcut=false"
    )
