"""The run session, under the name the algorithms, the CLI and the tests import it by.

The code lives in the package :mod:`nrl_core.algorithms.session` (one module per job: the run
folder, the data, the components, the console); this module re-exports its names.
"""

from nrl_core.algorithms.session import (
    ENV_CPUS_PER_WORKER,
    PROGRESS_FIELDS,
    RUN_LOCK,
    STEP_LINES,
    TEACHER_CPUS_ON_CPU,
    Components,
    RunConsole,
    RunData,
    RunFolder,
    RunSession,
    StepLines,
    format_fields,
    loss_options,
    max_steps_of,
    resolve_model_name,
    train_in_session,
)

__all__ = [
    "ENV_CPUS_PER_WORKER",
    "PROGRESS_FIELDS",
    "RUN_LOCK",
    "STEP_LINES",
    "TEACHER_CPUS_ON_CPU",
    "Components",
    "RunConsole",
    "RunData",
    "RunFolder",
    "RunSession",
    "StepLines",
    "format_fields",
    "loss_options",
    "max_steps_of",
    "resolve_model_name",
    "train_in_session",
]
