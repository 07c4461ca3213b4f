"""GAE against a direct sum over the time steps, and the global whitening it is used with."""

from __future__ import annotations

import pytest
import torch

from nrl_core.algorithms.advantages import gae_advantages, outcome_token_rewards, whiten

T = torch.float64

# Row 1 has an environment observation (mask 0) between generated tokens; row 3 is empty.
MASK = [
    [0, 1, 1, 1, 1, 0],
    [0, 1, 0, 0, 1, 1],
    [1, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0],
]
REWARDS = [
    [5.0, 0.1, -0.2, 0.0, 1.0, 5.0],
    [5.0, 0.3, 5.0, 5.0, -0.1, 2.0],
    [0.5, -1.0, 5.0, 5.0, 5.0, 5.0],
    [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
]
VALUES = [
    [9.0, 0.2, 0.4, 0.5, 0.9, 9.0],
    [9.0, 1.1, 9.0, 9.0, 0.7, 1.5],
    [0.3, -0.4, 9.0, 9.0, 9.0, 9.0],
    [9.0, 9.0, 9.0, 9.0, 9.0, 9.0],
]


def direct(gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} over each row's list of valid steps, with
    delta_k = r_k + gamma V_{k+1} - V_k and V = 0 after the last step; R_t = A_t + V_t."""
    advantages = [[0.0] * len(row) for row in MASK]
    returns = [[0.0] * len(row) for row in MASK]
    for i, row in enumerate(MASK):
        steps = [t for t, m in enumerate(row) if m]
        v = [VALUES[i][t] for t in steps] + [0.0]
        delta = [REWARDS[i][t] + gamma * v[k + 1] - v[k] for k, t in enumerate(steps)]
        for j, t in enumerate(steps):
            advantages[i][t] = sum(
                (gamma * lam) ** (k - j) * delta[k] for k in range(j, len(steps))
            )
            returns[i][t] = advantages[i][t] + v[j]
    return torch.tensor(advantages, dtype=T), torch.tensor(returns, dtype=T)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.8)])
def test_gae_equals_the_direct_sum(gamma, lam):
    got_a, got_r = gae_advantages(
        torch.tensor(REWARDS, dtype=T), torch.tensor(VALUES, dtype=T),
        torch.tensor(MASK, dtype=T), gamma, lam,
    )  # fmt: skip
    want_a, want_r = direct(gamma, lam)
    torch.testing.assert_close(got_a, want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_r, want_r, rtol=1e-12, atol=1e-12)


def test_lambda_one_gives_the_discounted_return_minus_the_value():
    # With lambda = 1 the value terms telescope: A_t = sum_k gamma^k r_{t+k} - V_t.
    gamma = 0.9
    got_a, got_r = gae_advantages(
        torch.tensor(REWARDS, dtype=T), torch.tensor(VALUES, dtype=T),
        torch.tensor(MASK, dtype=T), gamma, 1.0,
    )  # fmt: skip
    steps = [1, 2, 3, 4]
    mc = sum(gamma**k * REWARDS[0][t] for k, t in enumerate(steps))
    assert float(got_r[0, 1]) == pytest.approx(mc, abs=1e-12)
    assert float(got_a[0, 1]) == pytest.approx(mc - VALUES[0][1], abs=1e-12)


def test_outcome_rewards_with_kl_and_global_whitening():
    mask = torch.tensor(MASK, dtype=T)
    kl = torch.tensor(VALUES, dtype=T)  # any numbers; masked positions must not count
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, kl=kl, kl_coef=0.1)
    assert rewards[0].tolist() == pytest.approx([0, -0.02, -0.04, -0.05, 1 - 0.09, 0])
    assert rewards[1].tolist() == pytest.approx([0, -0.11, 0, 0, -0.07, 2 - 0.15])
    assert (rewards[3] == 0).all()
    white = whiten(rewards, mask)
    valid = mask != 0
    assert float(white[valid].mean()) == pytest.approx(0, abs=1e-12)
    assert float(white[valid].std(unbiased=False)) == pytest.approx(1, abs=1e-6)
    assert (white[~valid] == 0).all()
