"""What every config option means, from the config classes themselves.

Three views of the same facts (each field's ``option(default, doc)`` and its attrs validator,
described by :func:`~nrl_core.config.schema.describe_validator`):

- :func:`config_reference`: the Markdown reference committed in ``docs/configuration.md``
  (written by ``python docs/gen_reference.py --write``, checked fresh by
  ``tests/docs/test_reference.py``);
- :func:`documented_yaml`: ``nrl config show --docs ALGO``, the resolved config as YAML with
  each option's description, type, valid range and default above it;
- :func:`run_help`: the sections that ``nrl run ALGO --help`` lists.

Imports only the config schema (attrs), never torch: these are read by commands that must
answer at once.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from typing import Any

import attrs
import yaml

SECTION_OF_KIND = {
    "policy": "policy",
    "generation": "generation",
    "environment": "env",
    "agent": "agent",
    "loss": "loss",
    "cluster": "cluster",
    "dataset": "data",
    "tool_parser": "server",
}
"""Config section of each component kind (``env.math``, ``data.arithmetic``...)."""


def field_default(field: Any) -> Any:
    """``field``'s default value (a factory's product for ``attrs.Factory`` defaults)."""
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    return default


def _show(value: Any) -> str:
    if attrs.has(type(value)):
        return "(section)"
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{text}`".replace("|", "\\|")


def type_name(cls: type, field: Any) -> str:
    """The field's annotation as written in the source (``int | None``): the class's own
    annotation string, which stays as written when attrs/cattrs resolve ``field.type``."""
    for klass in cls.__mro__:
        annotation = inspect.get_annotations(klass).get(field.name)
        if isinstance(annotation, str):
            return annotation
    t = field.type
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


def valid_values(cls: type, field: Any) -> str:
    """What ``field`` of ``cls`` accepts, in words: its validator's range, a registered
    component for a section's selector, ``true``/``false`` for flags; empty when anything of
    its type goes."""
    from nrl_core.config.schema import ComponentSection, describe_validator

    if isinstance(cls, type) and issubclass(cls, ComponentSection) and field.name == cls.selector:
        text = f"a registered {cls.component_kind}"
        if cls.component_kind == "dataset":
            text += " or a `.jsonl` path"
        return text
    text = describe_validator(field.validator)
    if text is None and field.type in (bool, "bool"):
        text = "`true` or `false`"
    return text or ""


def _doc(field: Any) -> str:
    return " ".join((field.metadata.get("doc") or "").split())


def config_rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    """``(key, type, default, valid, doc)`` of every field of ``cls``, sub-sections flattened,
    as Markdown table cells."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = []
    for field in attrs.fields(cls):
        if field.name == "options" and prefix.split(".")[-1] in SECTION_OF_KIND.values():
            continue  # documented per registered component
        key = f"{prefix}.{field.name}" if prefix else field.name
        default = field_default(field)
        doc = cell(_doc(field))
        kind = cell(f"`{type_name(cls, field)}`")
        if attrs.has(type(default)):
            rows.append((key, kind, "(section)", "", doc))
            rows += config_rows(type(default), key)
        else:
            rows.append((key, kind, _show(default), cell(valid_values(cls, field)), doc))
    return rows


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | valid | description |", "|---|---|---|---|---|"]
    out += [f"| `{k}` | {t} | {d} | {v} | {doc} |" for k, t, d, v, doc in rows]
    return out


def config_reference(registry: Any) -> str:
    """The configuration reference (Markdown): every algorithm's keys, then the options of
    every component ``registry`` holds."""
    from nrl_core.config.schema import ALGORITHM_CONFIGS

    out = [
        "Every key below can be set in a YAML config or overridden on the command line "
        "(`nrl run grpo policy.optimizer.lr=1e-5`); `nrl config show ALGO` prints the resolved "
        "values and `nrl config show --docs ALGO` the same with these descriptions. Generated "
        "from the attrs classes of `nrl_core.config.schema` and the config classes that the "
        "workspace's plugins register.",
        "",
    ]
    for algorithm, cls in ALGORITHM_CONFIGS.items():
        out += [f"## `nrl run {algorithm}` ({cls.__name__})", ""]
        out += [*_table(config_rows(cls, "")), ""]
    out += [
        "## Component options",
        "",
        "Each registered component reads its options from the sub-section named after it in "
        "its kind's section: `policy.dtensor.*`, `env.math.*`, `data.arithmetic.*`.",
        "",
    ]
    for spec in sorted(registry, key=lambda s: (s.kind, s.name)):
        config_class = spec.load_config_class()
        if config_class is None:
            continue
        section = f"{SECTION_OF_KIND[spec.kind]}.{spec.name}"
        out += [f"### `{section}`", ""]
        out += [
            f"{spec.kind} `{spec.name}` of plugin `{spec.plugin}`"
            f" ({spec.distribution or 'in-process'}): {spec.description}".rstrip(": "),
            "",
            f"Class `{config_class.__module__}.{config_class.__qualname__}`.",
            "",
        ]
        out += [*_table(config_rows(config_class, section)), ""]
    return "\n".join(out).rstrip() + "\n"


# -- nrl config show --docs ---------------------------------------------------------------------


def _fields_by_key(cls: type) -> dict[str, Any]:
    return {f.metadata.get("key", f.name): f for f in attrs.fields(cls)}


def _comment(field: Any, cls: type, indent: str, width: int) -> list[str]:
    facts = [type_name(cls, field)]
    valid = valid_values(cls, field).replace("`", "")
    if valid:
        facts.append(valid)
    default = field_default(field)
    if not attrs.has(type(default)):
        facts.append(f"default {json.dumps(default, default=repr)}")
    text = _doc(field)
    text = f"{text} [{'; '.join(facts)}]" if text else f"[{'; '.join(facts)}]"
    return textwrap.wrap(
        text, width=width, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "
    )


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _emit(
    data: dict[str, Any], cls: type | None, registry: Any, indent: str, width: int
) -> list[str]:
    from nrl_core.config.schema import ComponentSection

    fields = _fields_by_key(cls) if cls is not None else {}
    lines: list[str] = []
    for key, value in data.items():
        field = fields.get(key)
        sub_cls: type | None = None
        if field is not None:
            lines += _comment(field, cls, indent, width)
            default = field_default(field)
            if attrs.has(type(default)):
                sub_cls = type(default)
        elif isinstance(cls, type) and issubclass(cls, ComponentSection):
            # A component's options: documented by the class its plugin registers.
            spec = registry.find(cls.component_kind, key) if registry is not None else None
            if spec is not None:
                sub_cls = spec.load_config_class()
                text = f"options of {spec.kind} {key!r} (plugin {spec.plugin})"
                text += f": {spec.description}" if spec.description else ""
                lines += textwrap.wrap(
                    text, width, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "
                )
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines += _emit(value, sub_cls, registry, indent + "  ", width)
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}")
    return lines


def documented_yaml(config: Any, registry: Any = None, width: int = 100) -> str:
    """``config`` as YAML (what ``nrl config show`` prints, values as resolved), each option
    preceded by a comment with its description, type, valid range and default: still valid
    YAML, so it can be saved and edited as a config file."""
    from nrl_core.config.loader import ConfigConverter

    data = ConfigConverter(registry).unstructure(config)
    return "\n".join(_emit(data, type(config), registry, "", width)) + "\n"


# -- nrl run ALGO --help ------------------------------------------------------------------------


def run_help(algorithm: str) -> str:
    """The config sections of ``algorithm`` with one line each, and where every option is
    described (the epilog of ``nrl run ALGO --help``)."""
    from nrl_core.config.schema import ALGORITHM_CONFIGS, ComponentSection

    cls = ALGORITHM_CONFIGS[algorithm]
    lines = [f"config sections of `nrl run {algorithm}` (set any key as KEY=VALUE):"]
    fields = attrs.fields(cls)
    width = max(len(f.metadata.get("key", f.name)) for f in fields)
    for field in fields:
        key = field.metadata.get("key", field.name)
        doc = _doc(field).split(". ")[0].rstrip(".")
        default = field_default(field)
        if isinstance(default, ComponentSection):
            doc += f" [{key}.{default.selector}=NAME]"
        elif not attrs.has(type(default)):
            doc += f" [{type_name(cls, field)}, default {json.dumps(default, default=repr)}]"
        lines.append(f"  {key:<{width}}  {doc}")
    show = f"nrl config show --docs {algorithm}"
    lines += [
        "(NAME: a component `nrl plugins` lists)",
        "",
        "every option, with its description and valid range:",
        f"  {show}  the resolved config, each option commented",
        f"  {'docs/configuration.md':<{len(show)}}  the full reference (every plugin's options)",
        "examples:",
        f"  nrl run {algorithm} --config my.yaml policy.optimizer.lr=1e-5",
        f"  nrl config show {algorithm} --config my.yaml    (what a run would use)",
    ]
    return "\n".join(lines)
