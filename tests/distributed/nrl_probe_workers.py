"""A worker that reports what its actor's interpreter imports, for the actor-venv tests.

Imported inside Ray actors from its target string (this folder is on the actors'
``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import sys


class ProbeWorker:
    """Answers where modules come from in this actor."""

    def __init__(self, *args, **kwargs):
        pass

    def modules(self, names: list[str]) -> dict[str, dict[str, str | None]]:
        """``{name: {"file": ..., "version": ...}}``; ``file`` is None when it does not import."""
        found: dict[str, dict[str, str | None]] = {}
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError:
                found[name] = {"file": None, "version": None}
                continue
            found[name] = {
                "file": getattr(module, "__file__", None),
                "version": getattr(module, "__version__", None),
            }
        return found

    def python(self) -> str:
        return sys.executable

    def environ(self, names: list[str]) -> dict[str, str | None]:
        """The values of environment variables ``names`` in this actor."""
        import os

        return {name: os.environ.get(name) for name in names}

    def which(self, program: str) -> str | None:
        """Where ``program`` is found on this actor's PATH."""
        import shutil

        return shutil.which(program)
