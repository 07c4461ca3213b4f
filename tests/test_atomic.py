"""Write-temp-then-rename: readers see the old content or the new one, never a mix or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core import atomic


def test_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old")
    atomic.write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_new_dir_replaces_a_folder_only_when_complete(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic.new_dir(final) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("export failed")
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    with atomic.new_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in final.iterdir()] == ["new.txt"]  # nothing of the old folder mixed in
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_replace_dir_restores_the_old_folder_when_the_move_fails(tmp_path, monkeypatch):
    final, tmp = tmp_path / "out", tmp_path / "new"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp.mkdir()
    real_rename = Path.rename

    def rename(self, target):
        if self == tmp:
            raise OSError("cross-device")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="cross-device"):
        atomic.replace_dir(tmp, final)
    assert (final / "old.txt").read_text() == "old"


def test_fill_dir_replaces_only_its_own_names(tmp_path):
    """Issue 47 (`nrl convert --overwrite`): the filled folder's entries replace those of the
    same name; everything else in the final folder is left as it was."""
    final = tmp_path / "out"
    (final / "sub").mkdir(parents=True)
    (final / "mine.txt").write_text("mine")
    (final / "sub" / "mine.bin").write_bytes(b"\x00\x01")
    (final / "config.json").write_text("stale")
    (final / "sub" / "shared.txt").write_text("stale")
    with atomic.fill_dir(final) as tmp:
        (tmp / "config.json").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "shared.txt").write_text("new")
    assert (final / "mine.txt").read_text() == "mine"
    assert (final / "sub" / "mine.bin").read_bytes() == b"\x00\x01"
    assert (final / "config.json").read_text() == "new"
    assert (final / "sub" / "shared.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_fill_dir_into_a_missing_or_empty_folder_is_one_rename(tmp_path):
    for final in (tmp_path / "new", tmp_path / "empty"):
        if final.name == "empty":
            final.mkdir()
        with atomic.fill_dir(final) as tmp:
            (tmp / "a.txt").write_text("a")
        assert [p.name for p in final.iterdir()] == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]


def test_fill_dir_never_replaces_a_folder_it_did_not_write(tmp_path):
    """A file written under the name of the user's folder (or a folder under the name of the
    user's file, or of a link) is refused before anything moves; on an error in the body the
    final folder is untouched too."""
    final = tmp_path / "out"
    (final / "config.json").mkdir(parents=True)
    (final / "config.json" / "theirs.txt").write_text("theirs")
    (final / "weights").write_text("a file")
    (tmp_path / "elsewhere").mkdir()
    (final / "linked").symlink_to(tmp_path / "elsewhere")
    conflict = pytest.raises(atomic.EntryConflict, match=r"config\.json is a folder")
    with conflict, atomic.fill_dir(final) as tmp:
        (tmp / "a.txt").write_text("a")
        (tmp / "config.json").write_text("{}")
    with (
        pytest.raises(atomic.EntryConflict, match="weights is not a folder"),
        atomic.fill_dir(final) as tmp,
    ):
        (tmp / "weights").mkdir()
    with (
        pytest.raises(atomic.EntryConflict, match="linked is not a folder"),
        atomic.fill_dir(final) as tmp,
    ):
        (tmp / "linked").mkdir()
        (tmp / "linked" / "x.txt").write_text("x")
    with pytest.raises(RuntimeError), atomic.fill_dir(final) as tmp:
        (tmp / "a.txt").write_text("a")
        raise RuntimeError("export failed")
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "linked", "weights"]
    assert (final / "config.json" / "theirs.txt").read_text() == "theirs"
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]
