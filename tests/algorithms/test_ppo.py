"""``nrl run ppo`` without Ray: its config (the ``ppo`` section extends ``grpo``'s, the critic
starts from the policy's checkpoint), the value/target alignment of the critic, and the
``nrl plot`` charts of the critic's metrics. The end-to-end runs are in test_ppo_cli.py."""

from __future__ import annotations

import json

import pytest
import torch

from nrl_core.algorithms.advantages import gae_advantages, outcome_token_rewards
from nrl_core.algorithms.ppo import critic_batch, shift_left, state_values
from nrl_core.algorithms.recipes import default_recipe
from nrl_core.config.schema import GRPOSection, PolicyConfig, PPOConfig, PPOSection
from nrl_core.config.validation import optimizer_steps_per_rollout
from nrl_core.data import Batch


def test_the_ppo_section_is_grpos_loop_and_the_checks_read_it_as_grpo():
    config = PPOConfig(policy=PolicyConfig(model_name="/models/m", train_global_batch_size=8))
    assert isinstance(config.ppo, GRPOSection) and config.grpo is config.ppo
    # The critic starts from the policy's checkpoint unless told otherwise.
    assert config.critic.model_name == "/models/m"
    assert type(config.critic).value_head is True
    # 8 prompts x 1 response / 8 per optimizer step, ppo_epochs times.
    ppo = PPOSection(num_prompts_per_step=8, num_generations_per_prompt=1, ppo_epochs=3)
    config = PPOConfig(policy=PolicyConfig(train_global_batch_size=4), ppo=ppo)
    assert optimizer_steps_per_rollout(config) == 3 * 2


def test_the_embedded_recipe_is_a_ppo_config():
    from nrl_core.config.loader import resolve_config
    from nrl_core.plugins import PluginHost

    assert default_recipe("ppo")["ppo"]["critic_warmup_steps"] >= 1
    config = resolve_config("ppo", None, [], PluginHost.discover().registry())
    assert isinstance(config, PPOConfig)
    assert 1 <= config.ppo.num_generations_per_prompt <= 4
    assert config.critic.model_name == config.policy.model_name == "tiny"


def test_the_critic_learns_each_tokens_return_in_the_state_before_it():
    # Two rows; the generated tokens are positions 2.. (loss_mask 1); reward 1 for row 0.
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    batch = Batch(
        {
            "input_ids": torch.arange(12).reshape(2, 6),
            "lengths": torch.tensor([5, 4]),
            "loss_mask": loss_mask,
            "sample_mask": torch.ones(2),
        }
    )
    # What a value backend returns: v[:, j] values the prefix ending at token j.
    prefix = torch.tensor([[9.0, 0.1, 0.2, 0.3, 0.4, 9.0], [9.0, 0.5, 0.6, 0.7, 9.0, 9.0]])
    values = state_values(prefix)
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0]), loss_mask)
    advantages, returns = gae_advantages(rewards, values.double(), loss_mask, gamma=1.0, lam=1.0)
    # lambda = gamma = 1: A_t = R - V_t with V_t the value of the prefix before token t.
    assert advantages[0, 2:5].tolist() == pytest.approx([1 - 0.1, 1 - 0.2, 1 - 0.3])
    assert advantages[1, 2:4].tolist() == pytest.approx([-0.5, -0.6])
    critic = critic_batch(batch, returns, prefix)
    # Position j of the critic learns token j + 1's return (both 1 for row 0, 0 for row 1) ...
    assert critic["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert critic["returns"][0, 1:4].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert critic["returns"][1, 1:3].tolist() == pytest.approx([0.0, 0.0])
    # ... from the value it had at rollout time (the clip range's centre).
    assert critic["old_values"][0, 1:4].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert critic["old_values"][:, 0].tolist() == [0.0, 0.0]
    assert shift_left(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[2.0, 3.0, 0.0]]


def test_plot_draws_the_critics_value_loss_and_explained_variance(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from nrl_core.cli import main

    run = tmp_path / "ppo-a"
    run.mkdir()
    rows = [{"step": 0, "val/accuracy": 0.2}]
    for step in range(1, 7):
        rows.append(
            {
                "step": step,
                "train/reward_mean": 0.1 * step,
                "train/value_loss": 1.0 / step,
                "train/explained_variance": 0.1 * step,
                "timing/critic_s": 0.3,
                "timing/step_s": 1.0,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(run)]) == 0
    written = {p.rsplit("/", 1)[1] for p in capsys.readouterr().out.split()}
    assert {"value_loss.png", "explained_variance.png"} <= written
    for name in ("value_loss.png", "explained_variance.png"):
        assert (run / name).stat().st_size > 1000


def test_a_critic_backend_without_a_value_head_is_refused_naming_those_with_one():
    from nrl_core.algorithms.ppo import check_config
    from nrl_core.config.schema import CriticConfig
    from nrl_core.errors import ConfigError
    from nrl_core.registry import ComponentSpec, Registry

    def policy(name, **metadata):
        return ComponentSpec("policy", name, "m:C", "test", metadata=metadata)

    registry = Registry(
        [policy("plain"), policy("megatron", value_head=True), policy("dtensor", value_head=True)]
    )
    config = PPOConfig(critic=CriticConfig(backend="plain"))
    with pytest.raises(
        ConfigError, match=r"critic\.backend=plain has no per-token value head"
    ) as e:
        check_config(config, registry)
    assert str(e.value).endswith("use critic.backend=dtensor or critic.backend=megatron")
    for able in ("dtensor", "megatron"):  # both pass the check
        check_config(PPOConfig(critic=CriticConfig(backend=able)), registry)
    with pytest.raises(ConfigError, match="install a policy plugin that registers one"):
        check_config(config, Registry([policy("plain")]))
