"""The eval config's resolution (:func:`resolve_eval_config`), and the embedded recipes' readers
re-exported from :mod:`nrl_core.recipes`, where they live beside the recipe files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.recipes import default_recipe, recipe_names

__all__ = ["default_recipe", "recipe_names", "resolve_eval_config"]

if TYPE_CHECKING:
    from nrl_core.config.schema import EvalConfig
    from nrl_core.registry import Registry


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
