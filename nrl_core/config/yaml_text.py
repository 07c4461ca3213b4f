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


MAX_ALIAS_EXPANSION = 100_000
"""Most values (scalars, lists, mappings) a YAML text may expand to through its aliases
(``*name`` repeating an ``&name`` anchor) beyond the values it spells out: a config is a few
hundred values, and nine nested aliases of nine items each (a "billion laughs") make 387
million, which took the checks after parsing half a minute."""


def _expanded_size(root: yaml.Node) -> int:
    """How many values the node graph ``root`` stands for once every alias is expanded,
    counted on the graph (each node once, memoised: linear in the text, however large the
    expansion)."""
    sizes: dict[int, int] = {}
    busy: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in busy:  # `&a [*a]`: an alias inside its own anchor, an endless expansion
            raise yaml.YAMLError("an alias (*name) refers to the value that holds it")
        busy.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        busy.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _distinct_nodes(root: yaml.Node) -> int:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(child for pair in node.value for child in pair)
    return len(seen)


def _load(text: str) -> Any:
    """``yaml.load`` with the alias expansion bounded between composing the node graph and
    constructing Python objects (which shares repeated values, so the blow-up came later)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        extra = _expanded_size(node) - _distinct_nodes(node)
        if extra > MAX_ALIAS_EXPANSION:
            raise yaml.YAMLError(
                f"its aliases (*name) repeat {extra} values, over the {MAX_ALIAS_EXPANSION} "
                "allowed (an alias bomb?); write the values out, or use fewer aliases"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_yaml(text: str) -> Any:
    """YAML text (a SafeLoader subclass: no arbitrary objects). Errors are ``yaml.YAMLError``,
    also for what PyYAML itself reports otherwise: an integer of over 4300 digits, nesting
    deeper than Python's recursion allows, and aliases that expand the text to over
    :data:`MAX_ALIAS_EXPANSION` values beyond those it spells out."""
    try:
        return _load(text)
    except ValueError as exc:  # int('5000 digits'): Python's int-from-text limit
        raise yaml.YAMLError(" ".join(str(exc).split())) from None
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
