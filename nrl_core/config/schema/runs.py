"""The whole config of each command (``GRPOConfig`` for ``nrl run grpo``, ...): the sections it
has, :data:`ALGORITHM_CONFIGS`, and :func:`portable_config` (the copy an actor can unpickle)."""

from __future__ import annotations

from typing import Any

import attrs

from nrl_core.config.schema.algorithms import (
    CriticConfig,
    DistillSection,
    DPOSection,
    EvalSection,
    GRPOSection,
    PPOSection,
    RMSection,
    SFTSection,
    TeacherConfig,
)
from nrl_core.config.schema.data import AgentConfig, DataConfig, EnvConfig
from nrl_core.config.schema.fields import ComponentSection, ge, le, option
from nrl_core.config.schema.generation import GenerationConfig, ServerConfig
from nrl_core.config.schema.infrastructure import CheckpointingConfig, ClusterConfig, LoggerConfig
from nrl_core.config.schema.policy import LossConfig, PolicyConfig


@attrs.define
class RunConfig:
    """Sections shared by every algorithm."""

    seed: int = option(
        42,
        "Seed of every random stream in the run (0..2^63-1).",
        validator=[ge(0), le(2**63 - 1)],
    )
    policy: PolicyConfig = option(PolicyConfig(), "The model being trained.")
    data: DataConfig = option(DataConfig(), "Training and validation data.")
    checkpointing: CheckpointingConfig = option(CheckpointingConfig(), "Checkpoints and resume.")
    logger: LoggerConfig = option(LoggerConfig(), "Run directory and metric sinks.")
    cluster: ClusterConfig = option(ClusterConfig(), "Where the workers run.")


@attrs.define
class GRPOConfig(RunConfig):
    grpo: GRPOSection = option(GRPOSection(), "The GRPO loop.")
    generation: GenerationConfig = option(GenerationConfig(), "Rollout generation.")
    loss: LossConfig = option(LossConfig(), "The policy loss.")
    env: EnvConfig = option(EnvConfig(), "The environment that scores rollouts.")
    agent: AgentConfig = option(AgentConfig(), "The agent that drives rollouts (default: env).")
    server: ServerConfig = option(
        ServerConfig(), "The policy endpoint that agents call (started only when one does)."
    )


@attrs.define
class PPOConfig(RunConfig):
    """`nrl run ppo`: GRPO's loop with a learned critic and GAE advantages."""

    ppo: PPOSection = option(PPOSection(), "The PPO loop (GRPO's, with a critic).")
    critic: CriticConfig = option(CriticConfig(), "The critic (value model) and its training.")
    generation: GenerationConfig = option(GenerationConfig(), "Rollout generation.")
    loss: LossConfig = option(LossConfig(), "The policy loss.")
    env: EnvConfig = option(EnvConfig(), "The environment that scores rollouts.")
    agent: AgentConfig = option(AgentConfig(), "The agent that drives rollouts (default: env).")
    server: ServerConfig = option(
        ServerConfig(), "The policy endpoint that agents call (started only when one does)."
    )

    def __attrs_post_init__(self) -> None:
        if not self.critic.model_name:  # the critic starts from the policy's checkpoint
            self.critic = attrs.evolve(
                self.critic,
                model_name=self.policy.model_name,
                tokenizer_name=self.critic.tokenizer_name or self.policy.tokenizer_name,
            )

    @property
    def grpo(self) -> PPOSection:
        """The loop's section under GRPO's name: the checks and the loop written for ``grpo``
        (steps per rollout, warm-up answers, async) read PPO's, which extends it."""
        return self.ppo


@attrs.define
class DistillConfig(RunConfig):
    """`nrl run distill`: on-policy distillation of a teacher into the policy (the student)."""

    distill: DistillSection = option(DistillSection(), "The distillation loop.")
    teacher: TeacherConfig = option(TeacherConfig(), "The frozen teacher.")
    generation: GenerationConfig = option(GenerationConfig(), "The student's rollouts.")
    loss: LossConfig = option(LossConfig(name="distillation"), "The distillation loss.")
    env: EnvConfig = option(
        EnvConfig(),
        "The environment that scores rollouts (rewards and validation accuracy); `none` for "
        "no environment (nothing is scored, nothing is validated).",
    )


@attrs.define
class ServeConfig(RunConfig):
    """`nrl serve`: a model behind the OpenAI-compatible endpoint."""

    generation: GenerationConfig = option(GenerationConfig(), "The generation backend served.")
    server: ServerConfig = option(ServerConfig(), "Where and how the endpoint listens.")


@attrs.define
class SFTConfig(RunConfig):
    sft: SFTSection = option(SFTSection(), "The SFT loop.")
    loss: LossConfig = option(LossConfig(name="nll"), "The loss.")


@attrs.define
class DPOConfig(RunConfig):
    dpo: DPOSection = option(DPOSection(), "The DPO loop.")


@attrs.define
class RMConfig(RunConfig):
    rm: RMSection = option(RMSection(), "The reward-model loop.")


@attrs.define
class EvalConfig(RunConfig):
    """`nrl eval`: a model (or checkpoint) scored on a dataset's validation split."""

    eval: EvalSection = option(EvalSection(), "What is evaluated and how it is scored.")
    generation: GenerationConfig = option(GenerationConfig(), "Generation of the responses.")
    env: EnvConfig = option(EnvConfig(), "The environment that scores the responses.")


def portable_config(config: Any, packages: set[str]) -> Any:
    """A copy of ``config`` keeping only the component options whose classes live in
    ``packages`` (top-level package names, e.g. ``{"nrl_core", "nrl_dtensor"}``).

    Each actor runs in its own plugin's virtualenv, where other plugins' option classes cannot
    be unpickled; the copy sent to an actor therefore holds only what that venv can import.
    """
    if isinstance(config, ComponentSection):
        kept = {
            name: opts
            for name, opts in config.options.items()
            if opts is None or type(opts).__module__.split(".")[0] in packages
        }
        config = attrs.evolve(config, options=kept)
    if not attrs.has(type(config)):
        return config
    changes = {}
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        if attrs.has(type(value)):
            changes[field.name] = portable_config(value, packages)
    return attrs.evolve(config, **changes) if changes else config


ALGORITHM_CONFIGS: dict[str, type[RunConfig]] = {
    "grpo": GRPOConfig,
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "rm": RMConfig,
    "distill": DistillConfig,
    "ppo": PPOConfig,
}
