"""Write-temp-then-rename: a reader sees the old file (or folder) or the new one, never half.

Everything nrl replaces on disk goes through here: a checkpoint's ``step_N`` folder, the run's
``config.yaml``, ``nrl convert``'s output files (:func:`fill_dir`: only its own names) and the
GRPO reference snapshot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def temp_sibling(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """A fresh hidden name next to ``path`` (same folder, hence the same filesystem, so the
    final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{tag}_{path.name}_{uuid.uuid4().hex[:8]}")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` with ``text``: written and fsynced under a temporary name,
    then renamed over ``path``."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete folder ``tmp`` to ``final``, replacing a folder already there.

    POSIX cannot rename over a non-empty folder, so an existing ``final`` is first renamed
    aside, then ``tmp`` renamed in, then the old one removed: at no time does ``final`` hold a
    mix of the two. (A crash between the two renames leaves no ``final``, with the old folder
    kept aside under a hidden ``.replaced_*`` name.)
    """
    tmp, final = Path(tmp), Path(final)
    aside = None
    if final.exists() or final.is_symlink():
        aside = temp_sibling(final, "replaced")
        final.rename(aside)
    try:
        tmp.rename(final)
    except BaseException:
        if aside is not None:
            aside.rename(final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _empty_sibling(final: str | os.PathLike) -> tuple[Path, Path]:
    """``final`` as a Path, and a new empty temporary folder beside it (same file system, so
    the rename into place is atomic); ``final``'s parent is created if missing."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final)
    tmp.mkdir()
    return final, tmp


@contextlib.contextmanager
def new_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder next to ``final`` to fill; on success it replaces ``final``
    (:func:`replace_dir`), on error it is removed and ``final`` is left as it was."""
    final, tmp = _empty_sibling(final)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class EntryConflict(OSError):
    """:func:`fill_dir` would replace a folder with a file (or a file with a folder) that the
    writer did not make: nothing was moved."""


@contextlib.contextmanager
def fill_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder next to ``final`` to fill; on success its entries are moved into
    ``final``, replacing only the entries of the same name: nothing else in ``final`` is
    removed or changed (the user's own files and folders beside a model export survive).

    ``final`` missing or an empty folder: the filled folder is renamed to it (all or
    nothing). Otherwise entries are moved one by one with ``os.replace`` (each file whole,
    the set of files not atomically); a subfolder of the same name on both sides is filled
    the same way, and an entry that would replace a folder with a file, a file with a folder,
    or write through a symbolic link, is :class:`EntryConflict`, raised before anything is
    moved. On any error the temporary folder is removed.
    """
    final, tmp = _empty_sibling(final)
    try:
        yield tmp
        try:
            tmp.rename(final)  # final missing, or an empty folder (rename replaces it)
        except OSError:
            if not final.is_dir():  # a file in the way (a link to a folder is filled)
                raise
            _check_merge(tmp, final)
            _merge(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_merge(src: Path, dest: Path) -> None:
    for entry in src.iterdir():
        there = dest / entry.name
        if not there.exists() and not there.is_symlink():
            continue
        if entry.is_dir():
            if there.is_symlink() or not there.is_dir():
                raise EntryConflict(
                    f"{there} is not a folder, and a folder of that name was written"
                )
            _check_merge(entry, there)
        elif there.is_dir() and not there.is_symlink():
            raise EntryConflict(f"{there} is a folder, and a file of that name was written")


def _merge(src: Path, dest: Path) -> None:
    for entry in src.iterdir():
        there = dest / entry.name
        if entry.is_dir() and there.is_dir() and not there.is_symlink():
            _merge(entry, there)
        else:
            os.replace(entry, there)  # a symbolic link there is replaced, never written through
