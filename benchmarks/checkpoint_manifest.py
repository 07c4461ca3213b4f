"""What a checkpoint's manifest costs: writing it at save and verifying it at resume, against
the baseline of reading the same bytes once (measured in the same run).

    uv run python benchmarks/checkpoint_manifest.py [--gib 1] [--files 4]

Files come from the page cache (just written), as right after a save; a cold resume from a
network filesystem is bounded by its read speed instead.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from nrl_core.checkpoint import TRAINER_STATE, verify, write_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--files", type=int, default=4, help="number of shard files")
    args = parser.parse_args()
    size = int(args.gib * 2**30 / args.files)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for i in range(args.files):
            (root / f"shard{i}.distcp").write_bytes(os.urandom(size))
        (root / TRAINER_STATE).write_text('{"step": 1}')
        start = time.perf_counter()
        for i in range(args.files):
            (root / f"shard{i}.distcp").read_bytes()
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        write_manifest(root)
        manifest_s = time.perf_counter() - start
        start = time.perf_counter()
        assert verify(root) is None
        verify_s = time.perf_counter() - start
    print(
        f"gib={args.gib} files={args.files} cpus={os.cpu_count()} read_s={read_s:.2f} "
        f"manifest_s={manifest_s:.2f} verify_s={verify_s:.2f} "
        f"manifest_vs_read={manifest_s / read_s:.2f}x"
    )


if __name__ == "__main__":
    main()
