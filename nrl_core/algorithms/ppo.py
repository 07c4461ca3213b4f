"""PPO with a learned critic: ``nrl run ppo``.

GRPO's loop (:class:`~nrl_core.algorithms.grpo.GRPOTrainer`: rollouts, validation, warm-up,
checkpoints) with a critic and generalized advantage estimation in place of group baselines.
One step: roll out, score; the critic (a second worker group of a policy backend, with a
per-token value head: the ``critic`` section) values every position of the rollouts; token
rewards are the outcome reward on each response's last token minus ``ppo.reward_kl_coef`` x the
per-token KL to the reference; GAE (``ppo.gamma``, ``ppo.lam``) gives advantages and returns
over the WHOLE step's batch, the advantages are whitened over its valid tokens; then the critic
takes ``ppo.ppo_epochs`` passes of the clipped value loss towards the returns
(:class:`~nrl_core.losses.value.ClippedValueLoss`) and the policy ``ppo.ppo_epochs`` passes of
its loss (none during the first ``ppo.critic_warmup_steps`` steps). Both models train through
the core's step (:meth:`nrl_core.policy.Policy.train`): sharding, micro batches, loss
normalisation and metric reduction are the policy's.

Alignment: a value backend returns ``v[:, j]``, the value of the prefix ending at token ``j``
(:func:`nrl_core.reward_model.token_values`). The state in which token ``t`` is generated is the
prefix ending at ``t - 1``, so ``V_t = v[:, t - 1]`` (:func:`state_values`), and the critic is
trained on targets shifted one position left (:func:`critic_batch`).
"""

from __future__ import annotations

import time

import torch

from nrl_core.algorithms.advantages import gae_advantages, outcome_token_rewards, whiten
from nrl_core.algorithms.grpo import GRPOTrainer, StepData
from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.schema import PPOConfig
from nrl_core.data import Batch
from nrl_core.errors import ConfigError
from nrl_core.losses.config import AGGREGATIONS, ValueLossConfig
from nrl_core.losses.value import ClippedValueLoss, explained_variance
from nrl_core.registry import Registry
from nrl_core.training import combine_optimizer_steps, declared_reductions

__all__ = ["PPOTrainer", "check_config", "critic_batch", "run", "state_values"]


def check_config(config: PPOConfig, registry: Registry) -> None:
    """What only PPO needs, before anything starts (one line, exit 2): a critic backend with a
    value head, a critic head that is not forced to the LM one, a policy head that is."""
    critic = config.critic
    backend = registry.get("policy", critic.backend, key="critic.backend")
    if not backend.metadata.get("value_head"):
        # The backends that can be a critic, as installed (dtensor, megatron, ...).
        able = [
            name
            for name in registry.names("policy")
            if registry.get("policy", name).metadata.get("value_head")
        ]
        fix = " or ".join(f"critic.backend={name}" for name in able) or (
            "install a policy plugin that registers one (nrl-dtensor or nrl-megatron)"
        )
        raise ConfigError(
            f"critic.backend={critic.backend} has no per-token value head (it registers no "
            f"`value_head` support); use {fix}"
        )
    head = getattr(critic.options_for(), "head", "auto")
    if head == "lm":
        raise ConfigError(
            f"critic.{critic.backend}.head=lm: the critic needs a value head; set "
            f"critic.{critic.backend}.head=auto (or scalar)"
        )
    policy_head = getattr(config.policy.options_for(), "head", "auto")
    if policy_head == "scalar":
        raise ConfigError(
            f"policy.{config.policy.backend}.head=scalar: the PPO policy generates, so it needs "
            f"its LM head; set policy.{config.policy.backend}.head=auto (or lm)"
        )


def shift_left(values: torch.Tensor) -> torch.Tensor:
    """``out[:, j] = values[:, j + 1]`` (the last column 0)."""
    return torch.nn.functional.pad(values[:, 1:], (0, 1))


def state_values(prefix_values: torch.Tensor) -> torch.Tensor:
    """``V[:, t] = prefix_values[:, t - 1]`` (``V[:, 0] = 0``): the value of the state in which
    token ``t`` is generated, aligned with the logprobs and ``loss_mask`` of token ``t``."""
    return torch.nn.functional.pad(prefix_values[:, :-1], (1, 0))


def critic_batch(batch: Batch, returns: torch.Tensor, prefix_values: torch.Tensor) -> Batch:
    """The critic's training batch: ``batch``'s tokens, with the regression targets moved to
    the position whose value predicts them (the value of the prefix ending at ``t - 1`` learns
    the return of token ``t``): ``loss_mask`` and ``returns`` shifted one position left,
    ``old_values`` the critic's rollout-time prefix values."""
    tensors = {
        "input_ids": batch["input_ids"],
        "lengths": batch["lengths"],
        "loss_mask": shift_left(batch["loss_mask"]),
        "returns": shift_left(returns.float()),
        "old_values": prefix_values.float() * shift_left(batch["loss_mask"]),
    }
    if "sample_mask" in batch:
        tensors["sample_mask"] = batch["sample_mask"]
    return Batch(tensors, batch.metadata)


def _valid_mean_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    picked = values[mask != 0].to(torch.float64)
    if picked.numel() == 0:
        return float("nan"), float("nan")
    return float(picked.mean()), float(picked.std(unbiased=False))


class PPOTrainer(GRPOTrainer):
    """The PPO loop: GRPO's, with the critic's GAE advantages and the critic's training."""

    algorithm = "ppo"

    progress_fields = (
        ("train/reward_mean", "reward"),
        ("val/accuracy", "val acc"),
        ("train/value_loss", "value loss"),
        ("train/explained_variance", "expl var"),
        ("timing/step_s", "s/step"),
    )

    def __init__(self, session: RunSession) -> None:
        super().__init__(session)
        self.ppo = self.config.ppo
        # Aggregated like the policy loss (its resolved options), where it names one of the
        # value loss's aggregations.
        aggregation = getattr(getattr(session.loss_fn, "options", None), "aggregation", None)
        if aggregation not in AGGREGATIONS:
            aggregation = "token_mean"
        self.value_loss = ClippedValueLoss(
            ValueLossConfig(clip_eps=self.ppo.value_clip, aggregation=aggregation)
        )

    @property
    def token_level_estimator(self) -> bool:
        """GAE advantages are per token, computed on the whole step's batch."""
        return True

    def token_advantages(
        self, batch: Batch, data: StepData, old: torch.Tensor | None
    ) -> dict[str, float]:
        """Value the rollouts with the critic, set ``batch["advantages"]`` to the (whitened) GAE
        advantages of the WHOLE step's batch, and train the critic towards the returns; return
        the critic's and the estimator's metrics."""
        s, ppo = self.session, self.ppo
        mask = batch["loss_mask"] * batch["sample_mask"][:, None]
        valid = mask != 0
        kl, metrics = self.reward_kl(batch, old, mask)
        start = time.perf_counter()
        prefix_values = s.critic.get_logprobs(batch).float()
        values = state_values(prefix_values)
        token_rewards = outcome_token_rewards(data.rewards, mask, kl=kl, kl_coef=ppo.reward_kl_coef)
        advantages, returns = gae_advantages(
            token_rewards, values.to(torch.float64), mask, gamma=ppo.gamma, lam=ppo.lam
        )
        metrics["advantages_mean"], metrics["advantages_std"] = _valid_mean_std(advantages, mask)
        metrics["explained_variance"] = explained_variance(values, returns, mask)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, mask)
        batch["advantages"] = torch.where(valid, advantages, 0.0).float()

        critic = critic_batch(batch, returns, prefix_values)
        per_epoch = [s.critic.train(critic, self.value_loss) for _ in range(ppo.ppo_epochs)]
        trained = combine_optimizer_steps(per_epoch, declared_reductions(self.value_loss))
        for key in ("value_loss", "value_clip_frac", "values_mean", "returns_mean"):
            metrics[key] = trained[key]
        metrics["critic_grad_norm"] = trained["grad_norm"]
        metrics["critic_lr"] = trained["lr"]
        metrics["critic_s"] = time.perf_counter() - start
        return metrics

    def close_step(self, step, data, metrics, *, step_start, timings):
        """GRPO's, with the critic's time (valuing and training) as ``timing/critic_s``."""
        if "train/critic_s" in metrics:
            timings = {**timings, "critic_s": metrics.pop("train/critic_s")}
        return super().close_step(step, data, metrics, step_start=step_start, timings=timings)

    def train_policy(self, step: int, batch: Batch) -> dict[str, float]:
        """``ppo.ppo_epochs`` passes of the policy's optimizer steps over the batch; nothing
        during the critic's warm-up (``ppo.critic_warmup_steps``: the policy keeps its weights)."""
        s = self.session
        if step <= self.ppo.critic_warmup_steps:
            return {"critic_warmup": 1.0}
        per_epoch = [s.policy.train(batch, s.loss_fn) for _ in range(self.ppo.ppo_epochs)]
        return combine_optimizer_steps(per_epoch, declared_reductions(s.loss_fn))


def run(
    config: PPOConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run ppo``."""
    check_config(config, registry)
    return PPOTrainer.run(config, registry, verbose=verbose, quiet=quiet)
