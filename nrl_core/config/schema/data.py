"""The ``data`` section (datasets and ``data.tasks``), and the ``env`` and ``agent`` sections that
score and drive the rollouts."""

from __future__ import annotations

from typing import ClassVar

import attrs

from nrl_core.config.schema.fields import (
    NON_EMPTY,
    ComponentSection,
    between,
    ge,
    gt,
    option,
    optional,
)
from nrl_core.registry import ComponentKind

NO_ENVIRONMENT = "none"
"""``env.name`` of a run without an environment (``nrl run distill``): nothing is scored."""


@attrs.define
class EnvConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "environment"
    selector: ClassVar[str] = "name"

    name: str = option("arithmetic", "Registered environment.")
    num_workers: int = option(
        1, "Environment actors (each gets a share of every batch).", validator=ge(1)
    )
    step_timeout_s: float = option(
        120.0,
        (
            "Longest one environment step (one actor scoring its share of a batch) may take, in "
            "seconds (> 0); a slower step is an error naming this key. Shorter than "
            "cluster.worker_timeout_s so that a hung environment is found quickly."
        ),
        validator=gt(0),
    )
    warn_failed_fraction: float = option(
        0.5,
        (
            "A console warning when at least this share of a training step's samples failed in "
            "their environment (its step raised, or it reported a timeout, error or crash), in "
            "(0, 1]. The shares are logged every step as train/env_*_frac."
        ),
        validator=between(0, 1, low_open=True),
    )
    stop_failed_fraction: float | None = option(
        None,
        (
            "Stop the run (one line naming the environment and what failed) when at least this "
            "share of a training step's samples failed in their environment, in (0, 1]; null: "
            "never stop for it (the failed samples get reward 0)."
        ),
        validator=optional(between(0, 1, low_open=True)),
    )


@attrs.define
class AgentConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "agent"
    selector: ClassVar[str] = "name"

    name: str = option(
        "env",
        (
            "Registered agent that drives the rollouts of tasks that name none; `env` is the "
            "core's own generate / env.step loop (no HTTP)."
        ),
        validator=NON_EMPTY,
    )
    num_workers: int = option(
        1, "Agent actors (each gets a share of every batch).", validator=ge(1)
    )
    run_timeout_s: float = option(
        900.0,
        (
            "Longest one agent actor may take over its share of a batch, in seconds (> 0); a "
            "slower batch is an error naming this key."
        ),
        validator=gt(0),
    )


@attrs.define
class TaskConfig:
    """One task of a multi-task run (an entry of ``data.tasks``)."""

    name: str = option(
        "task",
        "Task name: routes the task's samples and names its metrics (`train/<name>/...`).",
        validator=NON_EMPTY,
    )
    dataset: str = option(
        "arithmetic",
        (
            "Registered dataset name, a path to a JSONL file, or `<dataset>:<file>` (that "
            "registered dataset reading that file, e.g. `nemo_gym_jsonl:rows.jsonl`)."
        ),
        validator=NON_EMPTY,
    )
    weight: float = option(
        1.0,
        "Share of every step's prompts, relative to the other tasks' weights (> 0).",
        validator=gt(0),
    )
    env: str | None = option(None, "Registered environment scoring this task (default: env.name).")
    agent: str | None = option(
        None,
        "Registered agent driving this task's rollouts (default: agent.name; `env` is the "
        "core's own loop, scored by `env`).",
    )
    val_dataset: str | None = option(
        None, "Validation JSONL file of this task (default: the dataset's own or a held-out share)."
    )
    agent_configs: list[str] = option(
        [],
        (
            "Config files of this task's agent, for an agent that reads them (`nemo_gym`: this "
            "task's own Gym config files, served beside `agent.nemo_gym.config_paths`; the "
            "task's rows must name an agent they declare). Not for `agent: env`."
        ),
    )


@attrs.define
class DataConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "dataset"
    selector: ClassVar[str] = "dataset"

    dataset: str = option(
        "arithmetic",
        (
            "Registered dataset name, a path to a JSONL file, or `<dataset>:<file>` (that "
            "registered dataset reading that file, e.g. `nemo_gym_jsonl:rows.jsonl`)."
        ),
        validator=NON_EMPTY,
    )
    val_dataset: str | None = option(None, "Validation JSONL file (default: split off a fraction).")
    val_fraction: float = option(
        0.1,
        "Fraction held out for validation when no val_dataset (0: none).",
        validator=between(0, 1, high_open=True),
    )
    max_val_samples: int = option(
        64, "Validation samples evaluated per validation step.", validator=ge(1)
    )
    system_prompt: str | None = option(None, "System prompt prepended to every conversation.")
    apply_chat_template: bool = option(True, "Format prompts with the tokenizer's chat template.")
    shuffle: bool = option(True, "Shuffle the training data each epoch (seeded).")
    tasks: list[TaskConfig] = option(
        [],
        (
            "Several datasets trained together, each with its environment or agent and a "
            "sampling weight; when given, it replaces `dataset` and `val_dataset` (options of "
            "each dataset, environment and agent still come from `data.<dataset>`, "
            "`env.<env>`, `agent.<agent>`)."
        ),
    )
