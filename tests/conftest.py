"""Shared fixtures of the core test suite."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

# CPU engines keep the GPU engines' memory contract (nrl_core.memory_contract): set before any
# Ray cluster or engine starts, so every actor and `nrl` subprocess inherits it.
os.environ.setdefault("NRL_MEMORY_CONTRACT", "1")


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """Install a plugin distribution into a temporary site directory, the way pip lays it out.

    ``installed_plugin(dist, entry_name, module, code)`` writes ``module.py`` with ``code`` and a
    ``<dist>-<version>.dist-info`` folder whose ``entry_points.txt`` names it in the
    ``nrl.plugins`` group, then puts the directory on ``sys.path`` so that
    ``importlib.metadata`` discovers it exactly as it discovers a pip-installed plugin.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created_modules: list[str] = []

    def install(dist: str, entry_name: str, module: str, code: str, version: str = "1.0") -> Path:
        (site / f"{module}.py").write_text(textwrap.dedent(code))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[nrl.plugins]\n{entry_name} = {module}\n")
        created_modules.append(module)
        importlib.invalidate_caches()
        return info

    yield install
    for module in created_modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _no_plugin_selection_from_env(monkeypatch):
    """Tests choose plugins explicitly; a developer's NRL_PLUGINS must not leak in."""
    monkeypatch.delenv("NRL_PLUGINS", raising=False)
