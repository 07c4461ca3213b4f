"""The learning-rate schedule shared by the policy backends (nrl_core.lr_schedule), against the
formulas written out here, and its config checks."""

from __future__ import annotations

import math

import pytest

from nrl_core.config.schema.policy import OptimizerConfig
from nrl_core.lr_schedule import lr_scale


def test_constant_after_warm_up():
    schedule = OptimizerConfig(warmup_steps=4)
    assert [lr_scale(s, schedule) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_scale(0, OptimizerConfig()) == 1.0


def test_linear_decay_to_the_floor_then_held():
    schedule = OptimizerConfig(warmup_steps=2, decay="linear", decay_steps=10, min_lr_ratio=0.1)
    assert lr_scale(1, schedule) == 1.0  # the warm-up's last step is at the peak
    assert lr_scale(2, schedule) == 1.0  # the decay starts from the peak
    assert lr_scale(7, schedule) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_scale(12, schedule) == pytest.approx(0.1)
    assert lr_scale(500, schedule) == pytest.approx(0.1)


def test_cosine_decay():
    schedule = OptimizerConfig(decay="cosine", decay_steps=8)
    expected = [0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(9)]
    assert [lr_scale(s, schedule) for s in range(9)] == pytest.approx(expected)
    assert lr_scale(2, schedule) > lr_scale(2, OptimizerConfig(decay="linear", decay_steps=8))
    assert lr_scale(100, schedule) == 0.0


def test_a_decay_needs_its_length():
    with pytest.raises(ValueError, match="decay=cosine needs decay_steps"):
        OptimizerConfig(decay="cosine")
    with pytest.raises(ValueError, match="decay"):
        OptimizerConfig(decay="step", decay_steps=3)
