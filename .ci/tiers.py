"""The test tiers of `.ci/run` drop nothing: every collected test runs in exactly one tier.

``python .ci/tiers.py check QUICK SLOW``: QUICK and SLOW are what the tiers' pytest runs wrote
with ``--nrl-record=FILE`` (nrl's pytest plugin: the node ids of the tests each ran, skipped
ones included). Collects the whole suite (``-m ""``: no tier selection) and fails, listing
them, when a collected test ran in no tier or in both, or when a tier ran a test that the
whole collection does not have.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path


def collected() -> list[str]:
    """Node ids of every test of the suite, whatever its tier."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"pytest --collect-only failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    # `-q --collect-only` prints one node id a line, then a blank line and the summary.
    ids = done.stdout.split("\n\n", 1)[0].splitlines()
    return [line for line in ids if "::" in line]


def check(quick_file: str, slow_file: str) -> int:
    tiers = {"quick": quick_file, "slow": slow_file}
    ran = {name: Path(path).read_text().splitlines() for name, path in tiers.items()}
    everything = collected()
    problems = []
    for name, ids in ran.items():
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        problems += [f"ran twice in the {name} tier: {i}" for i in repeated]
    both = set(ran["quick"]) & set(ran["slow"])
    problems += [f"in both tiers: {i}" for i in sorted(both)]
    union = set(ran["quick"]) | set(ran["slow"])
    problems += [f"in no tier: {i}" for i in sorted(set(everything) - union)]
    problems += [f"not in the whole collection: {i}" for i in sorted(union - set(everything))]
    counts = ", ".join(f"{name} {len(set(ids))}" for name, ids in ran.items())
    if problems:
        print("\n".join(problems))
        print(f"tiers: {len(problems)} problem(s); collected {len(everything)}, ran {counts}")
        return 1
    print(f"tiers: all {len(everything)} collected tests ran in exactly one tier ({counts})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "check":
        sys.exit("usage: python .ci/tiers.py check QUICK_RECORD SLOW_RECORD")
    sys.exit(check(sys.argv[2], sys.argv[3]))
