"""Embedded default recipes: the config each algorithm runs with when no ``--config`` is given.

They are the CPU demos (tiny model, shipped data), so ``nrl run grpo`` works on a laptop. The
YAML files lie in this folder; a config file's ``defaults: <name>`` builds on one.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from nrl_core.config.yaml_text import parse_yaml


def default_recipe(algorithm: str) -> dict[str, Any]:
    """The embedded recipe of ``algorithm`` as a dict ({} when it has none)."""
    path = resources.files("nrl_core") / "recipes" / f"{algorithm}.yaml"
    if not path.is_file():
        return {}
    return parse_yaml(path.read_text()) or {}


def recipe_names() -> list[str]:
    """The embedded recipes (``defaults: <name>`` in a config file builds on one)."""
    folder = resources.files("nrl_core") / "recipes"
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    )
