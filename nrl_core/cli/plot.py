"""``nrl plot RUN_DIR [RUN_DIR ...]``: PNG charts of runs' metrics.

One run: the charts go next to its ``metrics.jsonl``. Several runs: each chart shows every run
in its own colour, written to ``./compare-<run>-vs-<run>/`` (or ``--out DIR``). Noisy training
series are drawn faint with an exponential moving average on top (``--smooth``); validation
points are drawn as they are.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nrl_core.errors import ConfigError, NrlError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Chart:
    """One chart: the metric keys it draws, its title and the quantity on its y axis."""

    keys: tuple[str, ...]
    title: str
    ylabel: str
    unless: tuple[str, ...] = ()
    """A run that logged one of these keys is drawn by another chart instead."""


CHARTS = {
    "reward": Chart(("train/reward_mean",), "reward", "mean reward"),
    # distill: the teacher's own accuracy (step 0) next to the student's
    "val_accuracy": Chart(
        ("val/accuracy", "val/teacher_accuracy"), "validation accuracy", "accuracy"
    ),
    # Environments whose reward is not correctness (partial credit) log no val/accuracy.
    "val_reward": Chart(
        ("val/reward_mean",), "validation mean reward", "mean reward", unless=("val/accuracy",)
    ),
    "kl": Chart(("train/kl",), "KL to the reference policy", "KL"),
    "entropy": Chart(("train/entropy",), "entropy", "nats per token"),
    # sft/dpo/rm log a validation loss: drawn as points on the training curve
    "loss": Chart(("train/loss", "val/loss"), "loss", "loss"),
    # distill: both divergences (the optimised one is also the loss chart)
    "kl_to_teacher": Chart(("train/reverse_kl", "train/forward_kl"), "KL to the teacher", "nats"),
    "logprob_gap": Chart(("train/logprob_gap",), "log-prob gap (teacher - student)", "nats"),
    # ppo: the critic's loss and how much of the returns' variance its values explain
    "value_loss": Chart(("train/value_loss",), "critic value loss", "loss"),
    "explained_variance": Chart(
        ("train/explained_variance",), "critic explained variance", "1 - Var(R - V) / Var(R)"
    ),
    # grpo.async: how stale the trained samples were, and the mismatch by version gap
    "async_age": Chart(
        ("async/age_mean", "async/age_max"), "trajectory age (async)", "optimizer steps"
    ),
    "mismatch": Chart(
        ("train/gen_logprob_error", *(f"async/gen_logprob_error_gap{k}" for k in range(4))),
        "train/inference mismatch",
        "mean exp(|old - gen|)",
    ),
}
TIMING_KEYS = [
    "timing/generation_s",
    "timing/logprobs_s",
    "timing/teacher_s",
    "timing/critic_s",
    "timing/train_s",
    "timing/refit_s",
]
STEP_TIME = "step_time"
DEFAULT_SMOOTH = 0.6
# Below this many points an average hides more than it shows: the raw line is drawn alone.
MIN_SMOOTH_POINTS = 5
# Line styles tell a chart's series apart when colours tell the runs apart.
_STYLES = ("-", "--", ":", "-.")
# Runs named in a default comparison folder before "-and-N-more".
_MAX_NAMES_IN_FOLDER = 3


def add_parser(subparsers) -> None:
    """Register ``nrl plot``."""
    parser = subparsers.add_parser(
        "plot",
        help="draw PNG charts of runs' metrics (several runs: one chart comparing them)",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run directory (has metrics.jsonl); several to compare them",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="write the PNGs here (default: next to metrics.jsonl for one run, "
        "./compare-<run>-vs-<run>/ for several)",
    )
    # Read as text and checked in the handler: argparse's own error is a usage block, nrl's
    # errors are one line.
    parser.add_argument(
        "--smooth",
        metavar="W",
        default=str(DEFAULT_SMOOTH),
        help="weight of the exponential moving average drawn over training series, in [0, 1) "
        f"(default {DEFAULT_SMOOTH}; 0 draws the raw series only)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="only errors"
    )
    parser.set_defaults(handler=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    smooth = parse_smooth(args.smooth)

    def report(line: str) -> None:
        print(line, file=sys.stderr)

    written = plot_runs(
        args.run_dirs, out_dir=args.out, smooth=smooth, report=None if args.quiet else report
    )
    if not args.quiet:
        for path in written:
            print(path)
    return 0


def parse_smooth(text: str | float) -> float:
    """``--smooth``'s value as a float in [0, 1); a :class:`ConfigError` otherwise."""
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    # `not (a <= w < b)` is also true for NaN.
    if not 0 <= weight < 1:
        raise ConfigError(
            f"--smooth {text}: expected a number in [0, 1) (0 draws the raw series only; "
            f"default {DEFAULT_SMOOTH})"
        )
    return weight


# -- reading runs -----------------------------------------------------------------------------


@dataclass
class Run:
    """A run's drawable metrics. ``label`` names it in titles and legends; ``logged`` holds
    every key it logged, measured or not (``train/kl`` is null with the KL penalty off)."""

    path: Path
    label: str
    records: list[dict]
    logged: set[str] = field(default_factory=set)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and finite values of ``key``. A step logged twice (a resumed run replays the
        steps after its checkpoint) keeps its last value."""
        by_step = {}
        for record in self.records:
            value = record.get(key)
            if value is not None and math.isfinite(value):
                by_step[record["step"]] = float(value)
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """Read every run's ``metrics.jsonl`` before anything is drawn: a missing or empty one is a
    :class:`ConfigError` naming it. Labels are the folder names, ``parent/name`` where two
    runs share a name."""
    from nrl_core.metrics import METRICS_FILE

    paths = [Path(d) for d in run_dirs]
    for path in paths:
        if not (path / METRICS_FILE).is_file():
            raise ConfigError(
                f"{path} has no {METRICS_FILE}; pass the run directory "
                "(logger.log_dir/logger.run_name)"
            )
    resolved = [p.resolve() for p in paths]
    for index, path in enumerate(resolved):
        if path in resolved[:index]:
            raise ConfigError(f"{paths[index]} is given twice; name each run once")
    labels = _labels(resolved)
    runs = []
    for path, label in zip(paths, labels, strict=True):
        records, logged = _read(path / METRICS_FILE)
        run = Run(path, label, records, logged)
        if not _has_data(run):
            raise ConfigError(f"{path / METRICS_FILE} holds no metrics to plot yet")
        runs.append(run)
    return runs


def _labels(resolved: list[Path]) -> list[str]:
    names = [p.name or str(p) for p in resolved]
    labels = []
    for path, name in zip(resolved, names, strict=True):
        if names.count(name) > 1:
            # results/a/grpo vs results/b/grpo: the parent is what tells them apart.
            name = f"{path.parent.name}/{name}"
        labels.append(name)
    return [str(p) if labels.count(x) > 1 else x for p, x in zip(resolved, labels, strict=True)]


def _has_data(run: Run) -> bool:
    keys = [k for chart in CHARTS.values() for k in chart.keys] + ["timing/step_s"]
    return any(run.series(key)[0] for key in keys)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def plottable_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` that can be drawn: JSON objects with an integer
    ``step``, keeping only their numeric values (null, text, lists are left out).

    A torn last line (a run killed mid-write) is tolerated, as everywhere metrics are read
    (:func:`nrl_core.metrics._records`); bytes that are not UTF-8 or a garbage line before the
    last are a :class:`ConfigError` naming the file and line.
    """
    return _read(path)[0]


def _read(path: Path) -> tuple[list[dict], set[str]]:
    from nrl_core.metrics import _records

    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        # Only the last line may be torn; a bad byte there (a write cut inside a UTF-8
        # character) is a torn line too.
        if b"\n" not in raw[exc.start :].rstrip(b"\n"):
            text = raw[: raw.rfind(b"\n", 0, exc.start) + 1].decode("utf-8", "replace")
        else:
            raise ConfigError(
                f"{path}:{line}: not UTF-8 text; the file is corrupt (metrics.jsonl holds one "
                "JSON object per line)"
            ) from None
    try:
        records = _records(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    kept, logged = [], set()
    for record in records:
        step = record.get("step")
        if not _number(step) or not float(step).is_integer():
            continue
        logged.update(record)
        kept.append({k: v for k, v in record.items() if _number(v)} | {"step": int(step)})
    return kept, logged


# -- drawing ----------------------------------------------------------------------------------


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average, debiased as TensorBoard does: the running sum starts at 0
    and is divided by ``1 - weight**n``, so the first points are not pulled towards 0."""
    smoothed, running = [], 0.0
    for n, value in enumerate(values, 1):
        running = running * weight + (1 - weight) * value
        smoothed.append(running / (1 - weight**n))
    return smoothed


@dataclass
class Charts:
    """Drawn, unsaved figures by file stem, and one line per expected chart (or run in a
    chart) left out, with why."""

    figures: dict[str, Figure]
    skipped: list[str]


def draw_charts(runs: Sequence[Run], smooth: float = DEFAULT_SMOOTH) -> Charts:
    """Draw every chart that at least one run has data for; nothing is written."""
    figures, skipped = {}, []
    for name, chart in CHARTS.items():
        drawn = [
            r
            for r in runs
            if any(r.series(k)[0] for k in chart.keys)
            and not any(k in r.logged for k in chart.unless)
        ]
        missing = [(r, why) for r in runs if r not in drawn and (why := _why_missing(r, name))]
        skipped += _skip_lines(name, missing, bool(drawn))
        if drawn:
            figures[name] = _line_chart(runs, chart, smooth)
    timed = [r for r in runs if r.series("timing/step_s")[0]]
    if len(runs) == 1 and timed:
        figures[STEP_TIME] = _step_time_bars(runs[0])
    elif timed:
        figures[STEP_TIME] = _line_chart(
            runs, Chart(("timing/step_s",), "step time", "seconds per step"), smooth
        )
    return Charts(figures, skipped)


def _why_missing(run: Run, name: str) -> str | None:
    """Why a chart the run was expected to have has no data; None when it was not expected
    (a GRPO run has no KL to a teacher)."""
    keys = CHARTS[name].keys
    if any(k in run.logged for k in CHARTS[name].unless):
        return None
    kl_coef = _kl_coef(run) if name == "kl" else None
    if not any(k in run.logged for k in keys) and kl_coef is None:
        return None
    why = f"no {' or '.join(keys)} values in metrics.jsonl"
    if kl_coef is not None and kl_coef[1] == 0:
        why += f" ({kl_coef[0]} is 0: the KL penalty is off, so the KL is not measured)"
    return why


def _kl_coef(run: Run) -> tuple[str, float] | None:
    """``(key, value)`` of the run's KL penalty coefficient from its ``config.yaml``; None when
    the run has none (not a policy-gradient run, or no readable config)."""
    try:
        import yaml

        config = yaml.safe_load((run.path / "config.yaml").read_text(encoding="utf-8"))
        loss = config["loss"]
        value = loss[loss["name"]]["kl_coef"]
    except Exception:  # an explanation is optional: never fail a plot over it
        return None
    return (f"loss.{loss['name']}.kl_coef", value) if _number(value) else None


def _skip_lines(name: str, missing: list[tuple[Run, str]], drawn: bool) -> list[str]:
    if not missing:
        return []
    by_why: dict[str, list[str]] = {}
    for run, why in missing:
        by_why.setdefault(why, []).append(run.label)
    if drawn:
        return [f"{name}: drawn without {', '.join(ls)}: {why}" for why, ls in by_why.items()]
    if len(missing) == 1:  # one run: its name is in every title already
        return [f"{name}: not drawn: {missing[0][1]}"]
    return [f"{name}: not drawn: {why} ({', '.join(ls)})" for why, ls in by_why.items()]


def _figure(title: str, ylabel: str, runs: Sequence[Run]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A bare Figure on an Agg canvas: no pyplot, so no GUI backend and no global figure list.
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    whose = _runs_title(runs)
    # A long title would be cut at the figure's edges: the runs go on a second line.
    ax.set_title(f"{title} — {whose}" if len(title) + len(whose) < 60 else f"{title}\n{whose}")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    # Steps are whole: a 3-step run gets ticks 1, 2, 3, never 1.5.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    # Every chart spans all the steps logged, so that the charts of a run line up, and a
    # chart of one point (validation at step 0 only) still has a range with whole steps in it:
    # the locator falls back to fractions for a range around a single step.
    steps = [r["step"] for run in runs for r in run.records]
    low, high = min(steps), max(steps)
    pad = max((high - low) * 0.03, 0.5)
    ax.set_xlim(low - pad, high + pad)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)  # the grid behind bars and lines, not over them
    return fig, ax


def _runs_title(runs: Sequence[Run]) -> str:
    if len(runs) <= 2:
        return " vs ".join(r.label for r in runs)
    return f"{len(runs)} runs"


def _line_chart(runs: Sequence[Run], chart: Chart, smooth: float) -> Figure:
    from matplotlib.lines import Line2D

    fig, ax = _figure(chart.title, chart.ylabel, runs)
    present = [k for k in chart.keys if any(r.series(k)[0] for r in runs)]
    # Several runs with several series: a colour per run and a line style per series, and a
    # legend of each once ("run A", "run B", "val/accuracy", "val/teacher_accuracy") rather
    # than every pair: the pairs' labels are too long to fit under the chart.
    keyed = len(runs) > 1 and len(present) > 1
    handles = []
    for run_index, run in enumerate(runs):
        colour = f"C{run_index % 10}"
        if keyed:
            handles.append(Line2D([], [], color=colour, label=run.label))
        for key_index, key in enumerate(present):
            steps, values = run.series(key)
            if not steps:
                continue
            if len(runs) == 1:
                colour, style, label = f"C{key_index}", "-", key
                if key.startswith("val/") and len(values) > 1:
                    _mark_best_and_last(ax, steps, values, colour)
            else:
                style = _STYLES[key_index % len(_STYLES)]
                label = f"_{run.label}: {key}" if keyed else run.label
            handles += _draw_series(ax, steps, values, key, smooth, colour, style, label)
    if keyed:
        for key_index, key in enumerate(present):
            style = _STYLES[key_index % len(_STYLES)]
            marker = "o" if key.startswith("val/") else None
            handles.append(Line2D([], [], color="gray", linestyle=style, marker=marker, label=key))
    _legend(fig, [h for h in handles if not h.get_label().startswith("_")])
    return fig


def _mark_best_and_last(ax, steps, values, colour) -> None:
    """Label a validation series' best point and its last one (a run that ends below its
    peak shows both; the summary and `nrl eval` name the best checkpoint)."""
    # The latest of equal bests, as the checkpoint ranking picks.
    best = max(reversed(range(len(values))), key=lambda i: values[i])
    points = [(best, "best")] if best == len(values) - 1 else [(best, "best"), (-1, "last")]
    for index, word in points:
        ax.annotate(
            f"{word} {values[index]:.3f} (step {steps[index]})",
            (steps[index], values[index]),
            textcoords="offset points",
            xytext=(0, 8 if word == "best" else -14),
            ha="center",
            fontsize=8,
            color=colour,
        )


def _draw_series(ax, steps, values, key, smooth, colour, style, label) -> list:
    """Draw one series; the line that stands for it in a legend (the smoothed one)."""
    if key.startswith("val/"):
        # Validation runs every N steps: a few exact points, never averaged.
        return ax.plot(steps, values, style, marker="o", markersize=4, color=colour, label=label)
    if smooth > 0 and len(values) >= MIN_SMOOTH_POINTS:
        # A label starting with "_" keeps the faint raw line out of the legend: it shares the
        # smoothed line's colour and entry.
        ax.plot(steps, values, style, color=colour, alpha=0.25, linewidth=1, label=f"_raw {label}")
        return ax.plot(steps, ema(values, smooth), style, color=colour, linewidth=1.8, label=label)
    return ax.plot(steps, values, style, marker=".", color=colour, label=label)


def _legend(fig, handles: list) -> None:
    """A legend below the axes, outside them, so that it never hides a line; none for a
    single line (the title names it)."""
    if len(handles) < 2:
        return
    # As many columns as fit across the figure at about 6.5 px a character (font "small").
    longest = max(len(h.get_label()) for h in handles)
    fit = int(fig.get_figwidth() * fig.dpi * 0.95 // (longest * 6.5 + 50))
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=max(1, min(len(handles), 3, fit)),
        fontsize="small",
    )


def _step_time_bars(run: Run) -> Figure:
    """One run: where each step's time went, stacked per phase."""
    fig, ax = _figure("step time breakdown", "seconds", [run])
    steps, totals = run.series("timing/step_s")
    by_step: dict[int, dict] = {}
    for record in run.records:  # a resumed run may log a step twice: the last values win
        by_step.setdefault(record["step"], {}).update(record)
    bottom = [0.0] * len(steps)
    for key in TIMING_KEYS:
        values = [by_step[s].get(key) or 0.0 for s in steps]
        if not any(values):  # a phase this algorithm does not have (teacher_s in GRPO)
            continue
        ax.bar(steps, values, bottom=bottom, label=key.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    # Clamped: the phases are timed separately and may add up to a hair over the step.
    other = [max(t - b, 0.0) for t, b in zip(totals, bottom, strict=True)]
    ax.bar(steps, other, bottom=bottom, label="other", color="lightgray")
    # Stacked bars make every bar's bottom a "sticky" limit; autoscaling then snaps the y axis
    # to a tiny phase's top instead of 0.
    ax.use_sticky_edges = False
    ax.set_ylim(bottom=0)
    _legend(fig, ax.get_legend_handles_labels()[0])
    return fig


# -- writing ----------------------------------------------------------------------------------


def default_out_dir(runs: Sequence[Run]) -> Path:
    """Where the PNGs go without ``--out``: the run folder for one run, else
    ``./compare-<a>-vs-<b>`` in the current directory."""
    if len(runs) == 1:
        return runs[0].path
    names = [re.sub(r"[^A-Za-z0-9._-]+", "_", r.label) for r in runs]
    folder = "compare-" + "-vs-".join(names[:_MAX_NAMES_IN_FOLDER])
    if len(names) > _MAX_NAMES_IN_FOLDER:
        folder += f"-and-{len(names) - _MAX_NAMES_IN_FOLDER}-more"
    return Path(folder)


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    smooth: float = DEFAULT_SMOOTH,
    report: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write one PNG per chart for one run or a comparison of several; return their paths.
    ``report`` gets one line per expected chart that could not be drawn."""
    smooth = parse_smooth(smooth)
    runs = load_runs(run_dirs)
    _import_matplotlib()
    out = Path(out_dir) if out_dir is not None else default_out_dir(runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"--out {out}: not a folder") from None
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create it ({exc.strerror})") from None
    charts = draw_charts(runs, smooth)
    written = []
    for name, fig in charts.figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    if report is not None:
        for line in charts.skipped:
            report(line)
    return written


def plot_run(run_dir: str | Path, **kwargs) -> list[Path]:
    """Write one PNG per chart (and the step-time breakdown) of one run; return their paths.
    Keyword arguments as :func:`plot_runs`."""
    return plot_runs([run_dir], **kwargs)


def _import_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NrlError("nrl plot needs matplotlib: pip install 'nrl-core[plot]'") from None
