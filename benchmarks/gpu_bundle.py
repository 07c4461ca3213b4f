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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PYTHON_TAG = "cp312"
"""The GPU image's interpreter (Python 3.12)."""

MISSING = (
    "ray",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "cattrs",
    "megatron-core",
    "tomlkit",
)
"""Locked packages the GPU image lacks (its package list: the device tool's KINDS.md). Ray's
other requirements (click, filelock, msgpack, packaging, protobuf, pyyaml, requests) and nrl's
(pluggy, attrs, rich, pyyaml, filelock, packaging, safetensors) are in the image; ``uv`` is not
needed there (``NRL_ACTOR_ENV=system``: no per-plugin venvs)."""

BUILD_BACKEND = ("hatchling==1.33.0", "trove-classifiers==2026.9.21.13", "editables==0.6")
"""nrl's build backend for ``pip install -e`` without network, and ``editables``, which
hatchling's editable wheels need (its other requirements, packaging, pathspec and pluggy, are
in the image; tomlkit comes from the lock)."""

SLIM = {"ray": ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/")}
"""Folders left out of a wheel (by distribution name): Ray's Java jars (Ray's Java workers),
the dashboard's built web client (static pages; nrl starts no dashboard) and RLlib; none is
imported by ``import ray``, a Ray head, nrl or the acceptance stages."""

CARRY_MIB = 56.0
"""Default size bound of a carry folder: with the working tree (~3 MiB) under the device tool's
64 MiB per command."""

NRL_PACKAGES = (".", "plugins/nrl-dtensor", "plugins/nrl-megatron", "plugins/nrl-math-env")
"""Installed editable from the working tree that travels with each device command."""

WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


class BundleError(Exception):
    """The lockfile has no usable wheel, or a download does not match its hash."""


def _wheel_rank(filename: str) -> int | None:
    """How well a wheel fits CPython 3.12 on manylinux x86_64 (higher is better), or None."""
    match = WHEEL.match(filename)
    if match is None:
        return None
    py, abi, plat = match["py"].split("."), match["abi"], match["plat"]
    linux = any(p.startswith("manylinux") and p.endswith("x86_64") for p in plat.split("."))
    if not (linux or plat == "any"):
        return None
    if PYTHON_TAG in py and abi in (PYTHON_TAG, "abi3", "none"):
        return 3
    # A stable-ABI wheel built for an older CPython 3 runs on 3.12.
    if abi == "abi3" and any(t.startswith("cp3") and int(t[3:]) <= 12 for t in py):
        return 2
    if abi == "none" and any(t in ("py3", "py2") for t in py):
        return 1
    return None


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", version))


def locked_wheels(lock: dict, names: list[str]) -> list[dict]:
    """``{name, version, url, sha256, size, filename}`` of the best wheel of each name in the
    lock (the highest locked version that has one)."""
    chosen = []
    for name in names:
        candidates = []
        for package in lock["package"]:
            if package["name"] != name:
                continue
            for wheel in package.get("wheels", []):
                filename = wheel["url"].rsplit("/", 1)[1]
                rank = _wheel_rank(filename)
                if rank is not None:
                    key = (_version_key(package["version"]), rank)
                    candidates.append((key, package["version"], wheel, filename))
        if not candidates:
            raise BundleError(
                f"uv.lock has no {PYTHON_TAG} manylinux x86_64 wheel of {name!r}; "
                "run `uv lock` or drop it from --also"
            )
        _, version, wheel, filename = max(candidates, key=lambda c: c[0])
        chosen.append(
            {
                "name": name,
                "version": version,
                "url": wheel["url"],
                "sha256": wheel["hash"].removeprefix("sha256:"),
                "size": wheel.get("size"),
                "filename": filename,
            }
        )
    return chosen


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(wheel: dict, into: Path) -> Path:
    """Fetch ``wheel`` into ``into`` (kept when already there with the right hash)."""
    target = into / wheel["filename"]
    if target.exists() and _sha256(target) == wheel["sha256"]:
        return target
    partial = target.with_suffix(".download")
    with urllib.request.urlopen(wheel["url"], timeout=300) as response, partial.open("wb") as f:
        shutil.copyfileobj(response, f, 1 << 20)
    got = _sha256(partial)
    if got != wheel["sha256"]:
        partial.unlink()
        raise BundleError(f"{wheel['filename']}: sha256 {got} != locked {wheel['sha256']}")
    partial.rename(target)
    return target


def slim_wheel(path: Path, drop: tuple[str, ...]) -> Path:
    """Rewrite the wheel at ``path`` without the members under ``drop`` (and their ``RECORD``
    lines, so the wheel stays valid for pip); kept members and their recorded hashes are
    unchanged. Returns ``path``."""
    import zipfile

    partial = path.with_suffix(".slim")
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target,
    ):
        for info in source.infolist():
            if info.filename.startswith(drop):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith(drop)).encode()
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    partial.rename(path)
    return path


def pip_download(requirements: tuple[str, ...], into: Path) -> list[Path]:
    """``pip download`` pinned wheels for the GPU machine's Python (through ``uv run --with
    pip`` when this interpreter has no pip); returns the wheels of these ``name==version`` pins."""
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
    platforms += ["manylinux2014_x86_64", "manylinux1_x86_64"]
    args = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *(a for platform in platforms for a in ("--platform", platform)),
        "-d",
        str(into),
        *requirements,
    ]
    try:
        import pip  # noqa: F401

        command = [sys.executable, "-m", "pip", *args]
    except ImportError:
        command = ["uv", "run", "--no-project", "--with", "pip", "python", "-m", "pip", *args]
    subprocess.run(command, check=True)
    pins = {(_normal(r.split("==")[0]), r.split("==")[1]) for r in requirements}
    found = [p for p in into.glob("*.whl") if _pin(p.name) in pins]
    return sorted(found)


def _pin(filename: str) -> tuple[str, str]:
    """``(normalised name, version)`` of a wheel file."""
    name, version = filename.split("-")[:2]
    return _normal(name), version


def _normal(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: ``-`` and ``.`` as ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def split(path: Path, part_bytes: int) -> list[Path]:
    """Cut ``path`` into ``<name>.part01``, ``.part02``... of at most ``part_bytes`` (equal
    sizes); the original is removed."""
    size = path.stat().st_size
    count = math.ceil(size / part_bytes)
    each = math.ceil(size / count)
    parts = []
    with path.open("rb") as f:
        for i in range(count):
            part = path.with_name(f"{path.name}.part{i + 1:02d}")
            part.write_bytes(f.read(each))
            parts.append(part)
    path.unlink()
    return parts


INSTALL_SH = """#!/bin/sh
# Install the bundle on the GPU machine: sh install.sh STAGING_DIR REPO_DIR
# STAGING_DIR holds the contents of every carry folder; REPO_DIR is nrl's working tree.
set -eu
staging=$(cd "${1:-/tmp/nrl-bundle}" && pwd)
repo=$(cd "${2:-.}" && pwd)
cd "$staging"
for first in *.part01; do
    [ -e "$first" ] || continue
    wheel=${first%.part01}
    cat "$wheel".part[0-9][0-9] > "$wheel.joining"
    mv "$wheel.joining" "$wheel"
    rm -f "$wheel".part[0-9][0-9]
done
sha256sum -c --quiet SHA256SUMS
# --no-compile: Python compiles what it imports on first use; compiling all of Ray's files
# here would spend install time on modules the acceptance never imports.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --no-compile *.whl
cd "$repo"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \\
    {editables}
python3 -c "import {imports}; print('{what} installed')"
"""

README_TXT = """nrl GPU bundle: wheels for CPython 3.12 on manylinux x86_64 that the GPU image lacks.

{listing}

On the GPU machine, once every carry folder's files are in one staging folder:
    sh install.sh STAGING_DIR REPO_DIR
(joins the split parts, checks SHA256SUMS, then `pip install --no-index --no-deps` the wheels
and nrl's own packages in editable mode). The step-by-step device commands:
benchmarks/README.md in the repository.
"""


def gather_nrl_wheels(out: Path, also: list[str]) -> list[Path]:
    """Download (checked against ``uv.lock``'s hashes) and slim nrl's bundle: the wheels the GPU
    image lacks plus the build backend. Returns the wheel files (under ``out``)."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    staging = out / "downloads"
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for wheel in locked_wheels(lock, [*MISSING, *also]):
        path = download(wheel, staging)  # checked against the lock's hash first
        if wheel["name"] in SLIM:
            path = _slimmed_copy(path, out, SLIM[wheel["name"]])
        files.append(path)
    return files + pip_download(BUILD_BACKEND, staging)


def _slimmed_copy(path: Path, out: Path, drop: tuple[str, ...]) -> Path:
    slimmed = out / "slim" / path.name
    slimmed.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, slimmed)
    return slim_wheel(slimmed, drop)


def lay_out(files: list[Path], out: Path, carry_mib: float, extras: dict[str, str]) -> list[Path]:
    """Cut ``files`` larger than ``carry_mib`` into parts and pack everything, ``extras``
    (name -> text) first, into folders ``out/carry1``, ``out/carry2``... of at most
    ``carry_mib`` each (first-fit decreasing); ``SHA256SUMS`` (of the whole files) is added to
    ``extras``. Returns the folders."""
    sums = {p.name: _sha256(p) for p in files}
    extras = {
        **extras,
        "SHA256SUMS": "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())),
    }
    limit = int(carry_mib * 2**20)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("carry*"):
        shutil.rmtree(old)
    work = out / "split"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    pieces: list[Path] = []
    for path in files:
        copy = work / path.name
        shutil.copyfile(path, copy)
        pieces += split(copy, limit) if copy.stat().st_size > limit else [copy]
    folders: list[tuple[Path, int]] = []

    def place(name: str, size: int) -> Path:
        for i, (folder, used) in enumerate(folders):
            if used + size <= limit:
                folders[i] = (folder, used + size)
                return folder
        folder = out / f"carry{len(folders) + 1}"
        folder.mkdir()
        folders.append((folder, size))
        return folder

    # The small files go first, so that they share the first folder.
    for name, text in extras.items():
        (place(name, len(text.encode())) / name).write_text(text)
    for piece in sorted(pieces, key=lambda p: p.stat().st_size, reverse=True):
        shutil.move(piece, place(piece.name, piece.stat().st_size) / piece.name)
    work.rmdir()
    return [folder for folder, _ in folders]


def install_sh(editables: tuple[str, ...], imports: str, what: str) -> str:
    """:data:`INSTALL_SH` for a bundle that installs ``editables`` (paths in the working tree)
    and checks itself by importing ``imports``."""
    return (
        INSTALL_SH.replace("{editables}", " ".join(f'-e "$repo/{p}"' for p in editables))
        .replace("{imports}", imports)
        .replace("{what}", what)
    )


def nrl_extras(files: list[Path]) -> dict[str, str]:
    """``install.sh`` and ``README.txt`` of nrl's bundle of ``files``."""
    listing = "\n".join(f"  {p.name}  ({p.stat().st_size / 2**20:.1f} MiB)" for p in files)
    return {
        "install.sh": install_sh(
            NRL_PACKAGES, "ray, cattrs, nrl_core, nrl_dtensor, nrl_math_env", "nrl bundle"
        ),
        "README.txt": README_TXT.format(listing=listing),
    }


def build_bundle(out: Path, carry_mib: float, also: list[str]) -> list[Path]:
    """Download, split and lay out nrl's bundle under ``out``; return the carry folders."""
    files = gather_nrl_wheels(out, also)
    return lay_out(files, out, carry_mib, nrl_extras(files))


# ---------------------------------------------------------------------------------------------
# The vLLM chain: nrl's bundle and the acceptance in the first device call, vLLM in the next ones

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
    pins = [r for r in pins if _normal(r.split("==")[0]) not in {_normal(m) for m in MISSING}]
    (vllm,) = pip_download((f"vllm=={VLLM_VERSION}",), staging)
    files = [_slimmed_copy(vllm, out, VLLM_SLIM), *pip_download(tuple(pins), staging)]
    lacking = sorted({_normal(r.split("==")[0]) for r in pins} - {_pin(p.name)[0] for p in files})
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
    listing = "".join(f"{k} {_sha256(p)} {p.name}\n" for k, p in pieces)
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
