"""The vLLM chain: vLLM's bundle (its wheel slimmed, the wheels it needs) in carry folders of its
own, and the device calls that carry it after nrl's bundle and the acceptance, with the plan
of device time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from .wheels import (
    HERE,
    MISSING,
    REPO,
    BundleError,
    install_sh,
    lay_out,
    normal_name,
    pin_of,
    pip_download,
    sha256_of,
    slimmed_copy,
)

VLLM_VERSION = "0.26.0"
"""The newest vLLM that pins ``torch==2.11.0``, the lent machines' torch (2.11.0+cu130); its
extensions target CUDA 13 and carry sm_90 kernels (the shared reference "vLLM on the GPU
machine", §1). nrl's own pin, 0.32.0, needs torch 2.13 (docs/performance.md)."""

VLLM_WHEELS = HERE / f"vllm-{VLLM_VERSION}-wheels.txt"
"""Its pinned requirements that the GPU image lacks (one ``name==version`` a line)."""

VLLM_SLIM = (
    # FlashAttention 2: on sm_90 vLLM picks FA3; FA2 serves ALiBi and pre-Hopper GPUs only.
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    # MoE kernels (its import is guarded): a dense Qwen2 never calls them.
    "vllm/_moe_C_stable_libtorch.abi3.so",
    # The opt-in Rust HTTP front end (VLLM_RUST_FRONTEND_PATH).
    "vllm/vllm-rs",
    # Blackwell / FA4 CuTe-DSL sources; without cute/ vLLM reports FA4 unavailable.
    "vllm/third_party/fmha_sm100/",
    "vllm/third_party/tml_fa4/",
    "vllm/vllm_flash_attn/cute/",
    # DeepGEMM (FP8) for other Pythons than the image's 3.12, and its torch>=2.12 extension.
    *(f"vllm/third_party/deep_gemm/_C.cpython-3{v}-x86_64-linux-gnu.so" for v in (10, 11, 13, 14)),
    "vllm/third_party/deep_gemm/_C_extension.abi3.so",
)
"""Members of the vLLM wheel left out (289.6 -> 104.6 MiB, measured 2026-11-28): none is loaded
by a bf16 dense model on a Hopper GPU (reference §2)."""

VLLM_STAGE = "/tmp/nrl-vllm-bundle"
"""Where each device call leaves its carry folder's files, until the last call installs them
(the machine keeps ``/tmp`` while it stays warm between calls)."""

DEVICE_BUDGET_S = 15 * 60
"""Device time of a session, every start, transfer, idle gap and command counted."""
COMMAND_MAX_S = 600
"""One device command's limit (``timeout_s`` at most)."""
COMMAND_MAX_CHARS = 2000
"""The device tool's limit on a command line."""
TRAVEL_MAX_MIB = 64.0
"""What travels with one call, the working tree and the carried folders together."""
START_S = 90
"""Estimate: a machine's start (the tool's README: "a minute or more"; not measured here)."""
GAP_S = 15
"""Estimate: the idle time between a reply and the next call, counted as device time (the
machine goes back after 30 s idle: every command is printed beforehand)."""
TRANSFER_MIB_PER_S = 2.5
"""Estimate of the transfer rate to the machine (not measured: the H100 run's whole 48 MiB
call with its 164-s command took about 3 minutes of device time, start included)."""
STASH_S = 5
"""Estimate of one stash command (copy <= 58 MiB, hash it)."""
VLLM_INSTALL_S = 25
"""Estimate: join, hash and ``pip install --no-deps`` the vLLM bundle (~85 wheels, ~480 MiB
installed; 4-15 s on this 2-core machine) and nrl-vllm in editable mode."""
VLLM_RUN_S = 150
"""Estimate of ``benchmarks/gpu_vllm.py`` (2 GRPO steps with a vLLM engine start and a
validation every step, on the acceptance's model); its own limit is :data:`VLLM_RUN_LIMIT_S`."""
VLLM_RUN_LIMIT_S = 420
"""``gpu_vllm.py --budget-s``: it stops the run there and still writes its JSON."""


class DeviceCall(NamedTuple):
    """One call of the device tool's ``run``, prepared here."""

    command: str
    carry: tuple[str, ...]
    timeout_s: int
    estimate_s: int
    """Expected command time (the plan's figure; ``timeout_s`` is its cap)."""
    carry_bytes: int
    """Bytes of the carried folders (the working tree travels besides)."""
    note: str


def transfer_s(mib: float) -> float:
    """Estimated seconds to carry ``mib`` MiB to the machine."""
    return mib / TRANSFER_MIB_PER_S


def plan_seconds(calls: list[DeviceCall], tree_bytes: int) -> float:
    """Device time of ``calls`` made back to back on one machine: its start, then for each call
    the idle gap before it (not before the first), the transfer of the working tree and the
    carried folders, and the command's estimate."""
    total = float(START_S)
    for i, call in enumerate(calls):
        total += (GAP_S if i else 0) + transfer_s((tree_bytes + call.carry_bytes) / 2**20)
        total += call.estimate_s
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def working_tree_bytes() -> int:
    """Bytes of what travels with every call besides ``carry``: the tracked files and the
    untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (REPO / f.decode()).stat().st_size for f in listed if f and (REPO / f.decode()).is_file()
    )


STASH_SH = """#!/bin/sh
# One device call of the vLLM chain: sh stash.sh CARRY_FOLDER
# Copies this call's files to the staging folder and checks every piece that the calls so far
# brought; a piece of an earlier call that is missing means a fresh machine (the last one went
# back): exit 3, start again from the first vLLM call.
set -eu
src=$(cd "$1" && pwd)
stage=${{NRL_VLLM_STAGE:-{stage}}}
k=$(cat "$src/CALL")
mkdir -p "$stage"
cp "$src"/* "$stage"/
cd "$stage"
# The first call (nrl's bundle and the acceptance) installed ray and nrl: a machine without them
# is a fresh one.
if ! python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('ray') and u.find_spec('nrl_dtensor')))"; then
    echo "LOST: nrl's bundle is not installed here (a fresh machine): start again from the first call"
    exit 3
fi
lost=$(awk -v k="$k" '$1 <= k {{ print $3 }}' PIECES | while read -r f; do [ -e "$f" ] || echo "$f"; done)
if [ -n "$lost" ]; then
    echo "LOST: $(echo "$lost" | wc -l) pieces of earlier calls are not in $stage: a fresh machine; start again from the first vLLM call"
    exit 3
fi
awk -v k="$k" '$1 <= k {{ print $2 "  " $3 }}' PIECES | sha256sum -c --quiet
echo "stash: call $k of $(cat CALLS) checked ($(du -sm "$stage" | cut -f1) MiB in $stage)"
"""


def vllm_wheels(out: Path) -> list[Path]:
    """Download vLLM :data:`VLLM_VERSION` and the wheels it needs beyond the GPU image and
    nrl's bundle (:data:`VLLM_WHEELS`) into ``out/downloads``; slim vLLM's wheel
    (:data:`VLLM_SLIM`) into ``out/slim``. Returns the wheel files."""
    staging = out / "downloads"
    staging.mkdir(parents=True, exist_ok=True)
    pins = [
        line.strip()
        for line in VLLM_WHEELS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # nrl's bundle (the first call) brings these already; one version of each name.
    pins = [
        r for r in pins if normal_name(r.split("==")[0]) not in {normal_name(m) for m in MISSING}
    ]
    (vllm,) = pip_download((f"vllm=={VLLM_VERSION}",), staging)
    files = [slimmed_copy(vllm, out, VLLM_SLIM), *pip_download(tuple(pins), staging)]
    lacking = sorted(
        {normal_name(r.split("==")[0]) for r in pins} - {pin_of(p.name)[0] for p in files}
    )
    if lacking:
        raise BundleError(f"pip download brought no wheel of {', '.join(lacking)}")
    return files


def lay_out_vllm(files: list[Path], out: Path, carry_mib: float) -> list[Path]:
    """Lay the vLLM bundle's ``files`` out in carry folders under ``out`` (:func:`lay_out`),
    each with ``stash.sh``, its call number (``CALL``, ``CALLS``) and the list of every piece
    (``PIECES``: call, sha256, name); the first folder's ``install.sh`` installs the wheels
    and nrl-vllm in editable mode. Returns the folders."""
    extras = {
        "install.sh": install_sh(("plugins/nrl-vllm",), "nrl_vllm.compat", f"vllm {VLLM_VERSION}"),
        "stash.sh": STASH_SH.format(stage=VLLM_STAGE),
    }
    folders = lay_out(files, out, carry_mib, extras)
    pieces = [(k, p) for k, folder in enumerate(folders, 1) for p in sorted(folder.iterdir())]
    listing = "".join(f"{k} {sha256_of(p)} {p.name}\n" for k, p in pieces)
    for k, folder in enumerate(folders, 1):
        if k > 1:
            shutil.copyfile(folders[0] / "stash.sh", folder / "stash.sh")
        (folder / "CALL").write_text(f"{k}\n")
        (folder / "CALLS").write_text(f"{len(folders)}\n")
        (folder / "PIECES").write_text(listing)
    return folders


def build_vllm_bundle(out: Path, carry_mib: float) -> list[Path]:
    """:func:`vllm_wheels` laid out by :func:`lay_out_vllm`; returns the carry folders."""
    return lay_out_vllm(vllm_wheels(out), out, carry_mib)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def acceptance_command(bundle: str) -> str:
    """The acceptance run (benchmarks/README.md): nrl's bundle installed, every quick stage."""
    return (
        f"sh {bundle}/install.sh {bundle} . && PYTHONUNBUFFERED=1 python3 "
        "benchmarks/gpu_acceptance.py --device cuda --workdir /tmp/nrl-acc --out $OUT/report.json"
        "; tar czf $OUT/logs.tgz -C /tmp/nrl-acc logs grpo/run/nrl.log"
    )


def acceptance_module():
    """benchmarks/gpu_acceptance.py as a module (its plan; stdlib-only at import)."""
    import importlib.util

    if "gpu_acceptance" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_acceptance", HERE / "gpu_acceptance.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules["gpu_acceptance"]


def vllm_chain(nrl_folder: Path, vllm_folders: list[Path], root: Path = REPO) -> list[DeviceCall]:
    """The device calls, in order: nrl's bundle and the GPU acceptance (quick plan), then one
    call per vLLM carry folder; the last one installs vLLM and runs ``gpu_vllm.py`` (2 GRPO
    steps, colocated vLLM, multi-turn) on the model the acceptance built. Carried paths are
    relative to ``root`` (the repository, where the commands run)."""
    gpu_acceptance = acceptance_module()
    nrl = _rel(nrl_folder, root)
    calls = [
        DeviceCall(
            command=acceptance_command(nrl),
            carry=(nrl,),
            # The acceptance's bound for its quick plan (install and every stage at its limit),
            # and the README's timeout for it.
            timeout_s=gpu_acceptance.QUICK_PLAN_S + 60,
            estimate_s=gpu_acceptance.QUICK_PLAN_S,
            carry_bytes=folder_bytes(nrl_folder),
            note="nrl's bundle + the GPU acceptance (quick plan); the vLLM run reuses its model",
        )
    ]
    for k, folder in enumerate(vllm_folders, 1):
        rel = _rel(folder, root)
        command = f"sh {rel}/stash.sh {rel}"
        estimate, timeout = STASH_S, 60
        note = f"vLLM part {k} of {len(vllm_folders)}: stash"
        if k == len(vllm_folders):
            command += (
                f" && sh {VLLM_STAGE}/install.sh {VLLM_STAGE} . && PYTHONUNBUFFERED=1 python3 "
                f"benchmarks/gpu_vllm.py --workdir /tmp/nrl-acc --out $OUT/vllm.json "
                f"--budget-s {VLLM_RUN_LIMIT_S}"
            )
            estimate = STASH_S + VLLM_INSTALL_S + VLLM_RUN_S
            timeout = COMMAND_MAX_S
            note += ", install vLLM, 2-step GRPO with colocated vLLM"
        calls.append(DeviceCall(command, (rel,), timeout, estimate, folder_bytes(folder), note))
    return calls


def print_chain(calls: list[DeviceCall], tree_bytes: int) -> None:
    """The calls to make, in order, each as the device tool's arguments, and the plan."""
    print("\nDevice calls (make each one right after the previous reply; then give_back):")
    used = START_S
    for i, call in enumerate(calls, 1):
        mib = (tree_bytes + call.carry_bytes) / 2**20
        used += (GAP_S if i > 1 else 0) + transfer_s(mib) + call.estimate_s
        args = {"command": call.command, "carry": list(call.carry), "timeout_s": call.timeout_s}
        print(
            f"\n# call {i}: {call.note} ({mib:.1f} MiB travel; ~{used / 60:.1f} device-min after)"
        )
        print(json.dumps(args))
    print(
        f"\nplan: {plan_seconds(calls, tree_bytes) / 60:.1f} of {DEVICE_BUDGET_S / 60:.0f} "
        "device-minutes (start, transfers, gaps, estimates)"
    )
