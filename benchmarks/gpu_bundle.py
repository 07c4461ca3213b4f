"""Prepare the wheels a lent GPU machine lacks for benchmarks/gpu_acceptance.py.

    uv run python benchmarks/gpu_bundle.py DIR [--carry-mib 48] [--also NAME,...]

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
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

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
    pip`` when this interpreter has no pip)."""
    args = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--platform",
        "manylinux_2_28_x86_64",
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
    names = {r.split("==")[0].replace("-", "_").lower() for r in requirements}
    return sorted(p for p in into.glob("*.whl") if p.name.split("-")[0].lower() in names)


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
python3 -c "import ray, cattrs, nrl_core, nrl_dtensor, nrl_math_env; print('nrl bundle installed')"
"""

README_TXT = """nrl GPU bundle: wheels for CPython 3.12 on manylinux x86_64 that the GPU image lacks.

{listing}

On the GPU machine, once every carry folder's files are in one staging folder:
    sh install.sh STAGING_DIR REPO_DIR
(joins the split parts, checks SHA256SUMS, then `pip install --no-index --no-deps` the wheels
and nrl's own packages in editable mode). The step-by-step device commands:
benchmarks/README.md in the repository.
"""


def build_bundle(out: Path, carry_mib: float, also: list[str]) -> list[Path]:
    """Download, split and lay out the bundle under ``out``; return the carry folders."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    staging = out / "downloads"
    staging.mkdir(parents=True, exist_ok=True)
    wheels = locked_wheels(lock, [*MISSING, *also])
    files = []
    for wheel in wheels:
        path = download(wheel, staging)  # checked against the lock's hash first
        if wheel["name"] in SLIM:
            slimmed = out / "slim" / path.name
            slimmed.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, slimmed)
            path = slim_wheel(slimmed, SLIM[wheel["name"]])
        files.append(path)
    files += pip_download(BUILD_BACKEND, staging)
    sums = {p.name: _sha256(p) for p in files}
    listing = "\n".join(f"  {p.name}  ({p.stat().st_size / 2**20:.1f} MiB)" for p in files)

    limit = int(carry_mib * 2**20)
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
    extras = {
        "install.sh": INSTALL_SH.replace(
            "{editables}", " ".join(f'-e "$repo/{p}"' for p in NRL_PACKAGES)
        ),
        "SHA256SUMS": "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())),
        "README.txt": README_TXT.format(listing=listing),
    }
    # First-fit decreasing into folders of at most `limit` bytes; the small files go first.
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

    for name, text in extras.items():
        (place(name, len(text.encode())) / name).write_text(text)
    for piece in sorted(pieces, key=lambda p: p.stat().st_size, reverse=True):
        shutil.move(piece, place(piece.name, piece.stat().st_size) / piece.name)
    work.rmdir()
    return [folder for folder, _ in folders]


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
    args = parser.parse_args(argv)
    if args.carry_mib <= 1:
        print(f"error: --carry-mib must be above 1; got {args.carry_mib:g}", file=sys.stderr)
        return 2
    also = [n.strip() for n in args.also.split(",") if n.strip()]
    try:
        folders = build_bundle(args.out.resolve(), args.carry_mib, also)
    except (BundleError, subprocess.CalledProcessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = 0
    for folder in folders:
        size = sum(p.stat().st_size for p in folder.iterdir())
        total += size
        print(f"{folder}: {size / 2**20:.1f} MiB, {len(list(folder.iterdir()))} files")
    print(f"bundle: {total / 2**20:.1f} MiB in {len(folders)} carry folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
