"""Embedded default recipes: the config each algorithm runs with when no ``--config`` is given.

They are the CPU demos (tiny model, shipped data), so ``nrl run grpo`` works on a laptop.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nrl_core.config.schema import EvalConfig
    from nrl_core.registry import Registry


def default_recipe(algorithm: str) -> dict[str, Any]:
    """The embedded recipe of ``algorithm`` as a dict ({} when it has none)."""
    from nrl_core.config.loader import parse_yaml

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


def resolve_eval_config(
    config_file: str | Path | None,
    overrides: Sequence[str],
    registry: Registry,
) -> EvalConfig:
    """The eval config: class defaults < the embedded recipe (only without ``config_file``) <
    ``config_file`` (with its ``defaults:`` chain) < ``overrides``, as ``nrl run`` resolves.

    It lives here, not in :mod:`nrl_core.algorithms.evaluate` (which imports torch), so that
    ``nrl eval`` reports a config error in a fraction of a second."""
    from nrl_core.config.loader import ConfigConverter, apply_overrides, load_config_file
    from nrl_core.config.schema import EvalConfig

    data: dict[str, Any] = {} if config_file else default_recipe("eval")
    if config_file:
        data = load_config_file(config_file)
    data = apply_overrides(data, overrides)
    return ConfigConverter(registry).structure(data, EvalConfig)
