"""Wall time of `nrl --help` and `nrl plugins` (median of several runs), as a user sees it.

Run with every workspace plugin installed (the dev environment):

    uv run python benchmarks/cli_startup.py [--runs 15]

The last line is ``cli_help_median_s=<float> plugins_median_s=<float>``; the target for
`nrl --help` is under 0.5 s. `python -X importtime` on the same commands shows what to cut.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def nrl_command() -> list[str]:
    script = Path(sys.executable).with_name("nrl")
    if script.exists():
        return [str(script)]
    found = shutil.which("nrl")
    return [found] if found else [sys.executable, "-m", "nrl_core.cli"]


def median_wall_s(command: list[str], runs: int) -> float:
    subprocess.run(command, capture_output=True, check=True)  # warm the OS file cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    nrl = nrl_command()
    baseline = median_wall_s([sys.executable, "-c", "pass"], args.runs)
    help_s = median_wall_s([*nrl, "--help"], args.runs)
    plugins_s = median_wall_s([*nrl, "plugins"], args.runs)
    print(f"python_startup_median_s={baseline:.3f} (interpreter alone, for reference)")
    print(f"cli_help_median_s={help_s:.3f} plugins_median_s={plugins_s:.3f}")


if __name__ == "__main__":
    main()
