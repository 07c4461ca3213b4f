"""The hooks an nrl plugin implements.

Every hook receives one argument, ``register`` (see :class:`nrl_core.registry.Register`), and
calls it once per component it provides. Register targets as ``"module:attr"`` strings so that
loading a plugin stays cheap: ``nrl --help`` and ``nrl plugins`` import the plugin's hook module
but never its engine. A plugin implements only the hooks it needs::

    from nrl_core import hookimpl


    @hookimpl
    def nrl_register_generations(register):
        register(
            "vllm",
            "nrl_vllm.worker:VllmGenerationWorker",
            extras=["engine"],
            config="nrl_vllm.config:VllmConfig",
            description="vLLM engine",
        )

Implementations may omit arguments (pluggy passes only those they name), so hooks can gain
arguments later without breaking existing plugins.

Extras that only some settings need (and that cannot go into every venv) are not registered:
the component's config class declares them with a method ``required_modules()`` returning
``{module: (extra, setting)}`` for the options at hand, e.g. the dtensor policy's
``{"peft": ("lora", "lora_rank=8")}`` when ``lora_rank`` > 0. A run then builds the
component's actor venv with those extras too
(:func:`nrl_core.distributed.actor_env.component_extras`), and the driver checks, before
anything starts, that an ``actor_env`` set to ``system`` or to an interpreter has the modules
(:func:`nrl_core.preflight.check_component_requirements`). ``nrl venvs build 'NAME[EXTRA]'``
pre-builds such a venv.
"""

from __future__ import annotations

import pluggy

from nrl_core import PROJECT_NAME
from nrl_core.registry import Register

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def nrl_register_policies(register: Register) -> None:
    """Register policy (trainer) backends, selected by ``policy.backend``.

    The target is a per-rank worker class honouring
    :class:`nrl_core.interfaces.PolicyWorker`: per rank, it loads a model, computes logprobs
    of a micro batch, runs forward + backward of a micro batch and the optimizer step, saves
    and exports checkpoints. The core starts one per rank in a worker group and owns the rest
    of a training step (sharding, micro batches, loss normalisation, metric reduction; see
    :mod:`nrl_core.training`). Options come from ``policy.<name>``.
    """


@hookspec
def nrl_register_generations(register: Register) -> None:
    """Register generation (rollout) backends, selected by ``generation.backend``.

    The target is a worker class honouring :class:`nrl_core.interfaces.GenerationWorker`
    (token ids in; token ids and logprobs out). Backends that hold their own copy of the
    weights also honour :class:`nrl_core.interfaces.WeightSync`. Options come from
    ``generation.<name>``.
    """


@hookspec
def nrl_register_environments(register: Register) -> None:
    """Register environments (rewards, multi-turn interaction), selected by ``env.name``.

    The target is a class honouring :class:`nrl_core.interfaces.Environment`: a batched
    ``step(conversations, metadata)`` returning an observation, a reward, a terminated flag,
    stop strings and metadata per sample. It runs as a Ray actor in the plugin's environment.
    Options come from ``env.<name>``.
    """


@hookspec
def nrl_register_agents(register: Register) -> None:
    """Register agents, which drive rollouts themselves, selected by ``agent.name`` or a task's
    ``agent`` (``data.tasks``).

    The target is a class honouring :class:`nrl_core.interfaces.Agent`: given a batch of dataset
    rows and the URL of the run's OpenAI-compatible policy endpoint (:mod:`nrl_core.serving`),
    it calls the policy as if it were an OpenAI model, runs its tools, scores the finished
    conversations and returns one :class:`nrl_core.agents.Trajectory` per row (the exact
    prompt ids, generated ids and logprobs of every model call, the reward, a failure reason).
    It runs as a Ray actor in the plugin's environment; the core assembles training sequences
    from the trajectories. The core registers ``env``: its own generate / ``env.step`` loop.
    Options come from ``agent.<name>``.
    """


@hookspec
def nrl_register_losses(register: Register) -> None:
    """Register loss functions, selected by ``loss.name``.

    The target is a class honouring :class:`nrl_core.interfaces.LossFunction`. It runs inside
    the policy workers, so it must import only what every policy venv has (``nrl_core`` and
    torch). Options come from ``loss.<name>``.
    """


@hookspec
def nrl_register_clusters(register: Register) -> None:
    """Register cluster backends, selected by ``cluster.backend``.

    The target is a class honouring :class:`nrl_core.interfaces.Cluster`: it starts or connects
    to Ray, reports the resources it has, and shuts down what it started. The core registers
    ``local`` (an embedded Ray head), ``ray`` (an existing cluster), ``inprocess`` (no Ray:
    the worker groups are objects in the driver process) and ``auto`` (``inprocess`` where it
    is exact, else ``local``). Options come from ``cluster.<name>``.
    """


@hookspec
def nrl_register_datasets(register: Register) -> None:
    """Register datasets, selected by ``data.dataset``.

    The target is a callable honouring :class:`nrl_core.interfaces.DatasetLoader`: given its
    options and a split it returns the samples (prompt messages, the reference answer and
    the task name that routes each sample to its environment). Options come from
    ``data.<name>``. A dataset whose ``extras`` serve only some of its sources says which with
    ``extras_for="..."`` (``nrl doctor`` then calls it usable without them).
    """


@hookspec
def nrl_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers for the policy endpoint, selected by ``server.tool_parser``
    (vLLM's ``--tool-call-parser`` names are the convention).

    The target is a class honouring :class:`nrl_core.interfaces.ToolParser` (subclass
    :class:`nrl_core.serving.tool_calls.ToolParser`), built with no arguments in the driver
    where the endpoint runs (so it must import only what ``nrl_core`` does): ``parse(text,
    tools)`` returns ``(content, tool_calls)`` of a generated text; ``opening(name)`` returns
    the text that opens a call (to let requests force one with ``tool_choice``), or None;
    ``special_tokens`` names the special tokens it reads, which the generated ids are then
    decoded keeping. The core registers ``hermes``, ``llama3_json``, ``mistral`` and
    ``qwen3_coder``. Options come from ``server.*``: a parser takes none of its own, only its
    name in ``server.tool_parser``.
    """
