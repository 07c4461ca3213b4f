"""REINFORCE++ and REINFORCE++-baseline token advantages against a direct sum over the time
steps, and their global-batch normalisation through the loss's micro-batch / 2-rank contract."""

from __future__ import annotations

import statistics

import pytest
import torch

from nrl_core.algorithms.advantages import (
    REINFORCE_PP_EPS,
    discounted_returns,
    reinforce_plus_plus_advantages,
)
from nrl_core.data import Batch
from nrl_core.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss
from tests.losses.helpers import global_stats, loss_and_grad, random_loss_mask

T = torch.float64

# Four samples in two groups; row 2 has an environment observation (mask 0) between its two
# generated tokens, row 4 has no generated token at all.
MASK = [
    [0, 1, 1, 1, 0],
    [0, 0, 1, 1, 1],
    [0, 1, 0, 1, 0],
    [0, 1, 1, 0, 0],
    [0, 0, 0, 0, 0],
]
REWARDS = [1.0, 0.0, 2.0, 2.0, 5.0]
GROUPS = [0, 0, 1, 1, 2]
KL = [
    [9.0, 0.5, -0.2, 0.3, 9.0],
    [9.0, 9.0, 0.1, 0.4, -0.3],
    [9.0, 0.2, 9.0, 0.6, 9.0],
    [9.0, -0.1, 0.7, 9.0, 9.0],
    [9.0, 9.0, 9.0, 9.0, 9.0],
]


def direct_returns(mask, token_reward, gamma):
    """G_t = sum over the later valid tokens u of gamma^k r_u, k the valid steps from t to u:
    a double sum over each row's list of valid positions (no recursion, no cumsum)."""
    out = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        for j, t in enumerate(steps):
            out[i][t] = sum(
                gamma ** (k - j) * token_reward(i, steps[k], k == len(steps) - 1)
                for k in range(j, len(steps))
            )
    return out


def direct_advantages(scores, gamma, beta):
    def token_reward(i, t, last):
        return -beta * KL[i][t] + (scores[i] if last else 0.0)

    returns = direct_returns(MASK, token_reward, gamma)
    valid = [returns[i][t] for i, row in enumerate(MASK) for t, m in enumerate(row) if m]
    mean, std = statistics.fmean(valid), statistics.pstdev(valid)
    return [
        [(returns[i][t] - mean) / (std + REINFORCE_PP_EPS) if m else 0.0 for t, m in enumerate(row)]
        for i, row in enumerate(MASK)
    ]


def run(baseline, gamma, beta):
    return reinforce_plus_plus_advantages(
        torch.tensor(REWARDS, dtype=T),
        torch.tensor(MASK, dtype=T),
        GROUPS,
        baseline=baseline,
        gamma=gamma,
        kl=torch.tensor(KL, dtype=T),
        kl_coef=beta,
    )


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_equal_the_direct_sum(gamma):
    rewards = torch.tensor(KL, dtype=T)
    got = discounted_returns(rewards, torch.tensor(MASK, dtype=T), gamma)
    want = direct_returns(MASK, lambda i, t, last: KL[i][t], gamma)
    torch.testing.assert_close(got, torch.tensor(want, dtype=T), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("gamma", "beta"), [(1.0, 0.0), (1.0, 0.1), (0.9, 0.05)])
def test_reinforce_plus_plus_by_direct_sum(gamma, beta):
    # REINFORCE++: the raw reward on the last generated token, the KL penalty on every one.
    want = direct_advantages(REWARDS, gamma, beta)
    got = run(baseline=False, gamma=gamma, beta=beta)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=T), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("gamma", "beta"), [(1.0, 0.0), (0.9, 0.05)])
def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first(gamma, beta):
    # Group 0: mean 0.5 -> scores 0.5, -0.5. Group 1: rewards equal -> 0. Group 2: one sample
    # -> 0 (and no valid token anyway). Then the same returns and global normalisation.
    want = direct_advantages([0.5, -0.5, 0.0, 0.0, 0.0], gamma, beta)
    got = run(baseline=True, gamma=gamma, beta=beta)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=T), rtol=1e-6, atol=1e-6)


def test_signs_more_reward_more_advantage_more_kl_less():
    # Without KL, undiscounted: every token of a sample has its sample's return, so the order
    # of the rewards is the order of the advantages.
    got = run(baseline=False, gamma=1.0, beta=0.0)
    assert got[2, 1] > got[0, 1] > got[1, 2]
    # With a KL penalty, a token followed by more KL has a lower return than the same token
    # without it: row 0's first token (KL 0.5 + -0.2 + 0.3 ahead) drops below its last.
    got = run(baseline=False, gamma=1.0, beta=1.0)
    assert got[0, 1] < got[0, 3]


def test_global_normalisation_over_valid_tokens_only():
    got = run(baseline=False, gamma=0.9, beta=0.1).double()
    valid = torch.tensor(MASK, dtype=torch.bool)
    assert float(got[valid].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(got[valid].std(unbiased=False)) == pytest.approx(1.0, abs=1e-6)
    assert (got[~valid] == 0).all()


def test_no_signal_is_exactly_zero():
    mask = torch.tensor(MASK, dtype=T)
    rewards = torch.tensor([1.0, 1.0, 3.0, 3.0, 0.0], dtype=T)
    same = reinforce_plus_plus_advantages(rewards, mask, GROUPS, baseline=True)
    assert (same == 0).all()
    empty = reinforce_plus_plus_advantages(rewards, torch.zeros_like(mask), GROUPS)
    assert (empty == 0).all()


def test_bad_arguments():
    rewards, mask = torch.tensor(REWARDS), torch.tensor(MASK, dtype=T)
    with pytest.raises(ValueError, match="group_ids"):
        reinforce_plus_plus_advantages(rewards, mask, baseline=True)
    with pytest.raises(ValueError, match="kl"):
        reinforce_plus_plus_advantages(rewards, mask, kl_coef=0.1)


def random_step(seed=0, rows=8, width=10):
    """A step's rollout batch: loss_mask, sample_mask (row 1 dropped), rewards, groups of 4."""
    gen = torch.Generator().manual_seed(seed)
    loss_mask = random_loss_mask(gen, rows, width)
    sample_mask = torch.ones(rows, dtype=T)
    sample_mask[1] = 0.0
    rewards = torch.randint(0, 2, (rows,), generator=gen).to(T)
    kl = 0.3 * torch.randn(rows, width, generator=gen, dtype=T)
    logprobs = -torch.rand(rows, width, generator=gen, dtype=T) * 3
    return loss_mask, sample_mask, rewards, kl, logprobs


@pytest.mark.parametrize("baseline", [False, True])
def test_two_ranks_train_like_one_on_the_global_advantages(baseline):
    # The driver normalises on the WHOLE step's batch, then the core shards it over 2 ranks
    # with micro batches of 2: loss and gradient equal the single-rank ones. Normalising each
    # rank's shard on its own (what a rank-local estimator would do) gives another gradient.
    loss_mask, sample_mask, rewards, kl, logprobs = random_step()
    mask = loss_mask * sample_mask[:, None]
    groups = [i // 4 for i in range(len(rewards))]

    def advantages(rows):
        return reinforce_plus_plus_advantages(
            rewards[rows], mask[rows], [groups[i] for i in rows],
            baseline=baseline, gamma=0.95, kl=kl[rows], kl_coef=0.1,
        ).double()  # fmt: skip

    everything = list(range(len(rewards)))
    batch = Batch(
        {"loss_mask": loss_mask, "sample_mask": sample_mask, "advantages": advantages(everything)}
    )
    stats = global_stats(batch)
    loss_fn = ClippedPGLoss(ClippedPGConfig(is_correction="none"))
    one_loss, one_grad, _ = loss_and_grad(loss_fn, logprobs, [batch], stats)
    parts = [mb for shard in batch.shard(2) for mb in shard.micro_batches(2)]
    two_loss, two_grad, _ = loss_and_grad(loss_fn, logprobs, parts, stats)
    assert two_loss == pytest.approx(one_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(two_grad, one_grad, rtol=1e-12, atol=1e-14)
    assert one_grad.abs().sum() > 0

    half = len(rewards) // 2
    local = torch.cat([advantages(everything[:half]), advantages(everything[half:])])
    local_batch = Batch({"loss_mask": loss_mask, "sample_mask": sample_mask, "advantages": local})
    _, local_grad, _ = loss_and_grad(loss_fn, logprobs, [local_batch], stats)
    assert not torch.allclose(local_grad, one_grad, rtol=1e-3, atol=1e-6)
