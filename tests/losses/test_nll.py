"""The SFT negative log-likelihood against hand-computed values and the aggregation contract."""

from __future__ import annotations

import pytest
import torch

from nrl_core.interfaces import GlobalBatchStats, LossFunction
from nrl_core.losses.nll import NLLConfig, NLLLoss
from tests.losses.helpers import global_stats, leaf, loss_and_grad, make_batch, right_pad


def sft_batch():
    # Row 0: prompt, then assistant tokens with logp -1, -2; row 1: prompt, assistant -0.5, pad.
    logprobs = leaf([[0.0, -1.0, -2.0], [0.0, -0.5, -9.0]])
    batch = make_batch(loss_mask=[[0, 1, 1], [0, 1, 0]])
    return logprobs, batch


def test_token_mean_nll_by_hand():
    logprobs, batch = sft_batch()
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    loss_fn = NLLLoss(NLLConfig())
    assert isinstance(loss_fn, LossFunction)
    assert not loss_fn.needs_reference and not loss_fn.needs_prev_logprobs
    loss, metrics = loss_fn(logprobs, batch, stats)
    loss.backward()
    assert float(loss.detach()) == pytest.approx((1.0 + 2.0 + 0.5) / 3, abs=1e-12)
    # dL/dlogp = -1/3 on assistant tokens, 0 on prompt and padding.
    expected_grad = torch.tensor([[0, -1 / 3, -1 / 3], [0, -1 / 3, 0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics == {"loss": pytest.approx(3.5 / 3), "num_valid_tokens": 3.0}


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("seq_mean_token_mean", ((1.0 + 2.0) / 2 + 0.5) / 2),
        ("seq_mean_token_sum_norm", 3.5 / (2 * 4)),
    ],
)
def test_other_aggregations(aggregation, expected):
    logprobs, batch = sft_batch()
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    loss, _ = NLLLoss(NLLConfig(aggregation=aggregation))(logprobs, batch, stats)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)


def test_micro_batches_ranks_and_padding_change_nothing():
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 4
    mask = (torch.rand(6, 7, generator=gen) > 0.4).to(torch.float64)
    mask[:, 0] = 0
    batch = make_batch(loss_mask=mask.tolist())
    stats = global_stats(batch)
    loss_fn = NLLLoss()
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, [batch], stats)
    assert loss == pytest.approx(float(-(logprobs * mask).sum() / mask.sum()), rel=1e-12)

    micro = loss_and_grad(loss_fn, logprobs, list(batch.micro_batches(4)), stats)
    ranks = loss_and_grad(
        loss_fn, logprobs, [mb for s in batch.shard(2) for mb in s.micro_batches(2)], stats
    )
    padded_logprobs, padded = right_pad(logprobs, batch, extra=3)
    pad = loss_and_grad(loss_fn, padded_logprobs, list(padded.micro_batches(5)), stats)
    for other_loss, other_grad, other_metrics in (micro, ranks, pad):
        assert other_loss == pytest.approx(loss, rel=1e-12)
        torch.testing.assert_close(other_grad[:, :7], grad, rtol=1e-12, atol=1e-14)
        assert other_metrics == pytest.approx(metrics)
    assert (pad[1][:, 7:] == 0).all()
