"""Seconds per step and throughput of asynchronous GRPO against the synchronous loop, measured
in one run on this machine.

    uv run python benchmarks/async_grpo.py [--steps 30] [--warmup 5] [KEY=VALUE ...]

Runs the main-job recipe (``nrl run grpo``, actors in this interpreter) three ways: colocated
generation (the default), separate torch engines synchronously (``generation.colocated=false
generation.num_engines=1``), and the same engines with ``grpo.async.enabled=true
grpo.async.max_trajectory_age_steps=1``. Prints each one's median step time, tokens per second,
refit time and, for async, the trajectory age and engine idle fraction. The last line is
``sync_step_s=… async_step_s=… speedup=…`` (separate engines, sync over async).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from grpo_step import run_grpo

SEPARATE = ["generation.colocated=false", "generation.num_engines=1"]
ASYNC = ["grpo.async.enabled=true", "grpo.async.max_trajectory_age_steps=1"]


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="extra config overrides (every variant)")
    args = parser.parse_args()
    variants = {
        "colocated": [],
        "separate_sync": SEPARATE,
        "separate_async": SEPARATE + ASYNC,
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants.items():
            records = run_grpo(args.steps, [*overrides, *args.overrides], Path(tmp) / name)
            steady = [r for r in records if r["step"] > args.warmup]
            results[name] = steady
            line = (
                f"{name}: step_s={median(steady, 'timing/step_s'):.4f} "
                f"tokens_per_s={median(steady, 'throughput/tokens_per_s'):.1f} "
                f"train_s={median(steady, 'timing/train_s'):.4f} "
                f"generation_wait_s={median(steady, 'timing/generation_s'):.4f} "
                f"refit_s={median(steady, 'timing/refit_s'):.4f}"
            )
            if name == "separate_async":
                line += (
                    f" age_mean={statistics.mean(r['async/trajectory_age_mean'] for r in steady):.2f}"
                    f" engine_idle={median(steady, 'async/engine_idle_fraction'):.2f}"
                    f" generation_s={median(steady, 'async/generation_s'):.4f}"
                )
            print(line, flush=True)
    sync_s = median(results["separate_sync"], "timing/step_s")
    async_s = median(results["separate_async"], "timing/step_s")
    print(f"sync_step_s={sync_s:.4f} async_step_s={async_s:.4f} speedup={sync_s / async_s:.3f}")


if __name__ == "__main__":
    main()
