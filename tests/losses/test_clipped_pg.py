"""The clipped policy-gradient loss against hand-computed values, option by option, and the
aggregation contract: micro batches, data-parallel shards and padding change nothing."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from nrl_core.interfaces import GlobalBatchStats, LossFunction
from nrl_core.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss, kl_penalty
from nrl_core.losses.config import (
    resolve_aggregation,
    resolve_is_correction,
    resolved_clipped_pg_config,
)
from tests.losses.helpers import (
    global_stats,
    leaf,
    loss_and_grad,
    make_batch,
    random_policy_batch,
    right_pad,
)

LOG = math.log


def one_row(ratios: list[float], advantage: float, old: float = -1.0):
    """One sequence: a prompt token (masked) then one generated token per ratio, with
    ``prev_logprobs = old`` and ``logprobs = old + log(ratio)``."""
    logprobs = leaf([[0.0] + [old + LOG(r) for r in ratios]])
    batch = make_batch(
        loss_mask=[[0.0] + [1.0] * len(ratios)],
        prev_logprobs=[[0.0] + [old] * len(ratios)],
        advantages=[advantage],
    )
    stats = GlobalBatchStats(valid_tokens=len(ratios), valid_sequences=1, max_sequence_length=8)
    return logprobs, batch, stats


def run(options: ClippedPGConfig, logprobs, batch, stats):
    loss, metrics = ClippedPGLoss(options)(logprobs, batch, stats)
    loss.backward()
    return float(loss.detach()), logprobs.grad, metrics


NO_IS = ClippedPGConfig(is_correction="none")


def test_is_a_loss_function_with_documented_options():
    loss = ClippedPGLoss(NO_IS)
    assert isinstance(loss, LossFunction)
    for field in attrs.fields(ClippedPGConfig):
        assert field.metadata.get("doc"), f"{field.name} has no documentation"


# --------------------------------------------------------------------------------------------
# Ratio clipping


def test_positive_advantage_clips_high_ratio():
    # A = +1, rho = 1.5, 0.5, 1.1 with eps 0.2/0.2:
    #   max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5, max(-1.1, -1.1) = -1.1
    loss, grad, metrics = run(NO_IS, *one_row([1.5, 0.5, 1.1], advantage=1.0))
    assert loss == pytest.approx((-1.2 - 0.5 - 1.1) / 3, abs=1e-12)
    # d(-A rho)/dlogp = -A rho on unclipped tokens, 0 on the clipped one; / 3 tokens.
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, -0.5 / 3, -1.1 / 3], abs=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["loss"] == pytest.approx(loss)


def test_clip_higher_raises_only_the_upper_bound():
    # DAPO clip-higher eps_high = 0.28: the 1.5 token is now capped at 1.28.
    options = ClippedPGConfig(clip_eps_high=0.28, is_correction="none")
    loss, _, _ = run(options, *one_row([1.5, 0.5, 1.1], advantage=1.0))
    assert loss == pytest.approx((-1.28 - 0.5 - 1.1) / 3, abs=1e-12)


def test_negative_advantage_clips_low_ratio():
    # A = -1: max(1.5, 1.2) = 1.5, max(0.5, 0.8) = 0.8 (clipped), 1.1.
    loss, grad, metrics = run(NO_IS, *one_row([1.5, 0.5, 1.1], advantage=-1.0))
    assert loss == pytest.approx((1.5 + 0.8 + 1.1) / 3, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, 1.5 / 3, 0.0, 1.1 / 3], abs=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_separate_low_epsilon():
    # eps_low = 0.1: the 0.5 token is lifted to 0.9 instead of 0.8.
    options = ClippedPGConfig(clip_eps_low=0.1, is_correction="none")
    loss, _, _ = run(options, *one_row([1.5, 0.5, 1.1], advantage=-1.0))
    assert loss == pytest.approx((1.5 + 0.9 + 1.1) / 3, abs=1e-12)


def test_dual_clip_caps_negative_advantages():
    # A = -2, c = 3, rho = 4, 2, 0.5:
    #   PPO: max(8, 2.4) = 8 -> min(8, 6) = 6 (dual clipped), max(4, 2.4) = 4, max(1, 1.6) = 1.6
    options = ClippedPGConfig(dual_clip_c=3.0, is_correction="none")
    loss, grad, metrics = run(options, *one_row([4.0, 2.0, 0.5], advantage=-2.0))
    assert loss == pytest.approx((6 + 4 + 1.6) / 3, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, 2 * 2.0 / 3, 0.0], abs=1e-12)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)


def test_dual_clip_leaves_positive_advantages_alone():
    options = ClippedPGConfig(dual_clip_c=3.0, is_correction="none")
    loss, _, _ = run(options, *one_row([4.0, 0.5], advantage=2.0))
    # max(-8, -2.4) = -2.4, max(-1, -1.6) = -1
    assert loss == pytest.approx((-2.4 - 1.0) / 2, abs=1e-12)


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ClippedPGConfig(dual_clip_c=1.0)


# --------------------------------------------------------------------------------------------
# CISPO: -sg(clip(rho)) * A * logp


CISPO = ClippedPGConfig(use_cispo=True, is_correction="none")


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_cispo_clips_a_detached_weight_and_keeps_every_gradient(advantage):
    # rho = 1.5, 0.5, 1.1 with eps 0.2/0.2: weights sg(clip(rho)) = 1.2, 0.8, 1.1. The loss is
    # -w * A * logp per token and its gradient -w * A on EVERY token (the PPO surrogate gives
    # the clipped 1.5 token with A > 0 no gradient at all, see above).
    logprobs, batch, stats = one_row([1.5, 0.5, 1.1], advantage=advantage)
    weights = [1.2, 0.8, 1.1]
    logp = logprobs.detach()[0, 1:].tolist()
    loss, grad, metrics = run(CISPO, logprobs, batch, stats)
    assert loss == pytest.approx(
        -advantage * sum(w * lp for w, lp in zip(weights, logp, strict=True)) / 3
    )
    assert grad.tolist()[0] == pytest.approx(
        [0.0] + [-advantage * w / 3 for w in weights], abs=1e-12
    )
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_cispo_without_a_lower_bound():
    # MiniMax-M1's setting: clip_eps_low = 1 puts the lower bound at 0, so a small ratio keeps
    # its own (small) weight; the upper bound still caps the large one.
    options = ClippedPGConfig(use_cispo=True, clip_eps_low=1.0, clip_eps_high=2.0)
    options = attrs.evolve(options, is_correction="none")
    _, grad, metrics = run(options, *one_row([0.05, 4.0, 1.0], advantage=2.0))
    assert grad.tolist()[0] == pytest.approx([0.0, -2 * 0.05 / 3, -2 * 3.0 / 3, -2 / 3])
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_cispo_on_policy_is_the_plain_policy_gradient():
    # Fully on-policy (no prev_logprobs) the weight is 1: gradient -A / N like PPO's.
    logprobs = leaf([[0.0, -0.7, -1.3]])
    batch = make_batch(loss_mask=[[0, 1, 1]], advantages=[[0.0, 2.0, -1.0]])
    stats = GlobalBatchStats(valid_tokens=2, valid_sequences=1, max_sequence_length=8)
    loss, grad, metrics = run(CISPO, logprobs, batch, stats)
    assert loss == pytest.approx((2.0 * 0.7 - 1.0 * 1.3) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.5], abs=1e-12)
    assert metrics["clip_fraction"] == 0.0


def test_cispo_gradient_matches_the_formula_on_a_random_batch():
    # d/dlogp of -sg(clip(rho)) * A * logp, token mean over the global batch, by hand.
    logprobs, batch = random_policy_batch(seed=3)
    stats = global_stats(batch)
    options = attrs.evolve(CISPO, clip_eps_low=0.1, clip_eps_high=0.3)
    _, grad, _ = run(options, logprobs.clone().requires_grad_(True), batch, stats)
    mask = batch["loss_mask"] * batch["sample_mask"][:, None]
    valid = mask != 0
    rho = torch.exp(torch.where(valid, logprobs.detach() - batch["prev_logprobs"], 0.0))
    advantages = batch["advantages"][:, None].expand_as(rho)
    want = torch.where(valid, -rho.clamp(0.9, 1.3) * advantages * mask, 0.0)
    torch.testing.assert_close(grad, want / stats.valid_tokens, rtol=1e-12, atol=1e-14)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(ratio_level="sequence"), "ratio_level=sequence"),
        (dict(dual_clip_c=3.0), "dual_clip_c=null"),
    ],
)
def test_cispo_refuses_what_it_does_not_use(options, match):
    with pytest.raises(ValueError, match=match):
        ClippedPGConfig(use_cispo=True, **options)


# --------------------------------------------------------------------------------------------
# On-policy shortcut


def test_on_policy_shortcut_without_prev_logprobs():
    # No prev_logprobs: rho = exp(logp - sg(logp)) = 1, gradient -A per token.
    logprobs = leaf([[0.0, -0.7, -1.3]])
    batch = make_batch(loss_mask=[[0, 1, 1]], advantages=[[0.0, 2.0, -1.0]])
    stats = GlobalBatchStats(valid_tokens=2, valid_sequences=1, max_sequence_length=8)
    loss, grad, metrics = run(NO_IS, logprobs, batch, stats)
    assert loss == pytest.approx((-2.0 + 1.0) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.5], abs=1e-12)
    assert metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    assert metrics["entropy"] == pytest.approx((0.7 + 1.3) / 2)


def test_needs_flags():
    assert ClippedPGLoss(ClippedPGConfig()).needs_prev_logprobs is True
    assert ClippedPGLoss(ClippedPGConfig(on_policy_shortcut=True)).needs_prev_logprobs is False
    assert ClippedPGLoss(ClippedPGConfig()).needs_reference is False
    assert ClippedPGLoss(ClippedPGConfig(kl_coef=0.01)).needs_reference is True


# --------------------------------------------------------------------------------------------
# KL penalty

D = [0.5, -1.0, 2.0]
"""ref - logp on the three generated tokens of the KL tests."""


def kl_row():
    logprobs = leaf([[0.0, -1.0, -2.0, -0.5]])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1]],
        prev_logprobs=[[0.0, -1.0, -2.0, -0.5]],
        ref_logprobs=[[0.0, -1.0 + D[0], -2.0 + D[1], -0.5 + D[2]]],
        advantages=[0.0],  # isolates the KL term
    )
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=1, max_sequence_length=8)
    return logprobs, batch, stats


@pytest.mark.parametrize(
    ("estimator", "values", "grads"),
    [
        # k1 = -d = logp - ref; dk1/dlogp = 1
        ("k1", [-d for d in D], [1.0, 1.0, 1.0]),
        # k2 = d^2/2; dk2/dlogp = -d
        ("k2", [d * d / 2 for d in D], [-d for d in D]),
        # k3 = e^d - 1 - d; dk3/dlogp = 1 - e^d
        ("k3", [math.exp(d) - 1 - d for d in D], [1 - math.exp(d) for d in D]),
    ],
)
def test_kl_estimators(estimator, values, grads):
    options = ClippedPGConfig(kl_coef=0.1, kl_estimator=estimator, is_correction="none")
    loss, grad, metrics = run(options, *kl_row())
    assert loss == pytest.approx(0.1 * sum(values) / 3, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0] + [0.1 * g / 3 for g in grads], abs=1e-12)
    assert metrics["kl"] == pytest.approx(sum(values) / 3, abs=1e-12)


def test_kl_log_ratio_is_clamped_before_exp():
    logp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([30.0, -30.0])
    k3 = kl_penalty(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(20) - 1 - 20, math.exp(-20) - 1 + 20])
    assert torch.isfinite(k3).all()


def test_no_reference_needed_without_kl():
    logprobs, batch, stats = one_row([1.0], advantage=1.0)
    assert "ref_logprobs" not in batch
    loss, _, metrics = run(NO_IS, logprobs, batch, stats)
    assert loss == pytest.approx(-1.0)
    assert "kl" not in metrics


def test_kl_without_reference_logprobs_is_an_error():
    with pytest.raises(KeyError, match="ref_logprobs"):
        run(ClippedPGConfig(kl_coef=0.1, is_correction="none"), *one_row([1.0], advantage=1.0))


# --------------------------------------------------------------------------------------------
# Aggregation


def two_rows():
    # On-policy (ratio 1), token-level advantages, so L_it = -A_it:
    #   row 0: three valid tokens with losses -1, -2, -3; row 1: one valid token with -4.
    logprobs = leaf([[0.0, -0.1, -0.2, -0.3], [0.0, -0.4, 0.0, 0.0]])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1], [0, 1, 0, 0]],
        advantages=[[0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 0.0, 0.0]],
    )
    stats = GlobalBatchStats(valid_tokens=4, valid_sequences=2, max_sequence_length=8)
    return logprobs, batch, stats


@pytest.mark.parametrize(
    ("aggregation", "expected", "grad"),
    [
        # sum / tokens: -10 / 4; dL/dlogp_it = -A_it / 4
        ("token_mean", -10 / 4, [[0, -1 / 4, -2 / 4, -3 / 4], [0, -4 / 4, 0, 0]]),
        # mean of per-sequence means: (-2 + -4) / 2; row 0 tokens get -A / (3 * 2)
        ("seq_mean_token_mean", (-2 - 4) / 2, [[0, -1 / 6, -2 / 6, -3 / 6], [0, -4 / 2, 0, 0]]),
        # Dr. GRPO: sum / (2 sequences * L_max 8)
        ("seq_mean_token_sum_norm", -10 / 16, [[0, -1 / 16, -2 / 16, -3 / 16], [0, -4 / 16, 0, 0]]),
    ],
)
def test_aggregations(aggregation, expected, grad):
    options = ClippedPGConfig(aggregation=aggregation, is_correction="none")
    loss, g, _ = run(options, *two_rows())
    assert loss == pytest.approx(expected, abs=1e-12)
    assert g.tolist()[0] == pytest.approx(grad[0], abs=1e-12)
    assert g.tolist()[1] == pytest.approx(grad[1], abs=1e-12)


def test_micro_batch_divides_by_the_global_normaliser():
    # The same two rows as a micro batch of a global batch with 10 tokens: share -10 / 10.
    logprobs, batch, _ = two_rows()
    stats = GlobalBatchStats(valid_tokens=10, valid_sequences=5, max_sequence_length=8)
    loss, _, metrics = run(NO_IS, logprobs, batch, stats)
    assert loss == pytest.approx(-1.0, abs=1e-12)
    assert metrics["entropy"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 10)


def test_sample_mask_drops_a_row():
    logprobs, batch, stats = two_rows()
    batch["sample_mask"] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=1, max_sequence_length=8)
    loss, grad, _ = run(NO_IS, logprobs, batch, stats)
    assert loss == pytest.approx(-6 / 3, abs=1e-12)
    assert grad[1].abs().sum() == 0


# --------------------------------------------------------------------------------------------
# GSPO


def gspo_rows():
    # row 0: log-ratios 0.3, -0.1, 0.1 (mean 0.1), A = +1; row 1: log-ratio -0.5, A = -1.
    logprobs = leaf([[0.0, -0.7, -1.1, -0.9], [0.0, -1.5, 0.0, 0.0]])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1], [0, 1, 0, 0]],
        prev_logprobs=[[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0]],
        advantages=[1.0, -1.0],
    )
    stats = GlobalBatchStats(valid_tokens=4, valid_sequences=2, max_sequence_length=8)
    return logprobs, batch, stats


def test_gspo_sequence_ratio_per_sequence_aggregation():
    options = ClippedPGConfig(
        ratio_level="sequence", aggregation="seq_mean_token_mean", is_correction="none"
    )
    loss, grad, metrics = run(options, *gspo_rows())
    s0 = math.exp(0.1)  # 1.105 < 1.2: unclipped
    s1 = math.exp(-0.5)  # 0.607 < 0.8 with A < 0: clipped, max(0.607, 0.8) = 0.8
    assert loss == pytest.approx((-s0 + 0.8) / 2, abs=1e-12)
    # d(-A s0)/dlogp_t = -s0 / 3 on each token of row 0, / 2 sequences; row 1 clipped: 0.
    assert grad.tolist()[0] == pytest.approx([0.0] + [-s0 / 6] * 3, abs=1e-12)
    assert grad.tolist()[1] == pytest.approx([0.0] * 4, abs=1e-12)
    assert metrics["ratio_max"] == pytest.approx(s0)
    assert metrics["ratio_min"] == pytest.approx(s1)
    assert metrics["clip_fraction"] == pytest.approx(1 / 4)  # row 1's single token


def test_gspo_small_epsilons_clip_the_sequence_ratio():
    options = ClippedPGConfig(
        ratio_level="sequence",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        aggregation="seq_mean_token_mean",
        is_correction="none",
    )
    loss, grad, _ = run(options, *gspo_rows())
    # Both sequences clipped: max(-1.105, -1.0004) = -1.0004; max(0.607, 0.9997) = 0.9997.
    assert loss == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-12)
    assert grad.abs().sum() == 0


def test_gspo_default_aggregation_is_per_sequence():
    # aggregation=auto with ratio_level=sequence is seq_mean_token_mean: each sequence counts
    # once, whatever its length (a token mean would give (3 * -s0 + 0.8) / 4 here).
    options = ClippedPGConfig(ratio_level="sequence", is_correction="none")
    assert options.aggregation == "auto"
    loss, grad, _ = run(options, *gspo_rows())
    s0 = math.exp(0.1)
    assert loss == pytest.approx((-s0 + 0.8) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0] + [-s0 / 6] * 3, abs=1e-12)


def test_gspo_refuses_token_mean_aggregation():
    with pytest.raises(ValueError, match="aggregation=token_mean cannot be used with ratio_level"):
        ClippedPGConfig(ratio_level="sequence", aggregation="token_mean")
    # Dr. GRPO's constant normaliser stays available to GSPO.
    ClippedPGConfig(ratio_level="sequence", aggregation="seq_mean_token_sum_norm")


def test_auto_aggregation_resolution():
    assert resolve_aggregation(ClippedPGConfig()) == "token_mean"
    assert resolve_aggregation(ClippedPGConfig(ratio_level="sequence")) == "seq_mean_token_mean"
    explicit = ClippedPGConfig(ratio_level="sequence", aggregation="seq_mean_token_sum_norm")
    assert resolve_aggregation(explicit) == "seq_mean_token_sum_norm"
    resolved = resolved_clipped_pg_config(ClippedPGConfig(ratio_level="sequence"), colocated=True)
    assert (resolved.aggregation, resolved.is_correction) == ("seq_mean_token_mean", "none")
    # Token ratios with the default: token mean, as before `auto` existed.
    loss, _, _ = run(ClippedPGConfig(is_correction="none"), *two_rows())
    assert loss == pytest.approx(-10 / 4, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Importance-sampling correction

W = [3.0, 1.5, 0.4]
"""exp(old - gen) on the three generated tokens of the IS tests."""


def is_row():
    # On-policy with prev_logprobs == logprobs and A = +1, so L_it = -1 before weighting.
    old = [0.0, -1.0, -2.0, -0.5]
    logprobs = leaf([old])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1]],
        prev_logprobs=[old],
        gen_logprobs=[[0.0] + [o - LOG(w) for o, w in zip(old[1:], W, strict=True)]],
        advantages=[1.0],
    )
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=1, max_sequence_length=8)
    return logprobs, batch, stats


GEO = (3.0 * 1.5 * 0.4) ** (1 / 3)  # 1.8^(1/3) ~ 1.2164
PROD = 3.0 * 1.5 * 0.4  # 1.8


@pytest.mark.parametrize(
    ("options", "weights", "limited"),
    [
        (dict(is_correction="none"), [1.0, 1.0, 1.0], None),
        # TIS: min(w, 2)
        (dict(is_correction="token_truncate"), [2.0, 1.5, 0.4], 1 / 3),
        (dict(is_correction="token_truncate", is_truncate_c=1.0), [1.0, 1.0, 0.4], 2 / 3),
        # icepop: w inside [0.5, 5], 0 outside
        (dict(is_correction="token_mask"), [3.0, 1.5, 0.0], 1 / 3),
        (
            dict(is_correction="token_mask", is_mask_low=0.3, is_mask_high=2.0),
            [0.0, 1.5, 0.4],
            1 / 3,
        ),
        (dict(is_correction="sequence_truncate"), [GEO] * 3, 0.0),
        (dict(is_correction="sequence_truncate", is_truncate_c=1.1), [1.1] * 3, 1.0),
        (dict(is_correction="sequence_truncate", is_sequence_weight="product"), [PROD] * 3, 0.0),
        (
            dict(
                is_correction="sequence_truncate", is_sequence_weight="product", is_truncate_c=1.5
            ),
            [1.5] * 3,
            1.0,
        ),
        (dict(is_correction="sequence_mask"), [GEO] * 3, 0.0),
        (dict(is_correction="sequence_mask", is_mask_high=1.1), [0.0] * 3, 1.0),
        (
            dict(is_correction="sequence_mask", is_sequence_weight="product", is_mask_high=1.7),
            [0.0] * 3,
            1.0,
        ),
    ],
)
def test_is_correction_modes(options, weights, limited):
    loss, grad, metrics = run(ClippedPGConfig(**options), *is_row())
    assert loss == pytest.approx(-sum(weights) / 3, abs=1e-12)
    # The weights are detached: the gradient is w * d(-A rho)/dlogp = -w / 3.
    assert grad.tolist()[0] == pytest.approx([0.0] + [-w / 3 for w in weights], abs=1e-12)
    if limited is None:
        assert "is_clipped_fraction" not in metrics
    else:
        assert metrics["is_clipped_fraction"] == pytest.approx(limited)
    # exp(|old - gen|) = 3, 1.5, 1 / 0.4 = 2.5 whatever the mode.
    assert metrics["gen_logprob_error"] == pytest.approx((3.0 + 1.5 + 2.5) / 3)
    assert metrics["gen_logprob_error_max"] == pytest.approx(3.0)


# --------------------------------------------------------------------------------------------
# The IS weight multiplies the policy-gradient term only, never the KL penalty:
#   L_t = w_t * PG_t + beta * KL_t
# Row: A = +1 and ratio 1 (prev == logp), so PG_t = -1; w = exp(old - gen) = 3, 1.5, 0.4 (W);
# d = ref - logp = 0.5, -1, 2 (D); beta = 0.1; token_mean over the 3 tokens.
# Every number below is written out by hand from those inputs.

BETA = 0.1
KL_SUMS = {
    # k1 = -d: -0.5 + 1 - 2
    "k1": -0.5 + 1.0 - 2.0,
    # k2 = d^2 / 2: 0.125 + 0.5 + 2
    "k2": 0.125 + 0.5 + 2.0,
    # k3 = e^d - 1 - d: (e^0.5 - 1.5) + (e^-1 - 1 + 1) + (e^2 - 3)
    "k3": (math.exp(0.5) - 1.5) + math.exp(-1.0) + (math.exp(2.0) - 3.0),
}
KL_GRADS = {
    # d KL / d logp (d = ref - logp): k1 -> 1, k2 -> -d, k3 -> 1 - e^d
    "k1": [1.0, 1.0, 1.0],
    "k2": [-0.5, 1.0, -2.0],
    "k3": [1.0 - math.exp(0.5), 1.0 - math.exp(-1.0), 1.0 - math.exp(2.0)],
}
IS_WEIGHTS = [
    pytest.param(dict(is_correction="none"), [1.0, 1.0, 1.0], id="none"),
    # min(w, 2)
    pytest.param(dict(is_correction="token_truncate"), [2.0, 1.5, 0.4], id="token_truncate"),
    # w inside [0.5, 5], else 0
    pytest.param(dict(is_correction="token_mask"), [3.0, 1.5, 0.0], id="token_mask"),
    # geometric mean (3 * 1.5 * 0.4)^(1/3) = 1.8^(1/3) ~ 1.216 < 2
    pytest.param(
        dict(is_correction="sequence_truncate"), [1.8 ** (1 / 3)] * 3, id="sequence_truncate-geo"
    ),
    # product 3 * 1.5 * 0.4 = 1.8, truncated at C = 1.5
    pytest.param(
        dict(is_correction="sequence_truncate", is_sequence_weight="product", is_truncate_c=1.5),
        [1.5] * 3,
        id="sequence_truncate-product",
    ),
    # geometric mean 1.216 outside [0.5, 1.1]: the whole sequence's PG term is masked
    pytest.param(
        dict(is_correction="sequence_mask", is_mask_high=1.1), [0.0] * 3, id="sequence_mask-geo"
    ),
    # product 1.8 inside [0.5, 5]: kept
    pytest.param(
        dict(is_correction="sequence_mask", is_sequence_weight="product"),
        [1.8] * 3,
        id="sequence_mask-product",
    ),
]


def kl_is_row():
    old = [0.0, -1.0, -2.0, -0.5]
    logprobs = leaf([old])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1]],
        prev_logprobs=[old],
        gen_logprobs=[[0.0, -1.0 - LOG(3.0), -2.0 - LOG(1.5), -0.5 - LOG(0.4)]],
        ref_logprobs=[[0.0, -1.0 + 0.5, -2.0 - 1.0, -0.5 + 2.0]],
        advantages=[1.0],
    )
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=1, max_sequence_length=8)
    return logprobs, batch, stats


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize(("is_options", "weights"), IS_WEIGHTS)
def test_is_weight_scales_the_pg_term_but_not_the_kl_term(estimator, is_options, weights):
    options = ClippedPGConfig(kl_coef=BETA, kl_estimator=estimator, **is_options)
    loss, grad, metrics = run(options, *kl_is_row())
    # sum_t (w_t * -1 + beta * KL_t) / 3
    assert loss == pytest.approx((-sum(weights) + BETA * KL_SUMS[estimator]) / 3, abs=1e-12)
    # d/dlogp_t = (w_t * -A * rho_t + beta * dKL_t) / 3 with the weights detached
    expected_grad = [(-w + BETA * g) / 3 for w, g in zip(weights, KL_GRADS[estimator], strict=True)]
    assert grad.tolist()[0] == pytest.approx([0.0, *expected_grad], abs=1e-12)
    assert metrics["kl"] == pytest.approx(KL_SUMS[estimator] / 3, abs=1e-12)


@pytest.mark.parametrize(
    "is_correction", ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_kl_only_loss_is_the_same_under_every_is_correction(is_correction):
    # A = 0, k1 = logp - ref = 1 on the one token, beta = 0.1, w = exp(old - gen) = 4:
    # the loss is beta * k1 = 0.1 whatever the correction does to w (4, 2 or 0).
    logprobs = leaf([[0.0, -1.0]])
    batch = make_batch(
        loss_mask=[[0, 1]],
        prev_logprobs=[[0.0, -1.0]],
        gen_logprobs=[[0.0, -1.0 - LOG(4.0)]],
        ref_logprobs=[[0.0, -2.0]],
        advantages=[0.0],
    )
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=1, max_sequence_length=8)
    options = ClippedPGConfig(kl_coef=0.1, kl_estimator="k1", is_correction=is_correction)
    loss, grad, _ = run(options, logprobs, batch, stats)
    assert loss == pytest.approx(0.1, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.1], abs=1e-12)


def test_is_weight_uses_trainer_logprobs_when_on_policy_shortcut():
    # Without prev_logprobs, old = sg(logp): the weight is exp(logp - gen).
    logprobs, batch, stats = is_row()
    del batch.tensors["prev_logprobs"]
    loss, _, _ = run(ClippedPGConfig(is_correction="token_truncate"), logprobs, batch, stats)
    assert loss == pytest.approx(-(2.0 + 1.5 + 0.4) / 3, abs=1e-12)


def test_is_correction_needs_gen_logprobs():
    logprobs, batch, stats = one_row([1.0], advantage=1.0)
    with pytest.raises(KeyError, match="gen_logprobs"):
        run(ClippedPGConfig(is_correction="token_mask"), logprobs, batch, stats)


def test_auto_is_correction_resolution():
    assert ClippedPGConfig().is_correction == "auto"
    assert resolve_is_correction(ClippedPGConfig(), colocated=True) == "none"
    assert resolve_is_correction(ClippedPGConfig(), colocated=False) == "token_truncate"
    explicit = ClippedPGConfig(is_correction="sequence_mask")
    assert resolve_is_correction(explicit, colocated=True) == "sequence_mask"
    assert resolve_is_correction("token_mask", colocated=False) == "token_mask"
    assert resolved_clipped_pg_config(ClippedPGConfig(), colocated=False).is_correction == (
        "token_truncate"
    )
    with pytest.raises(ValueError):
        resolve_is_correction("bogus", colocated=True)


def test_unresolved_auto_follows_the_batch():
    # With gen_logprobs: token_truncate (min(w, 2)); without: no correction.
    loss, _, _ = run(ClippedPGConfig(), *is_row())
    assert loss == pytest.approx(-(2.0 + 1.5 + 0.4) / 3, abs=1e-12)
    loss, _, _ = run(ClippedPGConfig(), *one_row([1.0, 1.0], advantage=1.0))
    assert loss == pytest.approx(-1.0, abs=1e-12)


def test_mask_bounds_are_validated():
    with pytest.raises(ValueError, match="is_mask_low"):
        ClippedPGConfig(is_mask_low=2.0, is_mask_high=1.0)
    with pytest.raises(ValueError):
        ClippedPGConfig(aggregation="sum")


# --------------------------------------------------------------------------------------------
# The aggregation contract: micro batches, data-parallel ranks, padding

CONTRACT_OPTIONS = [
    pytest.param(dict(is_correction="none"), id="grpo-token-mean"),
    pytest.param(
        dict(
            aggregation="seq_mean_token_mean",
            kl_coef=0.05,
            kl_estimator="k3",
            is_correction="token_truncate",
        ),
        id="seq-mean-k3-tis",
    ),
    pytest.param(
        dict(
            aggregation="seq_mean_token_sum_norm",
            clip_eps_high=0.28,
            dual_clip_c=3.0,
            is_correction="token_mask",
            kl_coef=0.1,
            kl_estimator="k2",
        ),
        id="drgrpo-dual-icepop-k2",
    ),
    pytest.param(
        dict(use_cispo=True, clip_eps_high=0.1, is_correction="token_truncate", kl_coef=0.05),
        id="cispo-tis-k3",
    ),
    pytest.param(
        dict(use_cispo=True, clip_eps_low=1.0, aggregation="seq_mean_token_mean"),
        id="cispo-nolow-seqmean",
    ),
    pytest.param(
        dict(
            ratio_level="sequence",
            aggregation="seq_mean_token_mean",
            clip_eps_low=0.05,
            clip_eps_high=0.05,
            is_correction="sequence_mask",
            is_mask_high=1.5,
        ),
        id="gspo-seqmask",
    ),
    pytest.param(
        dict(
            ratio_level="sequence",
            is_correction="sequence_truncate",
            is_sequence_weight="product",
            kl_coef=0.02,
            kl_estimator="k1",
        ),
        id="gspo-auto-seqtrunc",
    ),
    pytest.param(
        dict(
            ratio_level="sequence",
            aggregation="seq_mean_token_sum_norm",
            is_correction="token_truncate",
            kl_coef=0.05,
            kl_estimator="k3",
        ),
        id="gspo-sum-norm-tis-k3",
    ),
]


def reference(options: ClippedPGConfig):
    """Loss, gradient and metrics of the whole batch in one micro batch on one rank."""
    logprobs, batch = random_policy_batch()
    stats = global_stats(batch)
    loss, grad, metrics = loss_and_grad(ClippedPGLoss(options), logprobs, [batch], stats)
    return logprobs, batch, stats, loss, grad, metrics


def assert_metrics_equal(left: dict[str, float], right: dict[str, float]) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert left[key] == pytest.approx(right[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("options", CONTRACT_OPTIONS)
@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_micro_batches_sum_to_the_global_loss(options, micro_batch_size):
    options = ClippedPGConfig(**options)
    logprobs, batch, stats, loss, grad, metrics = reference(options)
    assert grad.abs().sum() > 0
    parts = list(batch.micro_batches(micro_batch_size))
    m_loss, m_grad, m_metrics = loss_and_grad(ClippedPGLoss(options), logprobs, parts, stats)
    assert m_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(m_grad, grad, rtol=1e-12, atol=1e-14)
    assert_metrics_equal(m_metrics, metrics)


@pytest.mark.parametrize("options", CONTRACT_OPTIONS)
def test_data_parallel_shards_sum_to_the_global_loss(options):
    # Two simulated ranks, each with micro batches of 2: the global normaliser makes the sum
    # over ranks (what DP gradient all-reduce SUM computes) equal the single-rank loss.
    options = ClippedPGConfig(**options)
    logprobs, batch, stats, loss, grad, metrics = reference(options)
    parts = [mb for shard in batch.shard(2) for mb in shard.micro_batches(2)]
    d_loss, d_grad, d_metrics = loss_and_grad(ClippedPGLoss(options), logprobs, parts, stats)
    assert d_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(d_grad, grad, rtol=1e-12, atol=1e-14)
    assert_metrics_equal(d_metrics, metrics)


@pytest.mark.parametrize("options", CONTRACT_OPTIONS)
def test_right_padding_changes_nothing(options):
    # Extra masked columns holding inf / NaN garbage: same loss, same gradient, zero gradient
    # (not NaN) on the padding.
    options = ClippedPGConfig(**options)
    logprobs, batch, stats, loss, grad, metrics = reference(options)
    padded_logprobs, padded = right_pad(logprobs, batch, extra=5)
    p_loss, p_grad, p_metrics = loss_and_grad(
        ClippedPGLoss(options), padded_logprobs, list(padded.micro_batches(3)), stats
    )
    assert p_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(p_grad[:, : grad.shape[1]], grad, rtol=1e-12, atol=1e-14)
    assert (p_grad[:, grad.shape[1] :] == 0).all()
    assert_metrics_equal(p_metrics, metrics)


def test_all_masked_global_batch_gives_zero_not_nan():
    logprobs, batch, _ = two_rows()
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    stats = GlobalBatchStats(valid_tokens=0, valid_sequences=0, max_sequence_length=8)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        options = ClippedPGConfig(aggregation=aggregation, is_correction="none")
        loss, metrics = ClippedPGLoss(options)(logprobs, batch, stats)
        assert float(loss.detach()) == 0.0
        assert "ratio_max" not in metrics
