"""Reading YAML text: a safe loader (no arbitrary objects) that reads ``1e-5`` as a float and
refuses a key given twice. Below the config loader and the embedded recipes, which both parse
YAML with :func:`parse_yaml`."""

from __future__ import annotations

import re
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loader that also reads ``1e-5`` (no dot) as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"""),
    list("-+0123456789"),
)


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A YAML mapping; a key given twice is an error (PyYAML keeps the last silently, so a
    second ``grpo:`` block would replace the first)."""
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line)
        except TypeError:
            continue  # an unhashable key: construct_mapping names it
        if first != key_node.start_mark.line:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (also on line {first + 1}); keep one",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def parse_yaml(text: str) -> Any:
    """YAML text (a SafeLoader subclass: no arbitrary objects). Errors are ``yaml.YAMLError``,
    also for what PyYAML itself reports otherwise: an integer of over 4300 digits, nesting
    deeper than Python's recursion allows."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ValueError as exc:  # int('5000 digits'): Python's int-from-text limit
        raise yaml.YAMLError(" ".join(str(exc).split())) from None
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
