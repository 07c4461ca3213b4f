"""`nrl run grpo` with CISPO and the REINFORCE++ estimators through the real CLI (issue 49):
3 steps on 2 CPU policy ranks, every training number finite."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.algorithms.test_grpo_cli import IN_PROCESS, metrics

pytestmark = pytest.mark.slow

# The embedded recipe's sizes (256 samples a step after 30 warm-up steps), not test_grpo_cli's
# TINY ones: with 16 samples after 1 warm-up step every reward can be 0, hence every advantage
# and gradient, and a step would show nothing. One policy rank, in the `nrl` process: what is
# checked is the estimators' arithmetic, which does not depend on the rank count (test_grpo_cli
# runs 2 ranks on Ray).
BASE = ["cluster.num_cpus=2", "data.max_val_samples=16", *IN_PROCESS]
VARIANTS = {
    "cispo": [
        "loss.clipped_pg.use_cispo=true",
        "loss.clipped_pg.clip_eps_low=1",
        "loss.clipped_pg.clip_eps_high=3",
    ],
    "reinforce_plus_plus": [
        "grpo.advantage_estimator=reinforce_plus_plus",
        "grpo.reward_kl_coef=0.01",
        "grpo.gamma=0.99",
    ],
    "reinforce_plus_plus_baseline": ["grpo.advantage_estimator=reinforce_plus_plus_baseline"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_three_steps_from_the_cli(tmp_path, variant):
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q",
        f"logger.log_dir={tmp_path}", "logger.run_name=run", "checkpointing.enabled=false",
        "grpo.max_num_steps=3", "grpo.val_period=3", *BASE, *VARIANTS[variant],
    ]  # fmt: skip
    # 30 minutes, not test_grpo_cli's 10: the start-up alone took 10 minutes on the shared
    # 2-core machine while other suites ran (about 1 minute when it is idle).
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        for key in ("train/loss", "train/grad_norm", "train/clip_fraction", "train/entropy"):
            assert math.isfinite(record[key]), (key, record[key])
        assert record["train/grad_norm"] > 0
        # One optimizer step per rollout: on-policy, so no ratio (CISPO: no weight) is clipped.
        assert record["train/clip_fraction"] == 0
    if variant == "reinforce_plus_plus":
        # The KL in the rewards is measured against the model after the warm-up: 0 at the
        # first step (the rollout policy is the reference), > 0 once the policy has moved.
        assert abs(records[1]["train/reward_kl"]) < 1e-6
        assert records[2]["train/reward_kl"] > 0
    else:
        assert "train/reward_kl" not in records[1]
    assert "val/accuracy" in records[-1]
