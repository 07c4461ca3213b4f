"""``nrl plot RUN_DIR``: PNG charts of a run's metrics, written next to ``metrics.jsonl``."""

from __future__ import annotations

import argparse
from pathlib import Path

from nrl_core.errors import ConfigError, NrlError

CHARTS = {
    "reward": ["train/reward_mean"],
    # distill: the teacher's own accuracy (step 0) next to the student's
    "val_accuracy": ["val/accuracy", "val/teacher_accuracy"],
    "kl": ["train/kl"],
    "entropy": ["train/entropy"],
    "loss": ["train/loss"],
    # distill: both divergences (the optimised one is also the loss chart)
    "kl_to_teacher": ["train/reverse_kl", "train/forward_kl"],
    "logprob_gap": ["train/logprob_gap"],
}
TIMING_KEYS = [
    "timing/generation_s",
    "timing/logprobs_s",
    "timing/teacher_s",
    "timing/train_s",
    "timing/refit_s",
]


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot", help="draw PNG charts of a run's metrics", description=__doc__
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (has metrics.jsonl)")
    parser.set_defaults(handler=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    written = plot_run(args.run_dir)
    if not args.quiet:
        for path in written:
            print(path)
    return 0


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per chart (and the step-time breakdown); return their paths."""
    from nrl_core.metrics import METRICS_FILE

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise ConfigError(
            f"{run_dir} has no {METRICS_FILE}; pass the run directory "
            "(logger.log_dir/logger.run_name)"
        )
    records = plottable_records(run_dir / METRICS_FILE)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NrlError("nrl plot needs matplotlib: pip install 'nrl-core[plot]'") from None
    written = []
    for name, keys in CHARTS.items():
        series = {k: [(r["step"], r[k]) for r in records if r.get(k) is not None] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=key)
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, run_dir / f"{name}.png", plt))
    timed = [r for r in records if "timing/step_s" in r]
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = [r["step"] for r in timed]
        bottom = [0.0] * len(timed)
        for key in TIMING_KEYS:
            values = [r.get(key) or 0.0 for r in timed]
            ax.bar(steps, values, bottom=bottom, label=key.split("/")[1])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        other = [r["timing/step_s"] - b for r, b in zip(timed, bottom, strict=True)]
        ax.bar(steps, other, bottom=bottom, label="other")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.set_title("step time breakdown")
        ax.legend(fontsize="small")
        written.append(_save(fig, run_dir / "step_time.png", plt))
    if not written:
        raise ConfigError(f"{run_dir / METRICS_FILE} holds no metrics to plot yet")
    return written


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def plottable_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` that can be drawn: JSON objects with an integer
    ``step``, keeping only their numeric values (null, text, lists are left out).

    A torn last line (a run killed mid-write) is tolerated, as everywhere metrics are read
    (:func:`nrl_core.metrics._records`); bytes that are not UTF-8 or a garbage line before the
    last are a :class:`ConfigError` naming the file and line.
    """
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
    kept = []
    for record in records:
        step = record.get("step")
        if not _number(step) or not float(step).is_integer():
            continue
        kept.append({k: v for k, v in record.items() if _number(v)} | {"step": int(step)})
    return kept


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
