"""YAML files with ``defaults:`` inheritance, dotted overrides, and strict structuring.

The files and overrides are read in :mod:`nrl_core.config.files` (re-exported here); this
module structures them into the config classes and resolves a run's whole config.

Every problem is a :class:`~nrl_core.errors.ConfigError` with one line naming the file (and
line) or the full key path, what was expected, and a close match when there is one.
"""

from __future__ import annotations

import difflib
import keyword
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)

from nrl_core.config.files import (
    DEFAULTS_KEY,
    MAX_CONFIG_BYTES,
    _one_line,
    apply_overrides,
    deep_merge,
    load_config_file,
    read_config_layers,
    read_yaml,
)
from nrl_core.config.schema import (
    ALGORITHM_CONFIGS,
    ComponentSection,
    FieldValueError,
    RunConfig,
    show_value,
)
from nrl_core.config.validation import validate_run_config
from nrl_core.config.yaml_text import parse_yaml
from nrl_core.errors import ConfigError
from nrl_core.registry import Registry

# Reading files and overrides (config/files.py) and YAML (config/yaml_text.py) stay importable
# from here.
__all__ = [
    "DEFAULTS_KEY",
    "MAX_CONFIG_BYTES",
    "ConfigConverter",
    "apply_overrides",
    "deep_merge",
    "drop_unused_recipe_options",
    "dump_config",
    "load_config_file",
    "parse_yaml",
    "read_config_layers",
    "read_yaml",
    "resolve_config",
]

# -- structuring -----------------------------------------------------------------------------


def _strict_scalar(expected: type):
    def structure(value: Any, _: Any) -> Any:
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
            return value
        raise TypeError(f"expected {expected.__name__}, got {_describe_value(value)}")

    return structure


def _structure_literal(value: Any, literal: Any) -> Any:
    choices = typing.get_args(literal)
    # type() too: True == 1, and YAML's `1` is no choice named "1".
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    # Booleans as YAML spells them.
    names = (str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
    raise _BadValue(f"must be one of {', '.join(names)}, got {show_value(value)}")


class _BadValue(Exception):
    """A value outside its valid set, reported as ``<key> <problem>``."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _is_list_type(tp: Any) -> bool:
    return tp is list or typing.get_origin(tp) is list


def _no_text_as_list(tp: Any, conv: cattrs.Converter) -> Any:
    """cattrs' list hook, except that a string is no list: ``generation.stop_strings=stop``
    would otherwise become ``["s", "t", "o", "p"]``."""
    from cattrs.cols import list_structure_factory

    structure = list_structure_factory(tp, conv)

    def hook(value: Any, cl: Any) -> Any:
        if isinstance(value, str | bytes):
            raise TypeError(f"expected a list, got {_describe_value(value)}; write [{value}]")
        return structure(value, cl)

    return hook


def _describe_value(value: Any) -> str:
    kind = {dict: "a section", list: "a list", type(None): "null"}.get(type(value))
    text = repr(value)
    return kind or f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _is_optional_attrs(tp: Any) -> type | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and attrs.has(args[0]):
            return args[0]
    return None


class ConfigConverter:
    """Structures plain dicts into the attrs config classes, using a registry to find the
    config classes of components (``policy.dtensor`` -> the dtensor plugin's class)."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
        for scalar in (int, float, bool, str):
            conv.register_structure_hook(scalar, _strict_scalar(scalar))
        conv.register_structure_hook(typing.Any, lambda value, _: value)
        conv.register_structure_hook_func(
            lambda t: typing.get_origin(t) is typing.Literal, _structure_literal
        )
        conv.register_structure_hook_func(
            lambda t: isinstance(t, type) and issubclass(t, ComponentSection),
            self._structure_section,
        )
        conv.register_unstructure_hook_func(
            lambda t: isinstance(t, type) and issubclass(t, ComponentSection),
            self._unstructure_section,
        )
        conv.register_structure_hook_factory(_has_renamed_fields, self._renamed_structure)
        conv.register_structure_hook_factory(_is_list_type, lambda t: _no_text_as_list(t, conv))
        conv.register_unstructure_hook_factory(_has_renamed_fields, self._renamed_unstructure)
        self._plain = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
        self._plain.register_structure_hook_func(
            lambda t: True, lambda value, t: conv.structure(value, t)
        )
        self.converter = conv

    def _renamed_structure(self, cls: type) -> Any:
        return cattrs.gen.make_dict_structure_fn(
            cls,
            self.converter,
            _cattrs_forbid_extra_keys=True,
            _cattrs_detailed_validation=True,
            **_renames(cls),
        )

    def _renamed_unstructure(self, cls: type) -> Any:
        return cattrs.gen.make_dict_unstructure_fn(cls, self.converter, **_renames(cls))

    def _structure_section(self, value: Any, cls: type[ComponentSection]) -> ComponentSection:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a section, got {_describe_value(value)}")
        field_names = {f.name for f in attrs.fields(cls)} - {"options"}
        value = self._lift_selected_options(value, cls, field_names)
        plain = {k: v for k, v in value.items() if k in field_names}
        component_keys = [k for k in value if k not in field_names]
        errors: list[Exception] = []
        options: dict[str, Any] = {}
        for key in component_keys:
            spec = self.registry.find(cls.component_kind, key)
            if spec is None:
                errors.append(
                    _UnknownKey(
                        key,
                        sorted(field_names) + self.registry.names(cls.component_kind),
                        cls.component_kind,
                    )
                )
                continue
            try:
                options[key] = self._structure_options(spec, value[key])
            except Exception as exc:
                exc.__notes__ = [*getattr(exc, "__notes__", []), _note(key, cls)]
                errors.append(exc)
        try:
            section = cattrs.gen.make_dict_structure_fn(
                cls,
                self.converter,
                _cattrs_forbid_extra_keys=True,
                _cattrs_detailed_validation=True,
            )(plain, cls)
        except ClassValidationError as exc:
            errors.extend(exc.exceptions)
            section = None
        if errors:
            raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        assert section is not None
        section.options = options
        self._add_selected_options(section)
        return section

    def _lift_selected_options(
        self, value: Mapping[str, Any], cls: type[ComponentSection], field_names: set[str]
    ) -> Mapping[str, Any]:
        """Read a key of the section that is an option of the selected component as that
        option: ``generation.num_engines=2`` is ``generation.<backend>.num_engines=2``. Given
        both ways, the two values must agree."""
        selector = attrs.fields_dict(cls)[cls.selector]
        selected = value.get(cls.selector, selector.default)
        spec = self.registry.find(cls.component_kind, selected) if selected else None
        config_cls = spec.load_config_class() if spec is not None else None
        if config_cls is None:
            return value
        names = {f.name for f in attrs.fields(config_cls)}
        lifted = [
            k
            for k in value
            if k not in field_names
            and k in names
            and self.registry.find(cls.component_kind, k) is None
        ]
        if not lifted:
            return value
        nested = value.get(selected) or {}
        if not isinstance(nested, Mapping):
            return value  # reported by the options' own structuring
        merged = dict(nested)
        for key in lifted:
            if key in merged and merged[key] != value[key]:
                raise ClassValidationError(
                    f"While structuring {cls.__name__}",
                    [
                        ValueError(
                            f"{key} is given as {value[key]!r} and as {selected}.{key}="
                            f"{merged[key]!r}; give it once"
                        )
                    ],
                    cls,
                )
            merged[key] = value[key]
        out = {k: v for k, v in value.items() if k not in lifted}
        out[selected] = merged
        return out

    def _add_selected_options(self, section: ComponentSection) -> None:
        """Give the selected component its default options, so ``config show`` lists them.

        ``data.dataset=<file>.jsonl`` is read by the registered ``jsonl`` dataset (see
        :func:`nrl_core.datasets._loader`): its options (prompt template, task) are shown too,
        or they would shape every prompt unseen."""
        from nrl_core.datasets import reading_dataset

        name = section.selected
        if section.component_kind == "dataset":
            name = reading_dataset(name)
        spec = self.registry.find(section.component_kind, name)
        if spec is not None and name not in section.options:
            section.options[name] = self._structure_options(spec, {})

    def _complete(self, config: Any) -> None:
        # Sections missing from the data come from attrs defaults, bypassing the hook above.
        if isinstance(config, ComponentSection):
            self._add_selected_options(config)
        if attrs.has(type(config)):
            for field in attrs.fields(type(config)):
                value = getattr(config, field.name)
                if attrs.has(type(value)):
                    self._complete(value)

    def _structure_options(self, spec, value: Any) -> Any:
        config_cls = spec.load_config_class()
        if config_cls is None:
            if value in ({}, None):
                return None
            raise TypeError(f"{spec.kind} {spec.name!r} takes no options")
        if value is None:
            value = {}
        return self.converter.structure(value, config_cls)

    def _unstructure_section(self, section: ComponentSection) -> dict[str, Any]:
        base_fields = {f.name for f in attrs.fields(ComponentSection)}
        names = [f.name for f in attrs.fields(type(section)) if f.name not in base_fields]
        out = {
            name: self.converter.unstructure(getattr(section, name))
            for name in [*names, "actor_env"]
        }
        for name, opts in section.options.items():
            out[name] = {} if opts is None else self.converter.unstructure(opts)
        return out

    def structure(self, data: Mapping[str, Any], cls: type) -> Any:
        try:
            config = self.converter.structure(dict(data), cls)
        except ClassValidationError as exc:
            messages = list(_format_errors(exc, ""))
            raise ConfigError(
                messages[0]
                + (f" (and {len(messages) - 1} more problems)" if len(messages) > 1 else "")
            ) from None
        except (ValueError, _BadValue) as exc:  # FieldValueError is a ValueError
            # Raised by a top-level field's validator (no section note to name a path), or by
            # a class's own cross-field check.
            if isinstance(exc, FieldValueError | _BadValue) or _is_in_validator_error(exc):
                raise ConfigError(next(_format_errors(exc, ""))) from None
            raise ConfigError(_one_line(str(exc))) from None
        except Exception as exc:  # a component's config class failing to load, for example
            raise ConfigError(_one_line(str(exc))) from None
        self._complete(config)
        return config

    def unstructure(self, config: Any) -> dict[str, Any]:
        return self.converter.unstructure(config)


def _has_renamed_fields(cls: Any) -> bool:
    """An attrs config class with a field whose key differs from its attribute name (field
    metadata ``key``, for keys that are Python keywords such as ``grpo.async``)."""
    return (
        isinstance(cls, type)
        and attrs.has(cls)
        and not issubclass(cls, ComponentSection)
        and any("key" in f.metadata for f in attrs.fields(cls))
    )


def _renames(cls: type) -> dict[str, Any]:
    return {
        f.name: cattrs.gen.override(rename=f.metadata["key"])
        for f in attrs.fields(cls)
        if "key" in f.metadata
    }


class _UnknownKey(Exception):
    def __init__(self, key: str, known: list[str], kind: str | None = None) -> None:
        super().__init__(key)
        self.key, self.known, self.kind = key, known, kind


def _note(name: str, cls: type) -> AttributeValidationNote:
    return AttributeValidationNote(f"Structuring {cls.__name__} @ {name}", name, Any)


def _format_errors(exc: BaseException, path: str):
    """Yield one readable line per leaf error of a cattrs validation error tree."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, AttributeValidationNote):
                    sub_path = _join(path, str(note.name))
                elif hasattr(note, "index"):
                    sub_path = f"{path}[{note.index}]"
            yield from _format_errors(sub, sub_path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        nested = _nested_keys(exc.cl) if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            yield _unknown_key_message(path, key, known, None, nested)
    elif isinstance(exc, _UnknownKey):
        yield _unknown_key_message(path, exc.key, exc.known, exc.kind)
    elif isinstance(exc, FieldValueError):  # a field's validator (nrl_core.config.schema.Valid)
        yield f"{_join(path, exc.field)} {exc.problem}"
    elif isinstance(exc, _BadValue):
        yield f"{path or 'config'} {exc.problem}"
    elif _is_in_validator_error(exc):  # attrs.validators.in_: (message, attribute, options, value)
        _, attribute, options, value = exc.args
        choices = ", ".join(str(o) for o in options)
        yield f"{_join(path, attribute.name)} must be one of {choices}, got {show_value(value)}"
    else:
        message = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError):
            message = f"missing required key {exc.args[0]!r}"
        yield f"{path or 'config'}: {_one_line(message)}"


def _join(path: str, name: str) -> str:
    # An attribute named after a keyword (`async_`) is the keyword in the config.
    if name.endswith("_") and keyword.iskeyword(name[:-1]):
        name = name[:-1]
    return f"{path}.{name}" if path else name


def _is_in_validator_error(exc: BaseException) -> bool:
    return (
        isinstance(exc, ValueError)
        and len(exc.args) == 4
        and isinstance(exc.args[1], attrs.Attribute)
    )


def _nested_keys(cls: type, prefix: str = "", depth: int = 3) -> list[str]:
    """The dotted keys of every option below ``cls``'s own (``grpo.max_num_steps``,
    ``policy.optimizer.lr``): where a key given without its section is found."""
    found = []
    for field in attrs.fields(cls):
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        if not attrs.has(type(default)) or depth == 0:
            continue
        section = f"{prefix}{field.metadata.get('key', field.name)}"
        for sub in attrs.fields(type(default)):
            if sub.name == "options" and isinstance(default, ComponentSection):
                continue
            found.append(f"{section}.{sub.metadata.get('key', sub.name)}")
        found += _nested_keys(type(default), f"{section}.", depth - 1)
    return found


def _unknown_key_message(
    path: str, key: str, known: list[str], kind: str | None, nested: Sequence[str] = ()
) -> str:
    full = f"{path}.{key}" if path else key
    message = f"unknown key {full}"
    close = difflib.get_close_matches(key, known, n=1)
    # A section's key given without its section (`max_num_steps=5`): name the full key.
    leaves = {n.rsplit(".", 1)[-1] for n in nested}
    near = key if key in leaves else next(iter(difflib.get_close_matches(key, leaves, n=1)), None)
    inside = [n for n in nested if n.rsplit(".", 1)[-1] == near]
    if close:
        alt = f"{path}.{close[0]}" if path else close[0]
        message += f"; did you mean {alt}?"
    elif inside:
        alts = [f"{path}.{n}" if path else n for n in inside[:3]]
        message += f"; did you mean {' or '.join(alts)}?"
    elif kind:
        from nrl_core.first_party import install_hint

        message += f" (not an option here, and no {kind} named {key!r} is registered)"
        message += install_hint(kind, key)
    return message


# -- the whole pipeline ----------------------------------------------------------------------


def resolve_config(
    algorithm: str,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    registry: Registry | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Build the run config of ``algorithm``: class defaults < ``defaults`` (the algorithm's
    embedded recipe) < ``config_file`` (with its ``defaults:`` chain) < ``overrides``; then
    check the settings that span sections
    (:func:`~nrl_core.config.validation.validate_run_config`)."""
    try:
        cls = ALGORITHM_CONFIGS[algorithm]
    except KeyError:
        raise ConfigError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHM_CONFIGS)}"
        ) from None
    registry = registry or Registry()
    data: dict[str, Any] = dict(defaults or {})
    written: dict[str, Any] = {}
    if config_file is not None:
        from_file, written = read_config_layers(config_file)
        data = deep_merge(data, from_file)
    data = drop_unused_recipe_options(
        apply_overrides(data, overrides), apply_overrides(written, overrides), cls, registry
    )
    config = ConfigConverter(registry).structure(data, cls)
    validate_run_config(config)
    return config


def drop_unused_recipe_options(
    data: Mapping[str, Any], written: Mapping[str, Any], cls: type, registry: Registry
) -> dict[str, Any]:
    """``data`` without the component options that only an embedded recipe brought and that
    this installation cannot use: a sub-section such as ``data.arithmetic`` whose component is
    not installed (here: nrl-math-env) and not selected.

    A recipe carries the options of the components it selects. A run that builds on it but
    selects others (``env.name=my_env data.dataset=my_data``) never uses them, and must not
    need the plugin that defines them. Options the user wrote (``written``: their files and
    overrides) are kept, so a misspelt or missing component there is still an error."""
    hints = typing.get_type_hints(cls)
    result = dict(data)
    for field in attrs.fields(cls):
        section_cls = hints.get(field.name)
        section = result.get(field.name)
        if not (
            isinstance(section_cls, type)
            and issubclass(section_cls, ComponentSection)
            and isinstance(section, Mapping)
        ):
            continue
        own_fields = {f.name for f in attrs.fields(section_cls)}
        selector = attrs.fields_dict(section_cls)[section_cls.selector]
        selected = section.get(section_cls.selector, selector.default)
        user_keys = written.get(field.name)
        user_keys = user_keys if isinstance(user_keys, Mapping) else {}
        result[field.name] = {
            key: value
            for key, value in section.items()
            if key in own_fields
            or key == selected
            or key in user_keys
            or not isinstance(value, Mapping)
            or registry.find(section_cls.component_kind, key) is not None
        }
    return result


def dump_config(config: Any, registry: Registry | None = None) -> str:
    """The config as YAML, in field order, ready to be read back by :func:`resolve_config`."""
    data = ConfigConverter(registry).unstructure(config)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
