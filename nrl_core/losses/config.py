"""Options of the built-in losses, kept free of torch.

The driver structures these classes from the run config (``loss.clipped_pg.*``) and resolves
``is_correction="auto"`` before any policy worker exists, so this module imports only attrs and
the config helpers. The loss modules re-export their config class, so both
``nrl_core.losses.config:ClippedPGConfig`` and ``nrl_core.losses.clipped_pg:ClippedPGConfig``
name the same class.
"""

from __future__ import annotations

from typing import Literal

import attrs

from nrl_core.config.schema import Valid, between, ge, gt, one_of, option, optional

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

ClippedPGAggregation = Literal[
    "auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"
]
CLIPPED_PG_AGGREGATIONS: tuple[str, ...] = ("auto", *AGGREGATIONS)

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")

ISCorrection = Literal[
    "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]
IS_CORRECTIONS: tuple[str, ...] = (
    "auto",
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)

OnPolicyShortcut = Literal["auto", True, False]
ON_POLICY_SHORTCUTS: tuple[str | bool, ...] = ("auto", True, False)

SequenceISWeight = Literal["geometric_mean", "product"]
SEQUENCE_IS_WEIGHTS: tuple[str, ...] = ("geometric_mean", "product")

DistillationKL = Literal["reverse", "forward", "mixed"]
DISTILLATION_KL_TYPES: tuple[str, ...] = ("reverse", "forward", "mixed")


# c <= 1 would cap the loss of negative-advantage tokens below the unclipped PPO value even at
# ratio 1, i.e. it would change the on-policy gradient, not just bound outliers.
_DUAL_CLIP = optional(Valid("> 1 (commonly 3)", lambda c: c > 1))


@attrs.define
class ClippedPGConfig:
    """Options of the clipped policy-gradient loss (``loss.name=clipped_pg``).

    The defaults are classic GRPO with token-mean aggregation and no KL term. Published variants:

    * DAPO: ``clip_eps_high=0.28``, ``aggregation=token_mean`` (what ``auto`` gives with token
      ratios; plus dynamic sampling and overlong filtering, which live in
      :mod:`nrl_core.algorithms.advantages`).
    * Dr. GRPO: ``aggregation=seq_mean_token_sum_norm`` (and ``normalize_rewards=False``).
    * GSPO: ``ratio_level=sequence``, ``clip_eps_low=3e-4``, ``clip_eps_high=4e-4``
      (``aggregation=auto`` then resolves to ``seq_mean_token_mean``).
    * CISPO (MiniMax-M1): ``use_cispo=true``, ``clip_eps_low=1`` (no lower bound on the IS
      weight, as the paper does) and a tuned ``clip_eps_high`` (the paper publishes no value;
      Tinker's default, after ScaleRL, caps the weight at 4: ``clip_eps_high=3``).
    """

    clip_eps_low: float = option(
        0.2,
        "Lower clip range, in [0, 1]: the ratio is clipped below at `1 - clip_eps_low` (so "
        "below 1; 1 means no lower bound, since a ratio is never negative).",
        validator=between(0, 1),
    )
    clip_eps_high: float = option(
        0.2,
        "Upper clip range: the ratio is clipped above at `1 + clip_eps_high` "
        "(DAPO clip-higher uses 0.28).",
        validator=ge(0),
    )
    dual_clip_c: float | None = option(
        None,
        "Dual clip for negative advantages: the per-token loss is capped at "
        "`-A * c` (c > 1, commonly 3). None disables it.",
        validator=_DUAL_CLIP,
    )
    kl_coef: float = option(
        0.0,
        "Coefficient of the KL penalty to the reference policy added to the loss. 0 "
        "disables it, and then no reference model is loaded.",
        validator=ge(0),
    )
    kl_estimator: KLEstimator = option(
        "k3",
        "KL estimator with d = ref - logp (clamped to +-20): `k1` = -d, `k2` = d^2/2, "
        "`k3` = exp(d) - 1 - d.",
        validator=one_of(*KL_ESTIMATORS),
    )
    aggregation: ClippedPGAggregation = option(
        "auto",
        "How per-token losses become one number: `token_mean` (sum / global "
        "valid tokens), `seq_mean_token_mean` (token mean inside each sequence, then mean over "
        "global valid sequences), `seq_mean_token_sum_norm` (Dr. GRPO: sum / (global valid "
        "sequences * max_total_sequence_length)). `auto` is `seq_mean_token_mean` with "
        "`ratio_level=sequence` (GSPO aggregates per sequence) and `token_mean` otherwise; "
        "`token_mean` with `ratio_level=sequence` is refused (it weights sequences by length).",
        validator=one_of(*CLIPPED_PG_AGGREGATIONS),
    )
    ratio_level: RatioLevel = option(
        "token",
        "`token`: one ratio per token (PPO/GRPO). `sequence`: GSPO, one ratio per "
        "sequence, exp of the mean log-ratio over its valid tokens, clipped and applied to "
        "every token of the sequence.",
        validator=one_of(*RATIO_LEVELS),
    )
    is_correction: ISCorrection = option(
        "auto",
        "Importance-sampling correction of the train/inference mismatch, with weight "
        "w = exp(old - gen) (detached): `none`, `token_truncate` (min(w, is_truncate_c)), "
        "`token_mask` (w, or 0 outside [is_mask_low, is_mask_high]), `sequence_truncate` and "
        "`sequence_mask` (the same with one weight per sequence, see `is_sequence_weight`). "
        "`auto` is resolved by the core: `none` for colocated torch generation (it shares the "
        "trainer's weights and kernels), `token_truncate` for every other backend.",
        validator=one_of(*IS_CORRECTIONS),
    )
    is_truncate_c: float = option(
        2.0, "Truncation bound C of the `*_truncate` corrections.", validator=ge(0)
    )
    is_mask_low: float = option(
        0.5, "Lower bound of the weight kept by the `*_mask` corrections.", validator=ge(0)
    )
    is_mask_high: float = option(
        5.0, "Upper bound of the weight kept by the `*_mask` corrections.", validator=ge(0)
    )
    is_sequence_weight: SequenceISWeight = option(
        "geometric_mean",
        "Sequence weight of the `sequence_*` corrections: `geometric_mean` "
        "= exp(mean_t(old - gen)) (length independent) or `product` = exp(sum_t(old - gen)).",
        validator=one_of(*SEQUENCE_IS_WEIGHTS),
    )
    use_cispo: bool = option(
        False,
        "CISPO (MiniMax-M1): per-token loss `-sg(clip(rho, 1 - clip_eps_low, 1 + clip_eps_high)) "
        "* A * logp` instead of the PPO surrogate: the importance weight is clipped and "
        "detached, and every token keeps its gradient through `logp` (PPO drops the gradient "
        "of a clipped token). Token ratios only (no `ratio_level=sequence`), no dual clip; "
        "`aggregation=auto` is `token_mean`. The paper sets no lower bound (`clip_eps_low=1`) "
        "and tunes only `clip_eps_high`.",
    )
    on_policy_shortcut: OnPolicyShortcut = option(
        "auto",
        "Skip recomputing `prev_logprobs` (the trainer's logprobs under the rollout's weights) "
        "and use rho = exp(logp - sg(logp)) (value 1, the exact policy gradient). Exact only "
        "while nothing has moved the weights since the rollout, i.e. with one optimizer step "
        "per rollout. `auto` (resolved by the core): `true` when "
        "`policy.train_global_batch_size` >= `grpo.num_prompts_per_step` x "
        "`grpo.num_generations_per_prompt` (one optimizer step per rollout), else `false`. "
        "`true` with several optimizer steps per rollout is refused. Whatever this says, a batch "
        "that carries `prev_logprobs` uses them.",
        validator=one_of(*ON_POLICY_SHORTCUTS),
    )

    def __attrs_post_init__(self) -> None:
        # CISPO clips a per-token importance weight; a sequence ratio or a cap on the PPO
        # surrogate (dual clip) has no meaning in its loss, and silently ignoring them would
        # train something other than what the config says.
        if self.use_cispo and self.ratio_level == "sequence":
            raise ValueError(
                "use_cispo=true clips per-token importance weights and cannot be used with "
                "ratio_level=sequence (GSPO); set one of them back"
            )
        if self.use_cispo and self.dual_clip_c is not None:
            raise ValueError(
                "dual_clip_c caps the PPO surrogate, which use_cispo=true replaces; set "
                "dual_clip_c=null (CISPO bounds the weight with clip_eps_high instead)"
            )
        if self.is_mask_low > self.is_mask_high:
            raise ValueError(
                f"is_mask_low ({self.is_mask_low}) must not exceed is_mask_high "
                f"({self.is_mask_high})"
            )
        # GSPO's sequence ratio is one number per sequence; a token mean would count a
        # sequence once per token, i.e. weight long responses more (NeMo RL makes sequence
        # ratios and a token-level loss mutually exclusive for the same reason).
        if self.ratio_level == "sequence" and self.aggregation == "token_mean":
            raise ValueError(
                "aggregation=token_mean cannot be used with ratio_level=sequence (GSPO "
                "aggregates per sequence; a token mean weights sequences by their length); "
                "set aggregation=auto or seq_mean_token_mean"
            )


def resolve_is_correction(config: ClippedPGConfig | str, colocated: bool) -> str:
    """The concrete importance-sampling correction for a run.

    ``"auto"`` becomes ``"none"`` when generation is colocated torch (the generator *is* the
    trainer's model, so ``gen == old`` up to nondeterminism and a correction only costs) and
    ``"token_truncate"`` for every other backend (vLLM, SGLang: other kernels and precision,
    hence a real mismatch). Any explicit choice is returned unchanged. ``config`` may be a
    :class:`ClippedPGConfig` or the mode string itself.
    """
    mode = config if isinstance(config, str) else config.is_correction
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {mode!r}; expected one of {IS_CORRECTIONS}")
    if mode != "auto":
        return mode
    return "none" if colocated else "token_truncate"


def resolve_aggregation(config: ClippedPGConfig) -> str:
    """The concrete aggregation of ``config``.

    ``"auto"`` becomes ``"seq_mean_token_mean"`` with ``ratio_level="sequence"`` (GSPO: one
    ratio, hence one loss term, per sequence) and ``"token_mean"`` with token ratios. Any
    explicit choice is returned unchanged.
    """
    if config.aggregation != "auto":
        return config.aggregation
    return "seq_mean_token_mean" if config.ratio_level == "sequence" else "token_mean"


def resolve_on_policy_shortcut(
    config: ClippedPGConfig, optimizer_steps_per_rollout: int | None
) -> bool:
    """The concrete ``on_policy_shortcut`` of ``config``.

    ``"auto"`` becomes ``True`` when a rollout's batch takes exactly one optimizer step: the
    weights that generated it are then the weights being trained, so ``prev_logprobs`` would
    equal the training forward's own logprobs and recomputing them is a wasted forward pass
    (TRL skips it in the same case). Several optimizer steps per rollout, or an unknown number
    (``None``), give ``False``. An explicit choice is returned unchanged.
    """
    if config.on_policy_shortcut != "auto":
        return bool(config.on_policy_shortcut)
    return optimizer_steps_per_rollout == 1


def resolved_clipped_pg_config(
    config: ClippedPGConfig, colocated: bool, optimizer_steps_per_rollout: int | None = None
) -> ClippedPGConfig:
    """A copy of ``config`` with ``is_correction`` (see :func:`resolve_is_correction`),
    ``aggregation`` (see :func:`resolve_aggregation`) and ``on_policy_shortcut`` (see
    :func:`resolve_on_policy_shortcut`) resolved."""
    return attrs.evolve(
        config,
        is_correction=resolve_is_correction(config, colocated),
        aggregation=resolve_aggregation(config),
        on_policy_shortcut=resolve_on_policy_shortcut(config, optimizer_steps_per_rollout),
    )


@attrs.define
class NLLConfig:
    """Options of the supervised negative log-likelihood loss (``loss.name=nll``)."""

    aggregation: Aggregation = option(
        "token_mean",
        "Normaliser of the summed NLL: `token_mean` (global valid tokens, the "
        "usual SFT loss), `seq_mean_token_mean` or `seq_mean_token_sum_norm` (see "
        "`clipped_pg.aggregation`).",
        validator=one_of(*AGGREGATIONS),
    )


@attrs.define
class DPOLossConfig:
    """Options of the DPO loss (``loss.name=dpo``)."""

    beta: float = option(0.1, "DPO temperature beta (0.05-0.1 is common).", validator=gt(0))
    sft_loss_weight: float = option(
        0.0,
        "Weight of an NLL term on the chosen response (0 disables it).",
        validator=ge(0),
    )
    average_logprobs: bool = option(
        False,
        "Use the mean (not the sum) of the response's token logprobs as the sequence "
        "logprob, in both the preference term and the SFT term.",
    )


@attrs.define
class DistillationLossConfig:
    """Options of the on-policy distillation loss (``loss.name=distillation``, run by
    ``nrl run distill``): a per-token KL between the student and a teacher's top-k
    distribution (coarsened to the teacher's K tokens plus one tail bucket, see
    :mod:`nrl_core.losses.distillation`)."""

    kl_type: DistillationKL = option(
        "reverse",
        "Divergence minimised at each generated token, one of `reverse`, `forward`, `mixed`: "
        "`reverse` = KL(student || teacher) (mode seeking; the usual on-policy choice), "
        "`forward` = KL(teacher || student) (mass covering), `mixed` = `mixed_weight` * "
        "forward + (1 - `mixed_weight`) * reverse.",
        validator=one_of(*DISTILLATION_KL_TYPES),
    )
    mixed_weight: float = option(
        0.5,
        "Weight of the forward KL when `kl_type=mixed`, in [0, 1] (0 is pure reverse, 1 pure "
        "forward); ignored by the other kl_types.",
        validator=between(0, 1),
    )
    aggregation: Aggregation = option(
        "token_mean",
        "Normaliser of the summed per-token KL, one of `token_mean` (global valid tokens), "
        "`seq_mean_token_mean` or `seq_mean_token_sum_norm` (see `clipped_pg.aggregation`).",
        validator=one_of(*AGGREGATIONS),
    )


@attrs.define
class ValueLossConfig:
    """Options of the clipped value (critic) loss (:mod:`nrl_core.losses.value`)."""

    clip_eps: float | None = option(
        0.2,
        "Value clip range eps_v (>= 0): the clipped prediction is V_old +- eps_v. None "
        "disables the clipped branch (plain 0.5 * squared error).",
        validator=optional(ge(0)),
    )
    aggregation: Aggregation = option(
        "token_mean",
        "Normaliser of the summed per-token loss: `token_mean`, `seq_mean_token_mean` or "
        "`seq_mean_token_sum_norm` (see `clipped_pg.aggregation`).",
        validator=one_of(*AGGREGATIONS),
    )
    coef: float = option(1.0, "Multiplier of the loss (0 to 1e6).", validator=between(0, 1e6))
