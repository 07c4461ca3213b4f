"""Time from `nrl run grpo` to its first step, per cluster backend (issue 39: a 1-rank run
through the in-process cluster should reach it in under 30 s on an idle machine).

    uv run python benchmarks/first_step.py [--backends inprocess local]

Runs `nrl run grpo policy.num_workers=1 grpo.max_num_steps=3` with small batches (the
venv's `nrl` directly, so `uv run` is not counted) and prints, per backend,
``backend=<name> first_step_s=<float> total_s=<float> load=<1-min load average at start>``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = [
    "policy.num_workers=1",
    "grpo.max_num_steps=3",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "grpo.sft_warmup_steps=1",
    "data.max_val_samples=8",
    "grpo.val_period=2",
    "checkpointing.enabled=false",
]


def first_step(backend: str, folder: Path) -> tuple[float, float]:
    nrl = Path(sys.executable).with_name("nrl")
    command = [str(nrl), "run", "grpo", f"logger.log_dir={folder}", f"cluster.backend={backend}"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*command, *SETTINGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = None
    for line in proc.stdout:  # off a terminal: one line per step
        if seen is None and line.startswith("step 1/"):
            seen = time.perf_counter() - start
    if proc.wait() != 0 or seen is None:
        sys.exit(f"{backend}: the run failed (exit {proc.returncode}); see {folder}")
    return seen, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["inprocess", "local"])
    args = parser.parse_args()
    for backend in args.backends:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as folder:
            seen, total = first_step(backend, Path(folder))
        print(f"backend={backend} first_step_s={seen:.1f} total_s={total:.1f} load={load:.1f}")


if __name__ == "__main__":
    main()
