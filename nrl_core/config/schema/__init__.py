"""The run configuration: attrs classes, one per section, each field documented.

Component sections (``policy``, ``generation``, ``env``, ``loss``, ``cluster``, ``data``) also
hold the options of registered components under the component's name: ``policy.dtensor``,
``generation.vllm``, ``env.math``. Those sub-sections are structured with the config class the
component registered, and land in the section's ``options`` dict (see
:meth:`ComponentSection.options_for`).

Field documentation lives in ``metadata["doc"]`` so that the configuration reference can be
generated from these classes.

One module per part, every name re-exported here:

- :mod:`.fields`: ``option``, the validators, :class:`ComponentSection`;
- :mod:`.policy`: ``policy`` and ``loss``;
- :mod:`.generation`: ``generation`` (and :class:`EngineOptions`, the base of the engine
  plugins' options) and ``server``;
- :mod:`.data`: ``data`` (and ``data.tasks``), ``env`` and ``agent``;
- :mod:`.infrastructure`: ``cluster``, ``checkpointing`` and ``logger``;
- :mod:`.algorithms`: ``grpo``, ``distill`` and ``teacher``, ``sft``, ``dpo``, ``rm``, ``eval``;
- :mod:`.runs`: the whole config of each command, ``ALGORITHM_CONFIGS``, ``portable_config``.
"""

from nrl_core.config.schema.algorithms import (
    AsyncSection,
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
from nrl_core.config.schema.data import (
    NO_ENVIRONMENT,
    AgentConfig,
    DataConfig,
    EnvConfig,
    TaskConfig,
)
from nrl_core.config.schema.fields import (
    FINITE,
    NON_EMPTY,
    RUN_NAME,
    ComponentSection,
    FieldValueError,
    Valid,
    between,
    describe_validator,
    each,
    ge,
    gt,
    le,
    one_of,
    option,
    optional,
    show_value,
)
from nrl_core.config.schema.generation import (
    ENGINE_DTYPES,
    REFIT_TRANSPORTS,
    EngineOptions,
    GenerationConfig,
    ServerConfig,
)
from nrl_core.config.schema.infrastructure import (
    CheckpointingConfig,
    ClusterConfig,
    LoggerConfig,
)
from nrl_core.config.schema.policy import (
    OPTIMIZERS,
    PRECISIONS,
    LossConfig,
    MoeConfig,
    OptimizerConfig,
    PolicyConfig,
)
from nrl_core.config.schema.runs import (
    ALGORITHM_CONFIGS,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    GRPOConfig,
    PPOConfig,
    RMConfig,
    RunConfig,
    ServeConfig,
    SFTConfig,
    portable_config,
)

__all__ = [
    "ALGORITHM_CONFIGS",
    "ENGINE_DTYPES",
    "FINITE",
    "NON_EMPTY",
    "NO_ENVIRONMENT",
    "OPTIMIZERS",
    "PRECISIONS",
    "REFIT_TRANSPORTS",
    "RUN_NAME",
    "AgentConfig",
    "AsyncSection",
    "CheckpointingConfig",
    "ClusterConfig",
    "ComponentSection",
    "CriticConfig",
    "DPOConfig",
    "DPOSection",
    "DataConfig",
    "DistillConfig",
    "DistillSection",
    "EngineOptions",
    "EnvConfig",
    "EvalConfig",
    "EvalSection",
    "FieldValueError",
    "GRPOConfig",
    "GRPOSection",
    "GenerationConfig",
    "LoggerConfig",
    "LossConfig",
    "MoeConfig",
    "OptimizerConfig",
    "PPOConfig",
    "PPOSection",
    "PolicyConfig",
    "RMConfig",
    "RMSection",
    "RunConfig",
    "SFTConfig",
    "SFTSection",
    "ServeConfig",
    "ServerConfig",
    "TaskConfig",
    "TeacherConfig",
    "Valid",
    "between",
    "describe_validator",
    "each",
    "ge",
    "gt",
    "le",
    "one_of",
    "option",
    "optional",
    "portable_config",
    "show_value",
]
