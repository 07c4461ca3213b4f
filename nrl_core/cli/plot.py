"""``nrl plot RUN_DIR``: PNG charts of a run's metrics, written next to ``metrics.jsonl``."""

from __future__ import annotations

import argparse
from pathlib import Path

from nrl_core.errors import NrlError

CHARTS = {
    "reward": ["train/reward_mean"],
    "val_accuracy": ["val/accuracy"],
    "kl": ["train/kl"],
    "entropy": ["train/entropy"],
    "loss": ["train/loss"],
}
TIMING_KEYS = ["timing/generation_s", "timing/logprobs_s", "timing/train_s", "timing/refit_s"]


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
    from nrl_core.metrics import METRICS_FILE, read_metrics

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise NrlError(
            f"{run_dir} has no {METRICS_FILE}; pass the run directory "
            "(logger.log_dir/logger.run_name)"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NrlError("nrl plot needs matplotlib: pip install 'nrl-core[plot]'") from None
    records = read_metrics(run_dir)
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
        raise NrlError(f"{run_dir / METRICS_FILE} holds no metrics to plot yet")
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
