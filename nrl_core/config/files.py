"""Reading config files: YAML mappings with ``defaults:`` inheritance (files beside them or
embedded recipes), merged, with dotted ``key=value`` overrides applied. Nothing is structured
here (see :mod:`nrl_core.config.loader`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from nrl_core.config.yaml_text import parse_yaml
from nrl_core.errors import ConfigError
from nrl_core.recipes import default_recipe, recipe_names

DEFAULTS_KEY = "defaults"


MAX_CONFIG_BYTES = 16 << 20
"""Largest config file read (a config is a few KiB; ``/dev/zero`` must not fill memory)."""


# -- reading ---------------------------------------------------------------------------------


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read one YAML mapping; bad YAML is reported with file, line and column, and a file
    holding no YAML document (empty, or comments only) is refused."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        # A FIFO would block the read, a device (/dev/zero) would never end it.
        raise ConfigError(f"config file {path} is not a regular file; pass a YAML file")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB; a config is YAML "
                "settings: pass the right file"
            )
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check the --config path") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder; pass a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    text = _decode_config(path, raw)
    try:
        data = parse_yaml(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        raise ConfigError(f"bad YAML in {where}: {_one_line(exc.problem or exc.context)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad YAML in {path}: {_one_line(str(exc))}") from None
    if data is None:
        # An empty file (or one of comments only) would run on the defaults, silently: a
        # config saved empty by mistake, or the wrong file. `{}` says "no changes" on purpose.
        raise ConfigError(
            f"config file {path} holds no settings (it is empty or only comments); write the "
            "settings in it (`{}` for none), or leave out --config to run the defaults"
        )
    if not isinstance(data, dict):
        kind = {list: "list", str: "plain string"}.get(type(data), type(data).__name__)
        raise ConfigError(
            f"{path} must hold a mapping of config keys (key: value lines), not a {kind}"
        )
    if not all(isinstance(key, str) for key in data):
        bad = next(key for key in data if not isinstance(key, str))
        raise ConfigError(f"{path}: config keys are names, not {type(bad).__name__} {bad!r}")
    return data


def _decode_config(path: Path, raw: bytes) -> str:
    """The text of a config file; a binary or non-UTF-8 file (a checkpoint, a tarball passed
    as --config by mistake) is one line naming it, not a decoding traceback."""
    if b"\0" in raw[:8192]:
        raise ConfigError(f"config file {path} is a binary file, not YAML; pass a .yaml file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
            "save it as UTF-8"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge mappings recursively; values of ``override`` win, lists are replaced whole."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a config file and what its ``defaults:`` names (one entry or a list; later ones
    win, and the file's own keys win over all of them). An entry is a YAML file (relative to
    the file) or, when no such file exists, the name of an embedded recipe (``grpo``,
    ``distill``, ...: what ``nrl run <algorithm>`` runs without ``--config``)."""
    return read_config_layers(path)[0]


def read_config_layers(
    path: str | Path, _chain: tuple[Path, ...] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load_config_file`'s result, and the same without the embedded recipes (what the
    user's own files say), from one reading of each file."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"defaults form a cycle: {cycle}")
    data = read_yaml(path)
    defaults = data.pop(DEFAULTS_KEY, None)
    if defaults is None:
        return data, copy.deepcopy(data)
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: 'defaults' must be a file path or a list of file paths")
    merged: dict[str, Any] = {}
    written: dict[str, Any] = {}
    for entry in defaults:
        everything, own = _load_default(path, entry, (*_chain, path))
        merged = deep_merge(merged, everything)
        written = deep_merge(written, own)
    return deep_merge(merged, data), deep_merge(written, data)


def _load_default(
    path: Path, entry: str, chain: tuple[Path, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``defaults:`` entry of ``path``, a file beside it, else an embedded recipe, as
    :func:`read_config_layers` returns it (a recipe is no layer of the user's own)."""
    file = path.parent / entry
    if file.exists():
        return read_config_layers(file, chain)
    if entry in recipe_names():
        return default_recipe(entry), {}
    raise ConfigError(
        f"{path}: defaults entry {entry!r} is neither a file (no {file}) nor an embedded "
        f"recipe ({', '.join(recipe_names())})"
    )


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML scalars (``1e-5``, ``true``,
    ``[1, 2]``, ``null``)."""
    result = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like key.path=value")
        try:
            value = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # an unparseable value stays a string; type checks report it if wrong
        if isinstance(value, dict) and value and all(v is None for v in value.values()):
            value = raw  # `{problem}` is a format template, not a YAML mapping of nulls
        node = result
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result
