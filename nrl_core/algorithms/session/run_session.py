"""The run session: one training run's parts put together, opened and closed as one.

:class:`RunSession` is a thin composition of the parts of this package, each with one job:
the run folder (:mod:`.run_folder`), the run's data (:mod:`.run_data`), the started
components (:mod:`.components`) and the console (:mod:`.console`). It orders the set-up, logs
the metrics and stops everything at the end. The algorithms (GRPO, SFT, ...) only write their
loop on top of it, reading the parts through the session's attributes (``session.policy``,
``session.val_samples``, ...).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from nrl_core import atomic, run_log
from nrl_core.algorithms.session.components import Components
from nrl_core.algorithms.session.console import RunConsole
from nrl_core.algorithms.session.run_data import RunData
from nrl_core.algorithms.session.run_folder import RunFolder
from nrl_core.checkpoint import finite
from nrl_core.config.loader import ConfigConverter, dump_config
from nrl_core.config.schema import RunConfig
from nrl_core.interfaces import ComponentContext
from nrl_core.metrics import MetricsLogger
from nrl_core.preflight import check_model_configs, preflight
from nrl_core.registry import Registry
from nrl_core.run_log import open_run_log


def max_steps_of(config: Any, algorithm: str) -> int:
    return getattr(config, algorithm).max_num_steps


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


def _part(part: str, name: str) -> property:
    """``session.<name>``, read and written on the part that owns it (``session.<part>``)."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
        doc=f"``{part}.{name}``",
    )


class RunSession:
    """The components of one run. Use :meth:`open` as a context manager.

    Its parts: :attr:`folder` (:class:`~.run_folder.RunFolder`), :attr:`data`
    (:class:`~.run_data.RunData`), :attr:`components` (:class:`~.components.Components`) and
    :attr:`display` (:class:`~.console.RunConsole`); the attributes below forward to them.
    """

    # The run folder.
    run_dir = _part("folder", "run_dir")
    checkpoints = _part("folder", "checkpoints")
    start_step = _part("folder", "start_step")
    resume_path = _part("folder", "resume_path")
    # The data.
    tokenizer = _part("data", "tokenizer")
    codec = _part("data", "codec")
    val_samples = _part("data", "val_samples")
    train_stream = _part("data", "train_stream")
    task_agents = _part("data", "task_agents")
    data_metrics = _part("data", "data_metrics")
    # The components.
    cluster = _part("components", "cluster")
    cluster_resources = _part("components", "cluster_resources")
    policy = _part("components", "policy")
    teacher = _part("components", "teacher")
    critic = _part("components", "critic")
    generate = _part("components", "generate")
    refit = _part("components", "refit")
    gate = _part("components", "gate")
    generation_engines = _part("components", "generation_engines")
    env_pool = _part("components", "env_pool")
    agent_pool = _part("components", "agent_pool")
    server = _part("components", "server")
    endpoint = _part("components", "endpoint")
    loss_fn = _part("components", "loss_fn")
    # The console's record.
    history = _part("display", "history")
    step_times = _part("display", "step_times")
    opened_at = _part("display", "opened_at")
    setup_s = _part("display", "setup_s")

    def __init__(
        self, config: RunConfig, registry: Registry, *, algorithm: str, console: Console
    ) -> None:
        self.config = config
        self.registry = registry
        self.algorithm = algorithm
        self.console = console
        self.context = ComponentContext(config=config, seed=config.seed)
        self.finished_early = False
        self._closers: list[Callable[[], None]] = []
        self.folder = RunFolder(config, registry, algorithm=algorithm, closers=self._closers)
        self.data = RunData(config, registry, self.context, algorithm=algorithm, console=console)
        self.components = Components(
            config,
            registry,
            self.context,
            data=self.data,
            folder=self.folder,
            closers=self._closers,
        )
        self.display = RunConsole(console, algorithm=algorithm, folder=self.folder)
        self._val_at_step: tuple[int, dict[str, float]] | tuple[None, None] = (None, None)
        """The last step that logged validation metrics, and those metrics."""

    @property
    def verbose(self) -> bool:
        """``nrl run -v``: among other things, a failed run keeps Ray's temp folder (its logs)."""
        return self.components.verbose

    @verbose.setter
    def verbose(self, value: bool) -> None:
        self.components.verbose = self.display.verbose = value

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
            session.folder.find_resume_point()
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

    def _setup(self) -> None:
        config, registry = self.config, self.registry
        # First, so that the phases below (each a line once done) come under it. One line
        # however long its paths (soft_wrap): off a terminal rich would break it at 80 columns,
        # and a path cut in two can be neither copied nor grepped from a CI log.
        self.console.print(
            f"[bold]nrl {self.algorithm}[/bold] run dir: {escape(str(self.run_dir))}"
            + (f" (resuming from {escape(str(self.resume_path))})" if self.resume_path else ""),
            soft_wrap=True,
        )
        # Data first: a dataset the run cannot use is a config error, reported before the run
        # directory, Ray or any worker exists (it needs only the driver's tokenizer).
        with self.phase("loading the data") as done:
            # transformers loads each model's config.json here (torch is imported by now),
            # not in the CLI's early preflight: a broken one is bad input, not a worker failure.
            check_model_configs(config)
            self.data.load()
            if hasattr(config, "teacher"):
                self.data.check_teacher_tokenizer()
            done(self.data.line())
        # Before the run folder is written to, and before Ray or any worker starts.
        self.folder.lock()
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

        self.components.start(self.phase)
        if self.resume_path is not None:
            with self.phase(f"loading {self.resume_path}") as done:
                self.folder.restore(self.policy, self.train_stream, critic=self.critic)
                done(f"restored step {self.start_step} from {self.resume_path}")
        self.setup_s = time.monotonic() - self.opened_at

    # -- what the algorithms call -------------------------------------------------------------

    def phase(self, doing: str) -> contextlib.AbstractContextManager[Callable[[str], None]]:
        """See :meth:`.console.RunConsole.phase`."""
        return self.display.phase(doing)

    def progress(
        self, total: int, completed: int, fields: tuple[tuple[str, str], ...] | None = None
    ) -> contextlib.AbstractContextManager[Callable[[dict[str, Any]], None]]:
        """See :meth:`.console.RunConsole.progress`."""
        return self.display.progress(total, completed, fields)

    def summary(self, rows: list[tuple[str, str]] | None = None) -> None:
        """See :meth:`.console.RunConsole.summary`."""
        self.display.summary(rows)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        val = {k: float(v) for k, v in metrics.items() if k.startswith("val/") and finite(v)}
        if val:  # a checkpoint of this step records them (see save_checkpoint)
            self._val_at_step = (step, val)
        self.display.record(step, metrics)
        self.metrics.log(step, metrics)
        run_log.step_done(step)  # captured output is capped per step

    def agent_for(self, task: str) -> str:
        """See :meth:`.run_data.RunData.agent_for`."""
        return self.data.agent_for(task)

    def _environment_routes(self) -> dict[str, tuple[str, str]]:
        """See :meth:`.components.Components.environment_routes`."""
        return self.components.environment_routes()

    def context_for(self, spec: Any) -> ComponentContext:
        """See :meth:`.components.Components.context_for`."""
        return self.components.context_for(spec)

    def start_policy_only(self):
        """See :meth:`.components.Components.start_policy_only`."""
        return self.components.start_policy_only()

    def start_server_only(self):
        """See :meth:`.components.Components.start_server_only`."""
        return self.components.start_server_only()

    @property
    def teacher_snapshot(self) -> Path:
        """See :attr:`.run_folder.RunFolder.teacher_snapshot`."""
        return self.folder.teacher_snapshot

    def should_checkpoint(self, step: int, last: bool) -> bool:
        return self.folder.should_checkpoint(step, last)

    def save_checkpoint(self, step: int) -> Path:
        """See :meth:`.run_folder.RunFolder.save_checkpoint` (the policy's, the critic's if
        any, and the data's, and the validation metrics logged at this step, if any)."""
        logged_step, val = self._val_at_step
        return self.folder.save_checkpoint(
            step,
            self.policy,
            self.train_stream,
            val if logged_step == step else None,
            critic=self.critic,
        )

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
