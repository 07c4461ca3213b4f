"""The run configuration: attrs classes, one per section, each field documented.

Component sections (``policy``, ``generation``, ``env``, ``loss``, ``cluster``, ``data``) also
hold the options of registered components under the component's name: ``policy.dtensor``,
``generation.vllm``, ``env.math``. Those sub-sections are structured with the config class the
component registered, and land in the section's ``options`` dict (see
:meth:`ComponentSection.options_for`).

Field documentation lives in ``metadata["doc"]`` so that the configuration reference can be
generated from these classes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import attrs

from nrl_core.registry import ComponentKind


def option(default: Any, doc: str, **kwargs: Any) -> Any:
    """An attrs field with a default and its documentation.

    Pass ``validator=`` (one of the validators below, or attrs' own) to give the field its
    valid range: it runs whenever the class is built (from YAML, or with ``attrs.evolve`` in
    code), and the configuration reference shows it (see :func:`describe_validator`).
    """
    if isinstance(default, (list, dict)):
        value = default
        return attrs.field(factory=lambda: type(value)(value), metadata={"doc": doc}, **kwargs)
    if attrs.has(type(default)):
        return attrs.field(factory=lambda: attrs.evolve(default), metadata={"doc": doc}, **kwargs)
    return attrs.field(default=default, metadata={"doc": doc}, **kwargs)


# -- valid ranges ------------------------------------------------------------------------------


class FieldValueError(ValueError):
    """A config field holds a value outside its valid range.

    Carries the field's name apart from the problem, so that the config loader can name the
    full dotted key (``policy.optimizer.lr must be > 0, got -1``).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        """The attribute's name (the last part of the dotted key)."""
        self.problem = problem
        """What is wrong, e.g. ``must be > 0, got -1``."""


def show_value(value: Any) -> str:
    """A value as a user wrote it: ``-1`` rather than ``-1.0``, strings quoted."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return format(value, "g")
    return repr(value)


@attrs.frozen
class Valid:
    """An attrs validator whose valid values are described in words (``> 0``, ``in [0, 1)``).

    The words are the error message (``must be <text>, got <value>``) and the "valid" column
    of the generated configuration reference. ``None`` passes when ``allow_none`` is set (for
    ``int | None`` fields whose ``None`` means "unset").
    """

    text: str
    """The valid values, completing "must be ..."."""
    test: Callable[[Any], bool] = attrs.field(eq=False, repr=False)
    allow_none: bool = False

    def __call__(self, _instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and self.allow_none:
            return
        try:
            ok = bool(self.test(value))
        except TypeError:  # e.g. a number compared with a string, in code that skipped YAML
            ok = False
        if not ok:
            raise FieldValueError(
                attribute.name, f"must be {self.describe()}, got {show_value(value)}"
            )

    def describe(self) -> str:
        """The valid values, as the configuration reference shows them."""
        return f"{self.text} or null" if self.allow_none else self.text


_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _finite(value: Any) -> bool:
    """NaN and infinities (``.inf``, ``1e400`` in YAML) lie in no range a setting has."""
    return not isinstance(value, float) or math.isfinite(value)


def _compare(op: str, bound: float) -> Valid:
    compare = _COMPARE[op]
    return Valid(
        f"{op} {show_value(bound)}",
        lambda value: _finite(value) and compare(value, bound),
    )


def gt(bound: float) -> Valid:
    """Valid when ``value > bound``."""
    return _compare(">", bound)


def ge(bound: float) -> Valid:
    """Valid when ``value >= bound``."""
    return _compare(">=", bound)


def le(bound: float) -> Valid:
    """Valid when ``value <= bound``."""
    return _compare("<=", bound)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Valid:
    """Valid when ``value`` lies in the interval from ``low`` to ``high`` (closed unless the
    ``*_open`` flags say otherwise), written ``in [0, 1)``."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def test(value: Any) -> bool:
        if not _finite(value):
            return False
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return above and below

    return Valid(f"in {left}{show_value(low)}, {show_value(high)}{right}", test)


def optional(valid: Valid) -> Valid:
    """``valid``, or ``None`` (unset)."""
    return attrs.evolve(valid, allow_none=True)


def each(valid: Valid, text: str | None = None) -> Valid:
    """Valid for a list whose every item passes ``valid`` (``text``: the words for that,
    default ``a list of items <valid's words>``)."""
    item = valid.test
    return Valid(
        text or f"a list of items {valid.text}",
        lambda items: isinstance(items, list) and all(item(i) for i in items),
    )


FINITE = Valid("a finite number", math.isfinite)
"""Any number but infinity and NaN (a field whose every value is meaningful)."""

NON_EMPTY = Valid("a non-empty string", lambda value: isinstance(value, str) and value != "")
"""A string that must not be empty (names, paths)."""

RUN_NAME = Valid(
    "a non-empty string naming one folder (no `/`, `\\`, `.` or `..` alone, no control characters)",
    lambda value: (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\")
        and value.isprintable()
    ),
)
"""One folder name inside ``logger.log_dir``: it can never point outside it."""


def one_of(*choices: Any) -> Any:
    """An enumeration: ``attrs.validators.in_`` (the loader and the reference read its
    options)."""
    return attrs.validators.in_(choices)


def describe_validator(validator: Any) -> str | None:
    """The valid values ``validator`` accepts, in words, or ``None`` when it cannot say.

    Understands :class:`Valid` and attrs' ``in_``, ``ge``/``gt``/``le``/``lt``, ``and_``,
    ``optional`` and ``deep_iterable``, and any callable with a ``describe()`` method.
    """
    if validator is None:
        return None
    describe = getattr(validator, "describe", None)
    if callable(describe):
        return describe()
    inner = getattr(validator, "_validators", None)  # attrs.validators.and_ (or a list)
    if inner is not None:
        parts = [describe_validator(v) for v in inner]
        return " and ".join(p for p in parts if p) or None
    if hasattr(validator, "options") and type(validator).__name__ == "_InValidator":
        options = getattr(validator, "_original_options", validator.options)
        return "one of " + ", ".join(f"`{o}`" for o in options)
    if hasattr(validator, "compare_op") and hasattr(validator, "bound"):
        return f"{validator.compare_op} {show_value(validator.bound)}"
    if type(validator).__name__ == "_OptionalValidator":
        text = describe_validator(validator.validator)
        return f"{text} or null" if text else None
    member = getattr(validator, "member_validator", None)  # attrs.validators.deep_iterable
    if member is not None:
        text = describe_validator(member)
        return f"a list of items {text}" if text else None
    return None


OPTIMIZERS = ("adamw", "sgd")
"""``policy.optimizer.name`` values."""
PRECISIONS = ("float32", "bfloat16")
"""``policy.precision`` values (``nrl_core.policy_setup.PRECISIONS`` maps them to dtypes)."""


@attrs.define
class ComponentSection:
    """Base of sections that select a registered component by name."""

    component_kind: ClassVar[ComponentKind]
    selector: ClassVar[str]
    """The field holding the selected component's name."""

    options: dict[str, Any] = attrs.field(
        factory=dict,
        metadata={
            "doc": (
                "Options of registered components, keyed by component name (filled from sub-sections "
                "such as `policy.dtensor`); structured with each component's config class."
            )
        },
    )
    actor_env: str | None = option(
        None,
        (
            "Where this component's actors run: unset for the plugin's own virtualenv, `system` "
            "for the driver's interpreter, or a path to a Python interpreter."
        ),
    )

    @property
    def selected(self) -> str:
        return getattr(self, self.selector)

    def options_for(self, name: str | None = None) -> Any:
        """The options object of component ``name`` (default: the selected one), or ``None``."""
        return self.options.get(name or self.selected)

    def options_or_defaults(self, name: str, spec: Any) -> Any:
        """Component ``name``'s options, or its config class's defaults when this section has
        none for it (a component named elsewhere, e.g. by ``data.tasks``); ``spec`` is its
        :class:`~nrl_core.registry.ComponentSpec`. ``None`` when it registers no config."""
        options = self.options_for(name)
        if options is None and spec.config is not None:
            options = spec.load_config_class()()
        return options


@attrs.define
class OptimizerConfig:
    name: str = option(
        "adamw", "Optimizer: `adamw` (torch.optim.AdamW) or `sgd`.", validator=one_of(*OPTIMIZERS)
    )
    lr: float = option(1e-5, "Peak learning rate.", validator=gt(0))
    weight_decay: float = option(0.0, "Decoupled weight decay.", validator=ge(0))
    betas: list[float] = option(
        [0.9, 0.999],
        "Adam betas.",
        validator=Valid(
            "two numbers in [0, 1)",
            lambda b: isinstance(b, list) and len(b) == 2 and all(0 <= x < 1 for x in b),
        ),
    )
    eps: float = option(1e-8, "Adam epsilon.", validator=gt(0))
    warmup_steps: int = option(
        0, "Linear warm-up steps from 0 to `lr`; constant afterwards.", validator=ge(0)
    )


@attrs.define
class PolicyConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "policy"
    selector: ClassVar[str] = "backend"

    backend: str = option("dtensor", "Registered policy backend (`dtensor`, `megatron`).")
    model_name: str = option(
        "tiny",
        "Hugging Face model name or local folder; `tiny` builds the bundled tiny model.",
        validator=NON_EMPTY,
    )
    tokenizer_name: str | None = option(None, "Tokenizer name or folder (default: model_name).")
    precision: str = option(
        "float32",
        "Parameter/compute precision: `float32` or `bfloat16`.",
        validator=one_of(*PRECISIONS),
    )
    num_workers: int = option(
        1, "Number of policy ranks (Ray actors), one per GPU on GPU.", validator=ge(1)
    )
    train_global_batch_size: int = option(
        32, "Samples per optimizer step, over all ranks.", validator=ge(1)
    )
    train_micro_batch_size: int = option(
        4,
        "Samples per forward/backward on one rank (at most train_global_batch_size).",
        validator=ge(1),
    )
    micro_batch_token_budget: int | None = option(
        None,
        (
            "If set (>= 1), pack training micro batches up to this many unpadded tokens "
            "(longest first) instead of train_micro_batch_size samples."
        ),
        validator=optional(ge(1)),
    )
    sequence_packing: Literal["auto", True, False] = option(
        "auto",
        (
            "Pack each micro batch's samples into one padding-free row (restarted position "
            "ids, per-sample boundaries) for training and logprob passes: `auto` packs where "
            "the policy backend supports it (dtensor, megatron), `true` requires it, `false` "
            "computes on "
            "padded micro batches. Packed bins hold micro_batch_token_budget tokens, else "
            "train_micro_batch_size (logprob_batch_size) x max_total_sequence_length. See "
            "docs/configuration.md, sequence packing, for when to turn it off."
        ),
        validator=Valid("`auto`, `true` or `false`", lambda v: v == "auto" or isinstance(v, bool)),
    )
    logprob_batch_size: int = option(
        8, "Samples per forward when computing logprobs.", validator=ge(1)
    )
    max_total_sequence_length: int = option(
        512,
        "Longest prompt + response, in tokens (1 to 16,777,216: far beyond any model's context).",
        validator=between(1, 2**24),
    )
    max_grad_norm: float = option(
        1.0, "Gradient clipping norm (0 disables clipping).", validator=ge(0)
    )
    optimizer: OptimizerConfig = option(OptimizerConfig(), "Optimizer and LR schedule.")


@attrs.define
class GenerationConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "generation"
    selector: ClassVar[str] = "backend"

    backend: str = option("torch", "Registered generation backend (`torch`, `vllm`, `sglang`).")
    max_new_tokens: int = option(
        128,
        "Most tokens generated per turn (less than policy.max_total_sequence_length).",
        validator=ge(1),
    )
    temperature: float = option(1.0, "Sampling temperature; 0 is greedy.", validator=ge(0))
    top_p: float = option(
        1.0, "Nucleus sampling threshold (1 disables).", validator=between(0, 1, low_open=True)
    )
    top_k: int = option(0, "Top-k sampling (0 disables).", validator=ge(0))
    stop_strings: list[str] = option(
        [],
        "Strings that end a turn (matched on decoded text).",
        validator=each(NON_EMPTY, "a list of non-empty strings"),
    )
    stop_token_ids: list[int] = option(
        [], "Token ids that end a turn (EOS is always one).", validator=each(ge(0))
    )


@attrs.define
class LossConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "loss"
    selector: ClassVar[str] = "name"

    name: str = option("clipped_pg", "Registered loss function.")


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
class ServerConfig:
    """The OpenAI-compatible policy endpoint (`nrl serve`, and agent-driven runs)."""

    host: str = option(
        "127.0.0.1",
        "Address to bind; loopback by default (use 0.0.0.0 to expose it, with api_key).",
        validator=NON_EMPTY,
    )
    port: int = option(
        0, "Port to bind (0: a free port, printed at start).", validator=between(0, 65535)
    )
    api_key: str | None = option(
        None, "Bearer token every request must carry (Authorization: Bearer ...); null: none."
    )
    batch_window_ms: float = option(
        20.0,
        (
            "How long the server collects concurrent requests before one backend call serves "
            "them all, in milliseconds (>= 0)."
        ),
        validator=ge(0),
    )
    max_batch_size: int = option(256, "Most requests served by one backend call.", validator=ge(1))
    max_request_bytes: int = option(
        16 << 20,
        (
            "Largest request body accepted, in bytes (>= 1024; a larger one is answered 413). "
            "The default, 16 MiB, holds a long multi-turn history with its carried token ids."
        ),
        validator=ge(1024),
    )
    read_timeout_s: float = option(
        30.0,
        (
            "Seconds a client has to send a request's headers, and again its body (> 0): a "
            "slower connection is closed (headers) or answered 408 (body)."
        ),
        validator=gt(0),
    )
    model_id: str | None = option(
        None, "The model id that /v1/models lists (default: policy.model_name)."
    )
    tool_parser: str = option(
        "auto",
        (
            "How tool calls are parsed out of generated text: `auto` (by model family), "
            "`hermes` (<tool_call>JSON</tool_call>), or `none`."
        ),
        validator=one_of("auto", "hermes", "none"),
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
        "arithmetic", "Registered dataset name, or a path to a JSONL file.", validator=NON_EMPTY
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


@attrs.define
class DataConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "dataset"
    selector: ClassVar[str] = "dataset"

    dataset: str = option(
        "arithmetic", "Registered dataset name, or a path to a JSONL file.", validator=NON_EMPTY
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


@attrs.define
class ClusterConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "cluster"
    selector: ClassVar[str] = "backend"

    backend: str = option("local", "`local` starts Ray here; `ray` joins a running cluster.")
    address: str | None = option(None, "Ray address for `ray` (default: $RAY_ADDRESS).")
    num_cpus: int | None = option(
        None, "CPUs Ray may use (default: all of this machine).", validator=optional(ge(1))
    )
    gpus_per_node: int | None = option(
        None, "GPUs per node (default: what Ray detects).", validator=optional(ge(0))
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
        3, "Keep only the newest N checkpoints (None keeps all).", validator=optional(ge(1))
    )


@attrs.define
class LoggerConfig:
    """Where a run's metrics and sample rollouts go (``logger``): the run folder's
    ``metrics.jsonl`` and ``samples.jsonl``, the console, and TensorBoard / W&B / MLflow."""

    log_dir: str = option("results/runs", "Parent folder of run directories.", validator=NON_EMPTY)
    run_name: str = option(
        "default",
        (
            "Run directory name under log_dir (one folder name: no `/`, `..` or control "
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


@attrs.define
class AsyncSection:
    """Asynchronous GRPO (``grpo.async``): separate engines generate the next steps' rollouts
    while the trainer trains (see docs/async-grpo.md)."""

    enabled: bool = option(
        False,
        "Generate rollouts on a background producer while training. Needs separate generation "
        "engines (`generation.colocated=false`, or vLLM/SGLang engines that are not colocated).",
    )
    max_trajectory_age_steps: int = option(
        1,
        "How many optimizer steps older than the trainer the weights that generated a trained "
        "trajectory may be (>= 0). The producer generates the batch of step k only once the "
        "engines hold weights of step k - this or newer; a batch found older when it is "
        "trained is dropped and counted (`async/dropped_stale`). 0 is the synchronous loop.",
        validator=ge(0),
    )
    max_buffer_size: int = option(
        2,
        "Most finished batches (one step's rollouts each) waiting for the trainer (>= 1); the "
        "producer pauses when the buffer is full.",
        validator=ge(1),
    )


@attrs.define
class GRPOSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    num_prompts_per_step: int = option(
        8, "Prompts drawn per step (1 to 1,048,576).", validator=between(1, 2**20)
    )
    num_generations_per_prompt: int = option(
        8,
        (
            "Responses per prompt (the group size); at least 2, since a sample's advantage is "
            "its reward against the rest of its group (a group of one learns nothing)."
        ),
        validator=ge(2),
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    val_period: int = option(
        10, "Validate every N steps (0 disables); step 0 is validated too.", validator=ge(0)
    )
    normalize_rewards: bool = option(True, "Divide advantages by the group's std.")
    use_leave_one_out_baseline: bool = option(True, "Baseline = mean of the other samples.")
    dynamic_sampling: bool = option(False, "DAPO: drop zero-variance groups and sample more.")
    dynamic_sampling_max_batches: int = option(
        4, "Most extra generation rounds per step.", validator=ge(0)
    )
    overlong_filtering: bool = option(False, "Mask out samples truncated by max_new_tokens.")
    on_nonfinite: str = option(
        "stop",
        (
            "A step whose rewards or advantages are NaN or infinite: `stop` the run in one line "
            "naming the environment and the first bad sample, or `skip` the step (nothing is "
            "trained on it; `train/skipped_nonfinite` is 1). A non-finite loss or gradient "
            "always stops the run, before anything is saved."
        ),
        validator=one_of("stop", "skip"),
    )
    sft_warmup_steps: int = option(
        0,
        (
            "Supervised optimizer steps on the training prompts before GRPO (0 disables): a short "
            "warm start that teaches the answer format. Step 0's validation runs after it, so the "
            "metrics show where GRPO starts from."
        ),
        validator=ge(0),
    )
    sft_warmup_shuffle_answers: bool = option(
        False,
        (
            "Pair each warm-up prompt with the answer of another, random prompt: the model learns "
            "what an answer looks like and where it ends, but not which one is right."
        ),
    )
    sft_warmup_template: str = option(
        "{answer}",
        ("Response text of the warm-up examples; `{answer}` is the (possibly shuffled) answer."),
    )
    async_: AsyncSection = attrs.field(
        factory=AsyncSection,
        metadata={
            "doc": "Asynchronous GRPO: overlap rollout generation with training.",
            "key": "async",  # a Python keyword: the attribute is `async_`, the key `async`
        },
    )


@attrs.define
class TeacherConfig(PolicyConfig):
    """The frozen teacher of ``nrl run distill``: a second policy worker group that only scores
    the student's rollouts (top-k logprobs per position). It must share the student's
    tokenizer. Its batch-size and optimizer fields matter only for
    ``distill.teacher_warmup_steps``."""

    num_workers: int = option(
        1, "Number of teacher ranks (Ray actors), one per GPU on GPU.", validator=ge(1)
    )


@attrs.define
class DistillSection:
    """On-policy distillation (``nrl run distill``): the student generates, the teacher scores
    the student's own tokens, the student minimises the per-token divergence (the
    ``distillation`` loss)."""

    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    num_prompts_per_step: int = option(16, "Prompts drawn per step.", validator=ge(1))
    num_generations_per_prompt: int = option(
        1, "Student responses per prompt (>= 1; no group baseline is needed).", validator=ge(1)
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    val_period: int = option(
        10,
        "Validate every N steps (0 disables; needs an environment); step 0 is validated too.",
        validator=ge(0),
    )
    topk: int = option(
        64,
        (
            "Teacher logprobs kept per position (>= 1): the k most likely tokens, plus the "
            "rest of the mass as one bucket. At or above the vocabulary size the full "
            "distribution is kept and the divergence is exact; below it only k numbers per "
            "position cross Ray."
        ),
        validator=ge(1),
    )
    teacher_warmup_steps: int = option(
        0,
        (
            "Supervised optimizer steps that first train the teacher on the training prompts' "
            "answers (>= 0; 0 for a teacher that is already trained). The CPU demo trains its "
            "teacher this way; the result is kept beside the checkpoints for resuming."
        ),
        validator=ge(0),
    )
    teacher_warmup_template: str = option(
        "{answer}", "Response text of the teacher's warm-up examples; `{answer}` is the answer."
    )


@attrs.define
class SFTSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))


@attrs.define
class DPOSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))
    beta: float = option(0.1, "DPO temperature.", validator=gt(0))
    sft_loss_weight: float = option(
        0.0, "Weight of an NLL term on the chosen response.", validator=ge(0)
    )
    average_logprobs: bool = option(False, "Average (not sum) response logprobs.")


@attrs.define
class RMSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))


@attrs.define
class EvalSection:
    checkpoint: str | None = option(
        None,
        (
            "An nrl checkpoint to evaluate: a `step_N` folder, or a checkpoint directory (its "
            "newest step). The policy's model keys (backend, model_name, tokenizer_name, "
            "precision, backend options) come from the config saved in it; unset: evaluate "
            "`policy.model_name` (a Hugging Face name or folder, or a checkpoint folder)."
        ),
    )
    num_samples: int = option(
        1,
        "Responses sampled per problem (n), at `generation.temperature`.",
        validator=ge(1),
    )
    pass_k: list[int] = option(
        [],
        (
            "The k of each reported pass@k (each at most num_samples); empty: 1 and num_samples. "
            "Unbiased estimator of Chen et al. (2021) when n > k, any-correct when n == k."
        ),
        validator=each(ge(1)),
    )
    correct_threshold: float = option(
        1.0,
        "A response is correct when its episode reward is at least this.",
        validator=FINITE,
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    batch_size: int = option(
        256, "Responses rolled out together in one rollout call (0: all at once).", validator=ge(0)
    )
    output: str | None = option(
        None, "Where eval.json is written (default: <logger.log_dir>/<logger.run_name>/eval.json)."
    )


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
}
