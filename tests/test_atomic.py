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
