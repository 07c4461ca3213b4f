"""The run's console: the start-up phases, the step progress (a bar on a terminal, plain step
lines off one) and the summary at the end."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

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

from nrl_core.run_log import RUN_LOG_FILE, run_log_path

if TYPE_CHECKING:
    from nrl_core.algorithms.session.run_folder import RunFolder

PROGRESS_FIELDS = (
    ("train/reward_mean", "reward"),
    ("val/accuracy", "val acc"),
    ("timing/step_s", "s/step"),
)
"""The ``(metric key, label)`` pairs the progress shows when the algorithm names none."""
STEP_LINES = 50
"""Off a terminal the progress is one line per step, or per N steps so that a run prints about
this many (plus the first and last steps and every validation step)."""


class RunConsole:
    """What the run shows on its console, and what it keeps for the summary.

    Args:
        console: where it goes; algorithm: the algorithm running.
        folder: the run folder (the summary names it and the latest checkpoint).
    """

    verbose = False
    """``nrl run -v``: Ray's and the workers' output is printed, not only kept in the run log."""

    def __init__(self, console: Console, *, algorithm: str, folder: RunFolder) -> None:
        self.console = console
        self.algorithm = algorithm
        self.folder = folder
        self.step_times: list[float] = []
        self.history: list[dict[str, Any]] = []
        """Every logged step's metrics (``{"step": N, ...}``), for the summary rows."""
        self.opened_at = time.monotonic()
        """When the run started, for the summary's times."""
        self.setup_s: float | None = None
        """How long the set-up took (data, Ray, workers), for the summary."""

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep a logged step's metrics for the summary (its step time for the median)."""
        if "timing/step_s" in metrics:
            self.step_times.append(metrics["timing/step_s"])
        self.history.append({"step": step, **metrics})

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
        table.add_row("run directory", str(self.folder.run_dir))
        for label, value in self._grpo_rows() if rows is None else rows:
            table.add_row(label, value)
        if self.step_times:
            table.add_row("median step time", f"{statistics.median(self.step_times):.2f} s")
        total = _duration(time.monotonic() - self.opened_at)
        if self.setup_s is not None:
            total += f" (start-up {_duration(self.setup_s)})"
        table.add_row("wall time", total)
        latest = self.folder.checkpoints.latest()
        if latest is not None:
            table.add_row("latest checkpoint", str(latest))
            best = self.folder.checkpoints.best()
            metric = self.folder.checkpoints.metric
            if best is not None:
                picked = f"{best[0].name} (best {metric} {best[1]:.3f}; checkpointing.metric_name)"
            else:
                # Not naming the metric: a run without accuracy never says "accuracy".
                picked = f"{latest.name} (the newest; none recorded checkpointing.metric_name)"
            table.add_row("nrl eval picks", picked)
        if not self.verbose and run_log_path() is not None:
            table.add_row("Ray and worker output", f"{RUN_LOG_FILE} (-v prints it here)")
        self.console.print(table)

    def _grpo_rows(self) -> list[tuple[str, str]]:
        # Accuracy only where the environment defines correctness; else the mean reward.
        key = (
            "val/accuracy" if any("val/accuracy" in h for h in self.history) else "val/reward_mean"
        )
        vals = [h for h in self.history if key in h]
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
                    f"val {'accuracy' if key == 'val/accuracy' else 'reward'} (first -> last)",
                    f"{vals[0][key]:.3f} (step {vals[0]['step']}) -> "
                    f"{vals[-1][key]:.3f} (step {vals[-1]['step']})",
                )
            )
            best = max(reversed(vals), key=lambda h: h[key])  # the latest of equals
            rows.append(
                (
                    f"val {'accuracy' if key == 'val/accuracy' else 'reward'} best",
                    f"{best[key]:.3f} (step {best['step']})",
                )
            )
        return rows


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
