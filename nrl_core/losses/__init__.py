"""The built-in loss functions; they run inside the policy workers.

* :mod:`nrl_core.losses.clipped_pg` — ``clipped_pg``: PPO-style clipped policy gradient
  (GRPO, DAPO, Dr. GRPO, GSPO), KL penalty and train/inference importance-sampling correction.
* :mod:`nrl_core.losses.nll` — ``nll``: supervised token-mean negative log-likelihood.
* :mod:`nrl_core.losses.preference` — ``dpo``: DPO, plus the Bradley-Terry reward-model loss.

Their option classes live in the torch-free :mod:`nrl_core.losses.config` (the driver structures
them from the run config without importing torch); this package imports nothing heavy either.

Metric convention shared by all losses: every metric is an additive contribution already
divided by the global normaliser, so the core SUMS it over micro batches and data-parallel
ranks; keys ending in ``_max`` are reduced with ``max`` and keys ending in ``_min`` with ``min``.
"""

from nrl_core.losses.config import (
    ClippedPGConfig,
    DPOLossConfig,
    NLLConfig,
    resolve_is_correction,
    resolved_clipped_pg_config,
)

__all__ = [
    "ClippedPGConfig",
    "DPOLossConfig",
    "NLLConfig",
    "reduce_metrics",
    "resolve_is_correction",
    "resolved_clipped_pg_config",
]


def reduce_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of several micro batches or ranks the way the losses intend.

    Keys ending in ``_max`` take the maximum, keys ending in ``_min`` the minimum, every other
    key the sum. A key missing from some parts is reduced over the parts that have it.
    """
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key.endswith("_max"):
                out[key] = max(out[key], value)
            elif key.endswith("_min"):
                out[key] = min(out[key], value)
            else:
                out[key] += value
    return out
