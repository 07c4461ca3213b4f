"""The actor venvs on disk: listing and cleaning them (``nrl venvs list`` / ``clean``), the
launchers ``nrl venvs build --bin`` writes, and the container image's manifest (a checkout
mounted over an image must match the lockfile the image was built from). Re-exported by
:mod:`nrl_core.distributed.actor_env`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import attrs

from nrl_core.distributed.errors import ActorEnvError, ImageMismatchError
from nrl_core.distributed.venv_spec import (
    CONTAINER_VAR,
    DEFAULT_MANIFEST,
    FORCE_VAR,
    IGNORE_MISMATCH_VAR,
    MANIFEST_FILES,
    MANIFEST_VAR,
    VenvRequest,
    _beside_workspace_fingerprint,
    _truthy,
    file_hash,
    find_workspace_root,
    read_marker,
    venv_is_ready,
)

# ---------------------------------------------------------------------------------------------
# Listing, cleaning, launchers


@attrs.frozen
class VenvEntry:
    """One venv found under a venv root, for ``nrl venvs list``."""

    path: Path
    distribution: str
    plugin: str
    extras: tuple[str, ...]
    mode: str
    fingerprint: str
    size_bytes: int
    status: Literal["fresh", "stale", "broken"]
    variant: str = ""
    """``cpu`` for a :class:`CpuInstall` venv."""

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "plugin": self.plugin,
            "distribution": self.distribution,
            "extras": list(self.extras),
            "mode": self.mode,
            "lock_hash": self.fingerprint,
            "size_bytes": self.size_bytes,
            "status": self.status,
            "variant": self.variant,
        }


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def current_fingerprint(request: VenvRequest) -> str | None:
    """What ``request.fingerprint`` would be today (None when it cannot be known)."""
    lock = Path(request.workspace) / "uv.lock" if request.workspace else None
    if request.mode == "workspace" and lock is not None:
        return file_hash(lock)[:16] if lock.is_file() else None
    try:
        dist = metadata.distribution(request.distribution)
    except metadata.PackageNotFoundError:
        return None
    if lock is not None:  # installed beside a checkout
        return _beside_workspace_fingerprint(dist, lock.parent) if lock.is_file() else None
    return dist.version


def list_venvs(venv_root: str | Path) -> list[VenvEntry]:
    """Every venv under ``venv_root`` with its status: fresh, stale (lock changed), broken."""
    root = Path(venv_root)
    entries = []
    for venv in sorted(p for p in root.glob("*") if p.is_dir() and not p.name.startswith(".")):
        marker = read_marker(venv)
        if marker is None:
            entries.append(VenvEntry(venv, venv.name, "", (), "?", "", _size(venv), "broken"))
            continue
        request = VenvRequest.from_json(marker)
        if not venv_is_ready(venv, request):
            status = "broken"
        elif current_fingerprint(request) != request.fingerprint:
            status = "stale"
        else:
            status = "fresh"
        entries.append(
            VenvEntry(
                venv,
                request.distribution,
                request.plugin,
                request.extras,
                request.mode,
                request.fingerprint,
                _size(venv),
                status,
                request.variant,
            )
        )
    return entries


def clean_venvs(venv_root: str | Path, stale_only: bool = False) -> list[Path]:
    """Remove the venvs under ``venv_root`` (only stale and broken ones with ``stale_only``)."""
    removed = []
    for entry in list_venvs(venv_root):
        if stale_only and entry.status == "fresh":
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def write_launcher(bin_dir: str | Path, name: str, python: str | Path) -> Path:
    """Write an executable ``bin_dir/name`` that runs ``python`` with its arguments."""
    bin_path = Path(bin_dir)
    bin_path.mkdir(parents=True, exist_ok=True)
    launcher = bin_path / name
    launcher.write_text(f'#!/bin/sh\n# Written by `nrl venvs build`.\nexec "{python}" "$@"\n')
    launcher.chmod(0o755)
    return launcher


def launcher_name(plugin: str, extras: Sequence[str], taken: set[str]) -> str:
    """``python-<plugin>``, with the extras appended when the plain name is taken."""
    name = f"python-{plugin}"
    if name in taken and extras:
        name = f"python-{plugin}-{'-'.join(sorted(extras))}"
    return name


# ---------------------------------------------------------------------------------------------
# Container image vs checkout


def write_image_manifest(path: str | Path | None = None, workspace: Path | None = None) -> Path:
    """Record the sha256 of ``pyproject.toml`` and ``uv.lock`` (run when building an image)."""
    workspace = workspace or find_workspace_root()
    if workspace is None:
        raise ActorEnvError("no uv.lock found above nrl_core; run this in an nrl checkout")
    target = Path(path or os.environ.get(MANIFEST_VAR) or DEFAULT_MANIFEST)
    target.parent.mkdir(parents=True, exist_ok=True)
    files = {
        name: file_hash(workspace / name) for name in MANIFEST_FILES if (workspace / name).is_file()
    }
    target.write_text(json.dumps({"workspace": str(workspace), "files": files}, indent=2))
    return target


def check_image_manifest(
    workspace: Path | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """With ``NRL_CONTAINER=1``, stop when the checkout's pyproject/lock differ from the image's.

    Returns the names of the changed files (empty when they match or outside containers).
    ``NRL_IGNORE_VERSION_MISMATCH=1`` turns the error into a warning on stderr.
    """
    environ = os.environ if environ is None else environ
    if not _truthy(environ.get(CONTAINER_VAR)):
        return []
    workspace = workspace or find_workspace_root()
    manifest_path = Path(environ.get(MANIFEST_VAR) or DEFAULT_MANIFEST)
    if workspace is None:
        return []
    try:
        recorded = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError):
        print(
            f"nrl: warning: {CONTAINER_VAR}=1 but the image manifest {manifest_path} is "
            "missing or unreadable; skipping the image/checkout check",
            file=sys.stderr,
        )
        return []
    changed = [
        name
        for name in MANIFEST_FILES
        if (workspace / name).is_file() and recorded.get(name) != file_hash(workspace / name)
    ]
    if not changed:
        return []
    message = (
        f"the checkout's {' and '.join(changed)} differ from the ones this container image was "
        f"built with ({manifest_path}); the image's actor venvs may not match the code. "
        "Ways out: (1) rebuild the image; (2) rebuild the venvs here with "
        f"{FORCE_VAR}=1; (3) set {IGNORE_MISMATCH_VAR}=1 to proceed at your own risk"
    )
    if _truthy(environ.get(IGNORE_MISMATCH_VAR)):
        print(f"nrl: warning: {message}", file=sys.stderr)
        return changed
    raise ImageMismatchError(message)
