"""The run session: everything a training run sets up and tears down, shared by the algorithms.

One module per job:

- :mod:`.run_session`: :class:`RunSession`, which puts the parts below together, orders the
  set-up, logs the metrics and stops everything at the end;
- :mod:`.run_folder`: the run folder's lock, the resume point and the step checkpoints;
- :mod:`.run_data`: the tokenizer and chat codec, the splits and tasks, the prompt length filter;
- :mod:`.components`: placement and start-up of the cluster, the policy, the generation engines,
  the teacher, the environments, the agents and the policy endpoint, and the loss;
- :mod:`.console`: the start-up phases, the step progress and the summary.
"""

from nrl_core.algorithms.session.components import (
    ENV_CPUS_PER_WORKER,
    TEACHER_CPUS_ON_CPU,
    Components,
    loss_options,
)
from nrl_core.algorithms.session.console import (
    PROGRESS_FIELDS,
    STEP_LINES,
    RunConsole,
    StepLines,
    format_fields,
)
from nrl_core.algorithms.session.run_data import RunData, resolve_model_name
from nrl_core.algorithms.session.run_folder import RUN_LOCK, RunFolder
from nrl_core.algorithms.session.run_session import RunSession, max_steps_of, train_in_session

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
