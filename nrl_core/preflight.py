"""Checks that run before anything heavy starts (no Ray, no worker, no run folder).

Everything a user can get wrong in a config or a data file is found here, in the driver, in
seconds, and reported as one :class:`~nrl_core.errors.ConfigError` line naming the key or file
and the fix. :class:`~nrl_core.algorithms.runtime.RunSession` and ``nrl eval`` call
:func:`preflight` first.
"""

from __future__ import annotations

from typing import Any

import attrs

from nrl_core.config.schema import ComponentSection
from nrl_core.registry import Registry


def check_components(config: Any, registry: Registry) -> None:
    """Fail when the config selects a component nobody registers."""
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        name = section.selected
        if section.component_kind == "dataset" and name.endswith(".jsonl"):
            continue  # a file, read by the registered `jsonl` dataset
        registry.get(section.component_kind, name, key=f"{field.name}.{section.selector}")


def preflight(config: Any, registry: Registry) -> None:
    """Every check that needs only the driver: raise ``ConfigError`` on the first problem."""
    check_components(config, registry)
