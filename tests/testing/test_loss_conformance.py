"""The core's registered losses against the loss conformance suite, in their main settings."""

from __future__ import annotations

import pytest

from nrl_core.losses.clipped_pg import ClippedPGLoss
from nrl_core.losses.config import ClippedPGConfig, DPOLossConfig, NLLConfig
from nrl_core.losses.nll import NLLLoss
from nrl_core.losses.preference import DPOLoss
from nrl_core.testing.conformance import LossConformance


class TestClippedPGDefault(LossConformance):
    """Classic GRPO: token-mean, no KL, no importance-sampling correction."""

    registered_name = "clipped_pg"

    @pytest.fixture
    def loss_fn(self):
        return ClippedPGLoss(ClippedPGConfig(is_correction="none"), None)


@pytest.mark.parametrize(
    "options",
    [
        ClippedPGConfig(kl_coef=0.1, kl_estimator="k3", is_correction="token_truncate"),
        ClippedPGConfig(aggregation="seq_mean_token_sum_norm", clip_eps_high=0.28),
        ClippedPGConfig(
            ratio_level="sequence",
            aggregation="seq_mean_token_mean",
            is_correction="sequence_mask",
            dual_clip_c=3.0,
        ),
    ],
    ids=["kl-token-is", "dr-grpo-dapo", "gspo-dual-clip"],
)
class TestClippedPGVariants(LossConformance):
    """KL with a reference, Dr. GRPO aggregation with clip-higher, GSPO with a sequence mask."""

    @pytest.fixture
    def loss_fn(self, options):
        return ClippedPGLoss(options, None)


class TestNLL(LossConformance):
    registered_name = "nll"

    @pytest.fixture
    def loss_fn(self):
        return NLLLoss(NLLConfig(), None)


class TestDPO(LossConformance):
    """Rows 2i/2i+1 are a (chosen, rejected) pair, so micro batches hold whole pairs."""

    registered_name = "dpo"
    micro_batch_size = 2

    @pytest.fixture
    def loss_fn(self):
        return DPOLoss(DPOLossConfig(sft_loss_weight=0.5), None)
