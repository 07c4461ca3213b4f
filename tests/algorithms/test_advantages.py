"""Group-relative advantages and the DAPO filters against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.algorithms.advantages import (
    group_relative_advantages,
    has_reward_variance,
    overlong_sample_mask,
    soft_overlong_penalty,
)

EPS = 1e-6


def advantages(rewards, group_ids=None, **options) -> list[float]:
    out = group_relative_advantages(
        torch.tensor(rewards, dtype=torch.float64), group_ids, **options
    )
    return out.reshape(-1).tolist()


def test_mean_baseline_without_std():
    # Dr. GRPO: r - mean; mean of [1, 0, 0, 1] is 0.5.
    got = advantages(
        [[1.0, 0.0, 0.0, 1.0]], use_leave_one_out_baseline=False, normalize_rewards=False
    )
    assert got == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_mean_baseline_with_unbiased_std():
    # Squared deviations sum to 4 * 0.25 = 1; unbiased variance 1 / 3.
    std = math.sqrt(1 / 3)
    got = advantages([[1.0, 0.0, 0.0, 1.0]], use_leave_one_out_baseline=False)
    a = 0.5 / (std + EPS)
    assert got == pytest.approx([a, -a, -a, a], rel=1e-12)


def test_leave_one_out_baseline_by_hand():
    # [1, 2, 6]: sum 9, baselines (9 - r) / 2 = 4, 3.5, 1.5.
    got = advantages([[1.0, 2.0, 6.0]], use_leave_one_out_baseline=True, normalize_rewards=False)
    assert got == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])
    # With std: mean 3, squared deviations 4 + 1 + 9 = 14, unbiased variance 7.
    std = math.sqrt(7)
    got = advantages([[1.0, 2.0, 6.0]])  # the defaults: leave-one-out and std
    assert got == pytest.approx(
        [-3 / (std + EPS), -1.5 / (std + EPS), 4.5 / (std + EPS)], rel=1e-12
    )


def test_zero_variance_groups_are_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must come from the exact max == min test.
    for loo in (False, True):
        for normalize in (False, True):
            out = group_relative_advantages(
                torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.25]]),
                use_leave_one_out_baseline=loo,
                normalize_rewards=normalize,
            )
            assert out[0].tolist() == [0.0, 0.0, 0.0]
            assert torch.isfinite(out).all()
            assert (out[1] != 0).all()


def test_single_sample_groups_are_zero():
    for loo in (False, True):
        assert advantages([[5.0], [-2.0]], use_leave_one_out_baseline=loo) == [0.0, 0.0]


def test_group_ids_of_any_label_and_size():
    # groups: 7 -> [1, 0], 2 -> [5, 3], 9 -> [3] (single sample)
    rewards = [1.0, 5.0, 0.0, 3.0, 3.0]
    ids = [7, 2, 7, 2, 9]
    got = advantages(rewards, ids, use_leave_one_out_baseline=False, normalize_rewards=False)
    assert got == pytest.approx([0.5, 1.0, -0.5, -1.0, 0.0])
    s7, s2 = math.sqrt(0.5), math.sqrt(2.0)
    got = advantages(rewards, ids, use_leave_one_out_baseline=False)
    assert got == pytest.approx(
        [0.5 / (s7 + EPS), 1 / (s2 + EPS), -0.5 / (s7 + EPS), -1 / (s2 + EPS), 0.0], rel=1e-12
    )
    # Leave-one-out in pairs: the baseline is the other sample.
    got = advantages(rewards, ids, normalize_rewards=False)
    assert got == pytest.approx([1.0, 2.0, -1.0, -2.0, 0.0])


def test_shape_and_dtype_are_kept():
    rewards = torch.tensor([[1.0, 0.0], [2.0, 2.0]], dtype=torch.float32)
    out = group_relative_advantages(rewards)
    assert out.shape == (2, 2) and out.dtype == torch.float32
    with pytest.raises(ValueError):
        group_relative_advantages(torch.tensor([1.0, 2.0]))  # 1-D needs group ids


def test_dynamic_sampling_keeps_groups_with_variance():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 2.0]])
    assert has_reward_variance(rewards).tolist() == [False, True, False]
    flat = torch.tensor([1.0, 0.0, 4.0, 1.0, 4.0, 7.0])
    ids = [0, 0, 1, 2, 1, 3]  # group 0 varies, 1 is constant, 2 and 3 are single samples
    assert has_reward_variance(flat, ids).tolist() == [True, True, False, False, False, False]


def test_overlong_filtering_mask():
    mask = overlong_sample_mask(["stop", "length", "stop", "length"])
    assert mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert mask.dtype == torch.float32


def test_soft_overlong_penalty_by_hand():
    # L_max 10, buffer 4: no penalty up to 6, linear to -1 at 10, -1 beyond.
    got = soft_overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), max_length=10, buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError):
        soft_overlong_penalty(torch.tensor([1]), max_length=10, buffer=0)
