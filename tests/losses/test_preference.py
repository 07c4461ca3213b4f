"""DPO and Bradley-Terry against hand-computed values, and DPO's aggregation contract."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.interfaces import GlobalBatchStats, LossFunction
from nrl_core.losses.preference import (
    DPOLoss,
    DPOLossConfig,
    bradley_terry_loss,
    bradley_terry_metrics,
)
from tests.losses.helpers import leaf, loss_and_grad, make_batch


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def pairs():
    """Two pairs (rows 0/1 and 2/3); position 0 is the prompt.

    pair 0: chosen logp -1, -2 (ref -1.5, -2.5); rejected logp -3 (ref -2)
    pair 1: chosen logp -2 (ref -1);           rejected logp -1, -1 (ref -1.5, -0.5)
    """
    logprobs = leaf(
        [
            [0.0, -1.0, -2.0],
            [0.0, -3.0, 0.0],
            [0.0, -2.0, 0.0],
            [0.0, -1.0, -1.0],
        ]
    )
    batch = make_batch(
        loss_mask=[[0, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 1]],
        ref_logprobs=[[0, -1.5, -2.5], [0, -2.0, 0], [0, -1.0, 0], [0, -1.5, -0.5]],
    )
    stats = GlobalBatchStats(valid_tokens=6, valid_sequences=4, max_sequence_length=4)
    return logprobs, batch, stats


def test_dpo_with_summed_logprobs():
    # pair 0: (pi_c - ref_c) = -3 - -4 = 1, (pi_r - ref_r) = -3 - -2 = -1, h = 0.5 * 2 = 1
    # pair 1: (pi_c - ref_c) = -2 - -1 = -1, (pi_r - ref_r) = -2 - -2 = 0,  h = 0.5 * -1 = -0.5
    logprobs, batch, stats = pairs()
    loss_fn = DPOLoss(DPOLossConfig(beta=0.5))
    assert isinstance(loss_fn, LossFunction)
    assert loss_fn.needs_reference and not loss_fn.needs_prev_logprobs
    loss, metrics = loss_fn(logprobs, batch, stats)
    loss.backward()
    expected = (softplus(-1.0) + softplus(0.5)) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    assert metrics["loss"] == pytest.approx(expected)
    assert metrics["reward_margin"] == pytest.approx((1.0 - 0.5) / 2)
    assert metrics["preference_accuracy"] == pytest.approx(0.5)
    assert metrics["reward_chosen"] == pytest.approx((0.5 * 1 + 0.5 * -1) / 2)
    assert metrics["reward_rejected"] == pytest.approx((0.5 * -1 + 0.5 * 0) / 2)
    assert "sft_loss" not in metrics
    # dL/dlogp of a chosen token = -beta * (1 - sigmoid(h)) / pairs; rejected: the opposite.
    g0 = 0.5 * (1 - sigmoid(1.0)) / 2
    g1 = 0.5 * (1 - sigmoid(-0.5)) / 2
    expected_grad = [[0, -g0, -g0], [0, g0, 0], [0, -g1, 0], [0, g1, g1]]
    torch.testing.assert_close(
        logprobs.grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_dpo_with_average_logprobs():
    # pair 0: chosen mean -1.5 vs ref -2 -> 0.5; rejected -3 vs -2 -> -1; h = 0.5 * 1.5 = 0.75
    # pair 1: chosen -2 vs -1 -> -1; rejected mean -1 vs mean -1 -> 0;     h = -0.5
    logprobs, batch, stats = pairs()
    loss, metrics = DPOLoss(DPOLossConfig(beta=0.5, average_logprobs=True))(logprobs, batch, stats)
    assert float(loss.detach()) == pytest.approx((softplus(-0.75) + softplus(0.5)) / 2)
    assert metrics["reward_margin"] == pytest.approx((0.75 - 0.5) / 2)


def test_dpo_sft_term_on_chosen():
    # SFT term: 0.1 * mean over pairs of -pi_c = 0.1 * (3 + 2) / 2
    logprobs, batch, stats = pairs()
    loss, metrics = DPOLoss(DPOLossConfig(beta=0.5, sft_loss_weight=0.1))(logprobs, batch, stats)
    preference = (softplus(-1.0) + softplus(0.5)) / 2
    assert float(loss.detach()) == pytest.approx(preference + 0.1 * 2.5, abs=1e-12)
    assert metrics["sft_loss"] == pytest.approx(2.5)
    assert metrics["preference_loss"] == pytest.approx(preference)


def test_dpo_micro_batches_ranks_and_sample_mask():
    logprobs, batch, stats = pairs()
    loss_fn = DPOLoss(DPOLossConfig(beta=0.5, sft_loss_weight=0.3))
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, [batch], stats)
    for parts in (list(batch.micro_batches(2)), batch.shard(2)):
        other_loss, other_grad, other_metrics = loss_and_grad(loss_fn, logprobs, parts, stats)
        assert other_loss == pytest.approx(loss, rel=1e-12)
        torch.testing.assert_close(other_grad, grad, rtol=1e-12, atol=1e-14)
        assert other_metrics == pytest.approx(metrics)

    # Dropping pair 1 through sample_mask leaves pair 0 over a global count of one pair.
    batch["sample_mask"] = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    one_pair = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    loss, _ = DPOLoss(DPOLossConfig(beta=0.5))(logprobs.detach(), batch, one_pair)
    assert float(loss) == pytest.approx(softplus(-1.0), abs=1e-12)


def test_dpo_rejects_split_pairs():
    logprobs, batch, stats = pairs()
    with pytest.raises(ValueError, match="pairs"):
        DPOLoss()(logprobs[:3], batch.slice(0, 3), stats)


def test_bradley_terry_by_hand():
    chosen = torch.tensor([2.0, 0.0, 1.5], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.5], dtype=torch.float64)
    # margins 1, -1, 0 (a tie counts as wrong)
    loss = bradley_terry_loss(chosen, rejected)
    loss.backward()
    expected = (softplus(-1.0) + softplus(1.0) + math.log(2)) / 3
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    # d/ds_c -log sigmoid(m) = -(1 - sigmoid(m))
    assert chosen.grad.tolist() == pytest.approx(
        [-(1 - sigmoid(m)) / 3 for m in (1.0, -1.0, 0.0)], abs=1e-12
    )
    metrics = bradley_terry_metrics(chosen, rejected)
    assert metrics == pytest.approx({"loss": expected, "accuracy": 1 / 3, "margin": 0.0})


def test_bradley_terry_global_normaliser_is_additive():
    chosen = torch.tensor([2.0, 0.0, 1.5, -1.0])
    rejected = torch.tensor([1.0, 1.0, 1.5, -3.0])
    full = bradley_terry_loss(chosen, rejected)
    halves = bradley_terry_loss(chosen[:2], rejected[:2], normaliser=4) + bradley_terry_loss(
        chosen[2:], rejected[2:], normaliser=4
    )
    assert float(halves) == pytest.approx(float(full), rel=1e-6)
    parts = [
        bradley_terry_metrics(chosen[:2], rejected[:2], normaliser=4),
        bradley_terry_metrics(chosen[2:], rejected[2:], normaliser=4),
    ]
    assert sum(p["accuracy"] for p in parts) == pytest.approx(0.5)
