"""Prepare the wheels a lent GPU machine lacks for benchmarks/gpu_acceptance.py.

    uv run python benchmarks/gpu_bundle.py DIR [--carry-mib 56] [--also NAME,...] [--vllm]

The GPU machines (one H100 or H200) have Python 3.12, torch, transformers and most of nrl's
small dependencies preinstalled, and no network; packages reach them only as files carried with
a command, at most 64 MiB per command (the working tree included). This script downloads, for
CPython 3.12 on manylinux x86_64:

- from the exact URLs and SHA-256 hashes in ``uv.lock`` (so the versions are the locked ones):
  what that image lacks — ``ray`` and its ``jsonschema`` family, ``cattrs``, ``megatron-core``,
  and ``tomlkit`` (needed by the build backend) — plus whatever ``--also`` names;
- with ``pip download`` (pinned, not in the lock): ``hatchling``, ``trove-classifiers`` and
  ``editables``, the build backend that ``pip install -e`` of nrl's own packages needs
  without network.

Ray's wheel (79 MB) is slimmed first (:data:`SLIM`): its Java jars, the dashboard's web client
and RLlib, which nothing of nrl imports, are left out (its ``RECORD`` rewritten to match), which
brings it to ~46 MB and the whole bundle to ~49 MiB, so that it travels with the working tree in
ONE device command (at most 64 MiB together). Files larger than ``--carry-mib`` are cut into
parts; everything is laid out in folders ``DIR/carry1``, ``DIR/carry2``, ... of at most
``--carry-mib`` each, one folder per device command (one with the defaults). ``carry1`` also holds ``install.sh`` (joins the parts, checks every hash,
installs the wheels and nrl's packages in editable mode), ``SHA256SUMS`` and ``README.txt``.
benchmarks/README.md gives the device commands step by step. Never run in CI (it downloads).

``--vllm`` also builds vLLM :data:`VLLM_VERSION`'s bundle (the release built for the machines'
torch) into ``DIR/vllm`` — its wheel slimmed (:data:`VLLM_SLIM`), the wheels it needs beyond the
image and nrl's bundle (``vllm-<version>-wheels.txt``), laid out by the same :func:`lay_out` —
and prints the chain of device calls (:func:`vllm_chain`): nrl's bundle and the acceptance
first, then one call per vLLM carry folder, the last one installing vLLM and running
``benchmarks/gpu_vllm.py``; with the plan of device time (:func:`plan_seconds`).

The code lives in the ``bundle`` package next to this file (:mod:`bundle.wheels`, nrl's bundle;
:mod:`bundle.vllm_chain`, vLLM's and the chain); this script puts this folder on ``sys.path``
(``benchmarks/`` is not an installed package) and holds the command line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# The names tests/benchmarks/test_gpu_bundle.py and test_gpu_acceptance.py read from this
# script (loaded by path), besides what main uses.
from bundle.vllm_chain import (  # noqa: E402
    COMMAND_MAX_CHARS,
    COMMAND_MAX_S,
    DEVICE_BUDGET_S,
    GAP_S,
    START_S,
    STASH_S,
    TRANSFER_MIB_PER_S,
    TRAVEL_MAX_MIB,
    VLLM_INSTALL_S,
    VLLM_RUN_LIMIT_S,
    VLLM_VERSION,
    VLLM_WHEELS,
    DeviceCall,
    acceptance_command,
    acceptance_module,
    build_vllm_bundle,
    folder_bytes,
    lay_out_vllm,
    plan_seconds,
    print_chain,
    vllm_chain,
    working_tree_bytes,
)
from bundle.wheels import (  # noqa: E402
    CARRY_MIB,
    SLIM,
    BundleError,
    build_bundle,
    lay_out,
    nrl_extras,
)

__all__ = [
    "CARRY_MIB",
    "COMMAND_MAX_CHARS",
    "COMMAND_MAX_S",
    "DEVICE_BUDGET_S",
    "GAP_S",
    "SLIM",
    "START_S",
    "STASH_S",
    "TRANSFER_MIB_PER_S",
    "TRAVEL_MAX_MIB",
    "VLLM_INSTALL_S",
    "VLLM_RUN_LIMIT_S",
    "VLLM_VERSION",
    "VLLM_WHEELS",
    "BundleError",
    "DeviceCall",
    "acceptance_command",
    "acceptance_module",
    "build_bundle",
    "build_vllm_bundle",
    "folder_bytes",
    "lay_out",
    "lay_out_vllm",
    "main",
    "nrl_extras",
    "plan_seconds",
    "print_chain",
    "vllm_chain",
    "working_tree_bytes",
]


def main(argv: list[str] | None = None) -> int:
    """Build the bundle; print each carry folder with its size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the bundle folder (e.g. .gpu-bundle)")
    parser.add_argument(
        "--carry-mib",
        type=float,
        default=CARRY_MIB,
        help="size bound of each carry folder; with the working tree (~3 MiB) it must stay "
        "under the device tool's 64 MiB per command",
    )
    parser.add_argument("--also", default="", help="more locked packages, comma-separated")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help=f"also build vLLM {VLLM_VERSION}'s bundle into OUT/vllm and print the chain of "
        "device calls that runs the acceptance and then nrl with vLLM on the GPU",
    )
    args = parser.parse_args(argv)
    if args.carry_mib <= 1:
        print(f"error: --carry-mib must be above 1; got {args.carry_mib:g}", file=sys.stderr)
        return 2
    tree = working_tree_bytes()
    if args.vllm and tree / 2**20 + args.carry_mib > TRAVEL_MAX_MIB:
        print(
            f"error: --carry-mib {args.carry_mib:g} plus the working tree "
            f"({tree / 2**20:.1f} MiB) exceeds the {TRAVEL_MAX_MIB:g} MiB a device call carries; "
            "lower --carry-mib",
            file=sys.stderr,
        )
        return 2
    also = [n.strip() for n in args.also.split(",") if n.strip()]
    out = args.out.resolve()
    try:
        folders = build_bundle(out, args.carry_mib, also)
        vllm_folders = build_vllm_bundle(out / "vllm", args.carry_mib) if args.vllm else []
    except (BundleError, subprocess.CalledProcessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, group in (("bundle", folders), (f"vllm {VLLM_VERSION} bundle", vllm_folders)):
        if not group:
            continue
        total = 0
        for folder in group:
            size = folder_bytes(folder)
            total += size
            print(f"{folder}: {size / 2**20:.1f} MiB, {len(list(folder.iterdir()))} files")
        print(f"{name}: {total / 2**20:.1f} MiB in {len(group)} carry folders")
    if args.vllm:
        if len(folders) != 1:
            print(
                f"error: nrl's bundle takes {len(folders)} carry folders; the chain's first call "
                "carries one: raise --carry-mib",
                file=sys.stderr,
            )
            return 1
        print(f"working tree: {tree / 2**20:.1f} MiB (travels with every call)")
        print_chain(vllm_chain(folders[0], vllm_folders), tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
