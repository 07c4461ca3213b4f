"""The built-in loss functions; they run inside the policy workers.

* :mod:`nrl_core.losses.clipped_pg` — ``clipped_pg``: PPO-style clipped policy gradient
  (GRPO, DAPO, Dr. GRPO, GSPO), KL penalty and train/inference importance-sampling correction.
* :mod:`nrl_core.losses.nll` — ``nll``: supervised token-mean negative log-likelihood.
* :mod:`nrl_core.losses.preference` — ``dpo``: DPO, plus the Bradley-Terry reward-model loss.
* :mod:`nrl_core.losses.value` — the clipped PPO value (critic) loss; not a ``loss.name``
  component (it trains a critic's values, not the policy's logprobs).

Their option classes live in the torch-free :mod:`nrl_core.losses.config` (the driver structures
them from the run config without importing torch); this package imports nothing heavy either.

Metric convention shared by all losses: every metric is an additive contribution already
divided by the global normaliser, so the core SUMS it over micro batches and data-parallel
ranks, unless the loss declares another reduction in its ``metric_reductions`` mapping (see
:func:`nrl_core.training.reduce_metrics`).
"""

from nrl_core.losses.config import (
    ClippedPGConfig,
    DPOLossConfig,
    NLLConfig,
    resolve_aggregation,
    resolve_is_correction,
    resolved_clipped_pg_config,
)

__all__ = [
    "ClippedPGConfig",
    "DPOLossConfig",
    "NLLConfig",
    "resolve_aggregation",
    "resolve_is_correction",
    "resolved_clipped_pg_config",
]
