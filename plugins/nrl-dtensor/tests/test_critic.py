"""The dtensor backend as a PPO critic: a per-token value head (zero at the start), trained by
the core's step with the clipped value loss; 2 gloo ranks take the same step as one process.

Tolerances as in test_dtensor.py (float32 on CPU; sharding reorders reductions).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from nrl_dtensor.config import DTensorConfig

from nrl_core.algorithms.ppo import critic_batch, state_values
from nrl_core.config.schema import CriticConfig, OptimizerConfig, PolicyConfig, PPOConfig
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.interfaces import ComponentContext
from nrl_core.losses.value import ClippedValueLoss, ValueLossConfig
from nrl_core.policy import Policy
from nrl_core.testing.batches import make_batch

pytestmark = pytest.mark.slow  # starts a 2-rank Ray worker group

WORKER = "_helpers:InspectableWorker"


def critic_context(path) -> ComponentContext:
    """The context a run gives its critic ranks: the PPO config with ``policy`` = the critic
    section (nrl_core.algorithms.session.components.Components.start_critic)."""
    critic = CriticConfig(
        model_name=str(path),
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=4,
        optimizer=OptimizerConfig(lr=1e-2),
    )
    config = PPOConfig(policy=PolicyConfig(model_name=str(path)), critic=critic)
    return ComponentContext(config=attrs.evolve(config, policy=config.critic), seed=0)


def value_batch():
    """A batch with GAE-like targets: the critic learns the return of each generated token."""
    batch = make_batch(8, seed=3)
    g = torch.Generator().manual_seed(5)
    # Around 1, so that one step from V = 0 has a direction to go (mostly up).
    noise = torch.randn(batch["loss_mask"].shape, generator=g)
    returns = (1.0 + 0.3 * noise) * batch["loss_mask"]
    return batch, returns


def test_value_head_starts_at_zero_and_two_ranks_match_one(tiny_path, start_group):
    from nrl_dtensor.worker import DTensorPolicyWorker

    context = critic_context(tiny_path)
    loss_fn = ClippedValueLoss(ValueLossConfig(clip_eps=0.5))
    batch, returns = value_batch()

    single = Policy.from_config(
        InProcessGroup(DTensorPolicyWorker(DTensorConfig(), context)), context.config.policy
    )
    assert single.packing is False  # a value head pools nothing, but takes no packed rows
    before = single.get_logprobs(batch)
    assert before.shape == batch["input_ids"].shape
    assert (before == 0).all()  # a fresh critic has no opinion: V = 0 everywhere
    train_batch = critic_batch(batch, returns, before)
    expected = single.train(train_batch, loss_fn)
    after = single.get_logprobs(batch)
    # The step moved the values towards the returns: the squared error fell.
    mask = train_batch["loss_mask"] != 0
    error = lambda v: float(((v - train_batch["returns"])[mask] ** 2).mean())  # noqa: E731
    assert error(after) < error(before)
    assert expected["value_loss"] > 0 and expected["grad_norm"] > 0

    group = start_group(WORKER, (DTensorConfig(), context), name="critic")
    critic = Policy.from_config(group, context.config.policy)
    torch.testing.assert_close(critic.get_logprobs(batch), before, rtol=0, atol=0)
    got = critic.train(train_batch, loss_fn)
    for key in ("loss", "value_loss", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    for key in ("value_clip_frac", "values_mean", "returns_mean"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(critic.get_logprobs(batch), after, rtol=0, atol=1e-5)


def test_state_values_and_critic_targets_line_up():
    # v[:, j] values the prefix ending at token j; token t is generated in the state that ends
    # at t - 1, so V_t = v[:, t - 1], and the critic's position j learns the return of t = j + 1.
    prefix = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert state_values(prefix).tolist() == [[0.0, 1.0, 2.0, 3.0]]
    batch = make_batch(1, seed=0, min_len=4, max_len=4)
    batch["loss_mask"] = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    returns = torch.tensor([[0.0, 0.0, 5.0, 6.0]])
    critic = critic_batch(batch, returns, prefix)
    assert critic["loss_mask"].tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert critic["returns"].tolist() == [[0.0, 5.0, 6.0, 0.0]]
    # The rollout-time values of the trained positions are the ones GAE used for V_2 and V_3.
    assert critic["old_values"].tolist() == [[0.0, 2.0, 3.0, 0.0]]
