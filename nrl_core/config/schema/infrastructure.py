"""The ``cluster``, ``checkpointing`` and ``logger`` sections: where a run runs and what it
writes."""

from __future__ import annotations

from typing import ClassVar

import attrs

from nrl_core.config.schema.fields import (
    NON_EMPTY,
    RUN_NAME,
    ComponentSection,
    Valid,
    between,
    ge,
    gt,
    option,
    optional,
)
from nrl_core.registry import ComponentKind


@attrs.define
class ClusterConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "cluster"
    selector: ClassVar[str] = "backend"

    backend: str = option(
        "auto",
        (
            "`auto`, `inprocess`, `local`, `ray` (or a plugin's). `inprocess` runs the policy "
            "rank, generation and environments in this process, without Ray: 1 policy rank, "
            "CPU, generation in the policy, no teacher, agents or async GRPO. `auto` picks it "
            "where it hosts the run, else `local`, which starts Ray here; `ray` joins a "
            "running cluster."
        ),
    )
    address: str | None = option(None, "Ray address for `ray` (default: $RAY_ADDRESS).")
    num_cpus: int | None = option(
        None, "CPUs Ray may use (default: all of this machine).", validator=optional(ge(1))
    )
    gpus_per_node: int | None = option(
        None, "GPUs per node (default: what Ray detects).", validator=optional(ge(0))
    )
    gpu_memory_gib: float | None = option(
        None,
        (
            "Memory of each GPU in GiB (1 to 4096), for the memory plan checked before Ray "
            "starts (docs/runtime.md, Memory plan): needed where the driver sees no GPU (`ray` cluster, a "
            "login node); default: measured with nvidia-smi on a local cluster, and no plan "
            "without either. An 80 GB H100 has 79.6 GiB."
        ),
        validator=optional(between(1, 4096)),
    )
    dashboard: bool = option(False, "Start the Ray dashboard (local cluster only).")
    worker_timeout_s: float = option(
        600.0, "A worker call that takes longer is an error (seconds).", validator=gt(0)
    )


@attrs.define
class CheckpointingConfig:
    enabled: bool = option(True, "Write checkpoints.")
    checkpoint_dir: str | None = option(
        None,
        (
            "Where `step_N/` folders are written; default `<logger.log_dir>/<logger.run_name>/"
            "checkpoints`, so that every run folder has its own."
        ),
    )
    save_period: int = option(10, "Save every N steps (and at the last step).", validator=ge(1))
    resume: str = option(
        "auto",
        (
            "`auto` resumes from the newest complete checkpoint, `never` starts fresh, or a path "
            "to a `step_N` folder."
        ),
        validator=Valid("`auto`, `never` or a path", lambda value: bool(value)),
    )
    keep_last: int | None = option(
        3,
        (
            "Keep only the newest N checkpoints (None keeps all), and besides them the best by "
            "`metric_name`."
        ),
        validator=optional(ge(1)),
    )
    metric_name: str | None = option(
        "val/accuracy",
        (
            "The validation metric that ranks checkpoints (recorded in each checkpoint saved "
            "at a validation step): the best one is kept besides the newest `keep_last`, the "
            "summary names it, and `nrl eval` of a checkpoint folder evaluates it. A `val/` "
            "metric of the run (e.g. `val/reward_mean`); None: rank by age only (newest)."
        ),
        validator=optional(
            Valid("a `val/...` metric name", lambda value: str(value).startswith("val/"))
        ),
    )
    higher_is_better: bool = option(True, "Whether a higher `metric_name` is better.")


@attrs.define
class LoggerConfig:
    """Where a run's metrics and sample rollouts go (``logger``): the run folder's
    ``metrics.jsonl`` and ``samples.jsonl``, the console, and TensorBoard / W&B / MLflow."""

    log_dir: str = option("results/runs", "Parent folder of run directories.", validator=NON_EMPTY)
    run_name: str = option(
        "default",
        (
            "Run directory name under log_dir (one folder name of at most 255 bytes: no `/`, `..` or control "
            "characters); also the W&B and MLflow run name."
        ),
        validator=RUN_NAME,
    )
    sample_period: int = option(
        10,
        (
            "Log `num_samples` training rollouts (prompt, completion, reference answer, reward, "
            "advantage) to `samples.jsonl`, the console and the enabled sinks at step 1, every "
            "N steps and at the last step, and the first `num_samples` of each validation pass "
            "(0 never)."
        ),
        validator=ge(0),
    )
    num_samples: int = option(
        4, "Rollouts logged per sampled step and per validation pass.", validator=ge(1)
    )
    print_samples: bool = option(
        True, "Print the training samples as a table on the console (not with `--quiet`)."
    )
    tensorboard: bool = option(
        False,
        (
            "Write TensorBoard events to `<run dir>/tensorboard` (extra `tensorboard`): "
            "scalars, the config as hyperparameters, sample tables as text."
        ),
    )
    wandb: bool = option(
        False,
        (
            "Log to Weights & Biases (extra `wandb`): the config, metrics and sample tables; "
            "a resumed run continues the same W&B run. `WANDB_MODE=offline` works offline."
        ),
    )
    wandb_project: str | None = option(
        None, "W&B project (default: $WANDB_PROJECT, else `nrl`).", validator=optional(NON_EMPTY)
    )
    wandb_entity: str | None = option(
        None,
        "W&B entity, a team or user (default: $WANDB_ENTITY, else your default entity).",
        validator=optional(NON_EMPTY),
    )
    mlflow: bool = option(
        False,
        (
            "Log to MLflow (extra `mlflow`): the config as params and a `config.yaml` "
            "artifact, metrics, sample tables as JSON artifacts; a resumed run continues the "
            "same MLflow run."
        ),
    )
    mlflow_experiment: str | None = option(
        None,
        "MLflow experiment, created when missing (default: $MLFLOW_EXPERIMENT_NAME, else `nrl`).",
        validator=optional(NON_EMPTY),
    )
    mlflow_tracking_uri: str | None = option(
        None,
        (
            "MLflow tracking URI, e.g. `http://host:5000` or `sqlite:///mlflow.db` (default: "
            "$MLFLOW_TRACKING_URI, else MLflow's default)."
        ),
        validator=optional(NON_EMPTY),
    )
