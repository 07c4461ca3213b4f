"""The clipped value loss and explained variance against hand-computed values and gradients,
and the aggregation contract (micro batches, 2 data-parallel shards, padding)."""

from __future__ import annotations

import pytest
import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.losses.value import ClippedValueLoss, ValueLossConfig, explained_variance
from tests.losses.helpers import global_stats, leaf, loss_and_grad, make_batch, random_loss_mask

T = torch.float64


def four_tokens():
    # V_old = 0.5, R = 1, eps = 0.2, so the clipped prediction lies in [0.3, 0.7]:
    #   V = 0.9: max(0.5*0.1^2, 0.5*(0.7-1)^2) = 0.045, clipped branch, V outside: grad 0
    #   V = 0.6: inside the range, both 0.5*0.4^2 = 0.08: grad V - R = -0.4
    #   V = 0.0: max(0.5, 0.5*0.7^2 = 0.245) = 0.5 unclipped: grad -1
    #   V = 1.5: max(0.125, 0.045) = 0.125 unclipped: grad 0.5
    values = leaf([[7.0, 0.9, 0.6, 0.0, 1.5]])
    batch = make_batch(
        loss_mask=[[0, 1, 1, 1, 1]], old_values=[[0.0] + [0.5] * 4], returns=[[0.0] + [1.0] * 4]
    )
    stats = GlobalBatchStats(valid_tokens=4, valid_sequences=1, max_sequence_length=8)
    return values, batch, stats


def test_clipped_value_loss_and_gradient_by_hand():
    values, batch, stats = four_tokens()
    loss, metrics = ClippedValueLoss(ValueLossConfig(clip_eps=0.2))(values, batch, stats)
    loss.backward()
    assert float(loss.detach()) == pytest.approx((0.045 + 0.08 + 0.5 + 0.125) / 4, abs=1e-12)
    assert values.grad.tolist()[0] == pytest.approx([0, 0, -0.4 / 4, -1 / 4, 0.5 / 4], abs=1e-12)
    assert metrics["value_clip_frac"] == pytest.approx(1 / 4)
    assert metrics["values_mean"] == pytest.approx((0.9 + 0.6 + 0.0 + 1.5) / 4)
    assert metrics["returns_mean"] == pytest.approx(1.0)
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()))


def test_without_clip_range_it_is_half_the_squared_error():
    values, batch, stats = four_tokens()
    loss, metrics = ClippedValueLoss(ValueLossConfig(clip_eps=None))(values, batch, stats)
    loss.backward()
    errors = [0.9 - 1, 0.6 - 1, 0.0 - 1, 1.5 - 1]
    assert float(loss.detach()) == pytest.approx(sum(0.5 * e * e for e in errors) / 4, abs=1e-12)
    assert values.grad.tolist()[0] == pytest.approx([0] + [e / 4 for e in errors], abs=1e-12)
    assert metrics["value_clip_frac"] == 0


def random_value_batch(seed=0, rows=8, width=10):
    gen = torch.Generator().manual_seed(seed)
    loss_mask = random_loss_mask(gen, rows, width)
    sample_mask = torch.ones(rows, dtype=T)
    sample_mask[3] = 0.0
    values = torch.randn(rows, width, generator=gen, dtype=T)
    old = values + 0.3 * torch.randn(rows, width, generator=gen, dtype=T)
    returns = torch.randn(rows, width, generator=gen, dtype=T)
    batch = Batch(
        {"loss_mask": loss_mask, "sample_mask": sample_mask, "old_values": old, "returns": returns}
    )
    return values, batch


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_and_two_ranks_sum_to_the_one_rank_loss(aggregation):
    values, batch = random_value_batch()
    stats = global_stats(batch)
    loss_fn = ClippedValueLoss(ValueLossConfig(clip_eps=0.1, aggregation=aggregation))
    loss, grad, metrics = loss_and_grad(loss_fn, values, [batch], stats)
    assert 0 < metrics["value_clip_frac"] < 1 and grad.abs().sum() > 0
    parts = [mb for shard in batch.shard(2) for mb in shard.micro_batches(2)]
    d_loss, d_grad, d_metrics = loss_and_grad(loss_fn, values, parts, stats)
    assert d_loss == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(d_grad, grad, rtol=1e-12, atol=1e-14)
    for key in metrics:
        assert d_metrics[key] == pytest.approx(metrics[key], rel=1e-9, abs=1e-12), key


def test_padding_garbage_changes_nothing():
    values, batch = random_value_batch(seed=1)
    stats = global_stats(batch)
    loss_fn = ClippedValueLoss()
    loss, grad, _ = loss_and_grad(loss_fn, values, [batch], stats)
    extra = 3

    def pad(x, fill):
        return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=1)

    padded = Batch(
        {
            "loss_mask": pad(batch["loss_mask"], 0.0),
            "sample_mask": batch["sample_mask"],
            "old_values": pad(batch["old_values"], float("nan")),
            "returns": pad(batch["returns"], float("inf")),
        }
    )
    p_loss, p_grad, _ = loss_and_grad(loss_fn, pad(values, float("-inf")), [padded], stats)
    assert p_loss == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(p_grad[:, :-extra], grad, rtol=1e-12, atol=1e-14)
    assert (p_grad[:, -extra:] == 0).all()


def test_explained_variance():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=T)
    returns = torch.tensor([[9.0, 1.0, 2.0, 3.0], [4.0, 5.0, 9.0, 9.0]], dtype=T)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    mean = torch.full_like(returns, 3.0)  # the mean of the valid returns 1..5
    assert explained_variance(mean, returns, mask) == pytest.approx(0.0)
    # V = R + noise of variance v / Var(R): 1 - Var(noise) / Var(R) = 1 - 0.5 / 2 (pop. var).
    noise = torch.tensor([[0.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=T)
    assert explained_variance(returns + noise, returns, mask) == pytest.approx(1 - 0.4 / 2)
    assert explained_variance(returns, torch.ones_like(returns), mask) != explained_variance(
        returns, torch.ones_like(returns), mask
    )  # NaN: constant returns leave nothing to explain
