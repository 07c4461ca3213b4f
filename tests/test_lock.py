"""The lockfile gives every actor venv one NCCL.

vLLM, SGLang and the policy plugins resolve different torch builds (each engine pins its own),
and each runs in its own venv; NCCL refuses a communicator whose ranks load different NCCL
versions, so a refit group between a policy rank and an engine could never form. pyproject's
``override-dependencies`` pins the one NCCL; this test keeps the lock that way.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu_sim
LOCK = Path(__file__).resolve().parents[1] / "uv.lock"


def _packages() -> list[dict]:
    return tomllib.loads(LOCK.read_text())["package"]


def test_every_torch_in_the_lock_loads_the_same_nccl():
    packages = _packages()
    nccl = {(p["name"], p["version"]) for p in packages if p["name"].startswith("nvidia-nccl")}
    assert len(nccl) == 1, f"several NCCL builds in uv.lock: {sorted(nccl)}"
    (name, version) = next(iter(nccl))
    torches = [p for p in packages if p["name"] == "torch"]
    assert len(torches) >= 2  # the point of the check: the engines pin different torch builds
    for torch in torches:
        deps = [d for d in torch.get("dependencies", []) if d["name"].startswith("nvidia-nccl")]
        assert deps, f"torch {torch['version']} has no NCCL dependency in the lock"
        for dep in deps:
            assert (dep["name"], dep.get("version", version)) == (name, version), torch["version"]
