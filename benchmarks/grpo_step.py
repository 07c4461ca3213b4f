"""Steady-state seconds per GRPO step of the main-job config, with the phase breakdown.

    uv run python benchmarks/grpo_step.py [--steps 30] [--warmup 5] [KEY=VALUE ...]

Runs `nrl run grpo` (the embedded CPU recipe, actors in the driver's interpreter) for
``--steps`` steps without validation or checkpoints, then reads ``metrics.jsonl``. Steps before
``--warmup`` are dropped (start-up, first-call compilation). Framework overhead is the share of
step time outside generation + logprobs + train + refit compute. The last line is
``step_s=<float> overhead_frac=<float>``; the overhead target is under 0.10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("timing/generation_s", "timing/logprobs_s", "timing/train_s", "timing/refit_s")


def run_grpo(steps: int, overrides: list[str], log_dir: Path) -> list[dict]:
    """Run ``nrl run grpo`` for ``steps`` steps without validation, checkpoints or supervised
    warm-up (actors in this interpreter), logging under ``log_dir``; return its step records
    (those with ``timing/step_s``). ``overrides`` come last, so they win."""
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        "-q",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.sft_warmup_steps=0",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.run_name=bench",
        *overrides,
    ]
    subprocess.run(command, check=True, env={**os.environ, "NRL_ACTOR_ENV": "system"})
    lines = (Path(log_dir) / "bench" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "timing/step_s" in r]


def overhead_fraction(record: dict) -> float:
    """The share of a step's time outside generation + logprobs + train + refit."""
    return 1 - sum(record[k] for k in PHASES) / record["timing/step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="extra config overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        records = run_grpo(args.steps, args.overrides, Path(tmp))
    steady = [r for r in records if r["step"] > args.warmup]
    if not steady:
        sys.exit(f"no steps after the first {args.warmup}; raise --steps")
    step_s = statistics.median(r["timing/step_s"] for r in steady)
    for key in PHASES:
        print(f"{key.split('/')[1]}={statistics.median(r[key] for r in steady):.4f}")
    overhead = [overhead_fraction(r) for r in steady]
    print(f"tokens_per_s={statistics.median(r['throughput/tokens_per_s'] for r in steady):.1f}")
    print(f"steps_measured={len(steady)}")
    # Steadiness (issue 50: one rank must vary by less than 25% between steps).
    times = sorted(r["timing/step_s"] for r in steady)
    print(
        f"step_s min={times[0]:.4f} max={times[-1]:.4f} max_over_min={times[-1] / times[0]:.3f} "
        f"spread={(times[-1] - times[0]) / step_s:.3f} (of the median)"
    )
    print(f"step_s={step_s:.4f} overhead_frac={statistics.median(overhead):.4f}")


if __name__ == "__main__":
    main()
