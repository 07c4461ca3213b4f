"""nrl's bundle: the locked wheels the GPU image lacks (downloaded by URL and hash from
``uv.lock``), Ray's slimmed, the build backend, laid out in carry folders with ``install.sh``."""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
"""benchmarks/."""
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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(wheel: dict, into: Path) -> Path:
    """Fetch ``wheel`` into ``into`` (kept when already there with the right hash)."""
    target = into / wheel["filename"]
    if target.exists() and sha256_of(target) == wheel["sha256"]:
        return target
    partial = target.with_suffix(".download")
    with urllib.request.urlopen(wheel["url"], timeout=300) as response, partial.open("wb") as f:
        shutil.copyfileobj(response, f, 1 << 20)
    got = sha256_of(partial)
    if got != wheel["sha256"]:
        partial.unlink()
        raise BundleError(f"{wheel['filename']}: sha256 {got} != locked {wheel['sha256']}")
    partial.rename(target)
    return target


def slim_wheel(path: Path, drop: tuple[str, ...]) -> Path:
    """Rewrite the wheel at ``path`` without the members under ``drop`` (and their ``RECORD``
    lines, so the wheel stays valid for pip); kept members and their recorded hashes are
    unchanged. Returns ``path``.

    Kept members are copied as they are compressed in the wheel, not decompressed and
    compressed again: recompressing at level 9 cost 17 CPU-s for Ray's wheel and 45 for vLLM's
    (2-core machine) and gave sizes within 0.3% of the copied bytes (Ray's 42.50 MB against
    42.45, vLLM's 109.70 against 109.97). pip checks every kept file against ``RECORD`` when
    it installs the wheel."""
    import copy
    import struct
    import zipfile

    partial = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(partial, "w") as target:
        for info in source.infolist():
            if info.filename.startswith(drop):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                lines = source.read(info).decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith(drop)).encode()
                target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                continue
            # The member's local header (30 bytes, then its name and extra field) and its
            # compressed bytes, read raw; a fresh local header with the sizes and CRC in it
            # (no trailing data descriptor), then the same bytes.
            source.fp.seek(info.header_offset)
            header = source.fp.read(30)
            if header[:4] != b"PK\x03\x04":
                raise BundleError(f"{path.name}: {info.filename}: not a zip local header")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            source.fp.seek(name_len + extra_len, 1)
            raw = source.fp.read(info.compress_size)
            kept = copy.copy(info)
            kept.flag_bits &= ~0x08
            kept.extra = b""
            kept.header_offset = target.fp.tell()
            target.fp.write(kept.FileHeader())
            target.fp.write(raw)
            target.filelist.append(kept)
            target.NameToInfo[kept.filename] = kept
            target.start_dir = target.fp.tell()
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
    pins = {(normal_name(r.split("==")[0]), r.split("==")[1]) for r in requirements}
    found = [p for p in into.glob("*.whl") if pin_of(p.name) in pins]
    return sorted(found)


def pin_of(filename: str) -> tuple[str, str]:
    """``(normalised name, version)`` of a wheel file."""
    name, version = filename.split("-")[:2]
    return normal_name(name), version


def normal_name(name: str) -> str:
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
            path = slimmed_copy(path, out, SLIM[wheel["name"]])
        files.append(path)
    return files + pip_download(BUILD_BACKEND, staging)


def slimmed_copy(path: Path, out: Path, drop: tuple[str, ...]) -> Path:
    slimmed = out / "slim" / path.name
    slimmed.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, slimmed)
    return slim_wheel(slimmed, drop)


def lay_out(files: list[Path], out: Path, carry_mib: float, extras: dict[str, str]) -> list[Path]:
    """Cut ``files`` larger than ``carry_mib`` into parts and pack everything, ``extras``
    (name -> text) first, into folders ``out/carry1``, ``out/carry2``... of at most
    ``carry_mib`` each (first-fit decreasing); ``SHA256SUMS`` (of the whole files) is added to
    ``extras``. Returns the folders."""
    sums = {p.name: sha256_of(p) for p in files}
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
