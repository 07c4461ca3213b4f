"""Generates the hook reference and the configuration reference of the docs site.

Used two ways:

- as a MkDocs hook (``hooks: [docs/gen_reference.py]`` in ``mkdocs.yml``): the placeholders
  ``<!-- nrl:hook-reference -->`` and ``<!-- nrl:config-reference -->`` in the pages are
  replaced by the generated Markdown at build time, so the site can never drift from the code;
- as a script: ``python docs/gen_reference.py hooks|config`` prints the Markdown.

The hook reference comes from the hook specifications (``nrl_core.hookspecs``: signature and
docstring) and the ``Register`` protocol; the configuration reference from the attrs classes of
``nrl_core.config.schema`` and the config classes that the installed plugins register (field
docs live in ``metadata["doc"]``, see ``nrl_core.config.schema.option``). The "valid" column
is derived from each field's attrs validator (``nrl_core.config.schema.describe_validator``), so
it states exactly what the loader accepts.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import textwrap
from typing import Any

HOOK_PLACEHOLDER = "<!-- nrl:hook-reference -->"
CONFIG_PLACEHOLDER = "<!-- nrl:config-reference -->"

# Config section of each component kind (``env.math``, ``data.arithmetic``...).
SECTION_OF_KIND = {
    "policy": "policy",
    "generation": "generation",
    "environment": "env",
    "agent": "agent",
    "loss": "loss",
    "cluster": "cluster",
    "dataset": "data",
}


def _markdown_doc(doc: str | None) -> str:
    """A reStructuredText-flavoured docstring as Markdown: roles become code, ``x`` -> `x`."""
    text = inspect.cleandoc(doc or "")
    text = re.sub(r":(?:class|func|meth|mod|attr|data):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    # A paragraph ending in "::" introduces an indented literal block.
    text = re.sub(
        r"::\n\n((?:(?: {4}.*)?\n)+)",
        lambda m: ":\n\n```python\n" + textwrap.dedent(m.group(1)).rstrip() + "\n```\n\n",
        text + "\n",
    )
    return _args_as_list(text).strip()


def _args_as_list(text: str) -> str:
    """Google-style ``Args:`` sections as a Markdown list (indented lines would be code)."""
    out: list[str] = []
    in_args = False
    for line in text.splitlines():
        if line.strip() in ("Args:", "Arguments:"):
            in_args = True
            out += ["**Arguments**", ""]
            continue
        if in_args and line.startswith("    ") and not line.startswith("        "):
            name, _, rest = line.strip().partition(": ")
            out.append(f"- `{name}`: {rest}")
        elif in_args and line.startswith("        "):
            out[-1] += " " + line.strip()
        else:
            in_args = False
            out.append(line)
    return "\n".join(out)


def signature_text(fn: Any, name: str | None = None) -> str:
    """``def name(args) -> ret`` with the annotations as written in the source."""
    params = []
    sig = inspect.signature(fn)
    star_done = False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        text = p.name
        if p.kind is p.VAR_KEYWORD:
            text = "**" + text
        elif p.kind is p.KEYWORD_ONLY and not star_done:
            params.append("*")
            star_done = True
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else p.annotation.__name__}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        params.append(text)
    ret = sig.return_annotation
    ret_text = "" if ret is sig.empty else f" -> {ret if isinstance(ret, str) else ret.__name__}"
    return f"def {name or fn.__name__}({', '.join(params)}){ret_text}"


def hook_specs() -> dict[str, Any]:
    """Every hook specification of ``nrl_core.hookspecs``, by name, in source order."""
    from nrl_core import PROJECT_NAME, hookspecs

    marker = f"{PROJECT_NAME}_spec"
    functions = [
        (name, fn)
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, marker)
    ]
    functions.sort(key=lambda item: inspect.getsourcelines(item[1])[1])
    return dict(functions)


def hook_signature(fn: Any) -> str:
    """``def name(args) -> ret`` exactly as the code declares it."""
    return signature_text(fn)


def hook_reference() -> str:
    """The hook reference page body."""
    from nrl_core import hookspecs
    from nrl_core.plugins import HOOK_KINDS
    from nrl_core.registry import Register

    out = [_markdown_doc(hookspecs.__doc__), ""]
    out += ["## The `register` callable", "", "```python"]
    out += [signature_text(Register.__call__, "register")]
    out += ["```", "", _markdown_doc(Register.__doc__), ""]
    out += ["## Hooks", ""]
    out += ["| hook | component kind | selected by |", "|---|---|---|"]
    for name in hook_specs():
        kind = HOOK_KINDS.get(name, "?")
        out.append(f"| [`{name}`](#{name}) | {kind} | `{_selector(kind)}` |")
    out.append("")
    for name, fn in hook_specs().items():
        out += [f"### `{name}`", "", "```python", hook_signature(fn), "```", ""]
        out += [_markdown_doc(fn.__doc__), ""]
    return "\n".join(out)


def _selector(kind: str) -> str:
    from nrl_core.config import schema

    for cls in vars(schema).values():
        if (
            isinstance(cls, type)
            and issubclass(cls, schema.ComponentSection)
            and cls is not schema.ComponentSection
            and cls.component_kind == kind
        ):
            return f"{SECTION_OF_KIND[kind]}.{cls.selector}"
    return "?"


# ---------------------------------------------------------------------------------------------
# Configuration


def _default(field: Any) -> Any:
    import attrs

    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    return default


def _show(value: Any) -> str:
    import attrs

    if attrs.has(type(value)):
        return "(section)"
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{text}`".replace("|", "\\|")


def _type_name(field: Any) -> str:
    t = field.type
    name = t if isinstance(t, str) else getattr(t, "__name__", repr(t))
    return f"`{name}`".replace("|", "\\|")


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
    return (text or "").replace("|", "\\|")


def config_rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    """``(key, type, default, valid, doc)`` of every field of ``cls``, sub-sections flattened."""
    import attrs

    rows = []
    for field in attrs.fields(cls):
        if field.name == "options" and prefix.split(".")[-1] in SECTION_OF_KIND.values():
            continue  # documented below, per registered component
        key = f"{prefix}.{field.name}" if prefix else field.name
        default = _default(field)
        doc = (field.metadata.get("doc") or "").replace("\n", " ").replace("|", "\\|")
        if attrs.has(type(default)):
            rows.append((key, _type_name(field), "(section)", "", doc))
            rows += config_rows(type(default), key)
        else:
            rows.append((key, _type_name(field), _show(default), valid_values(cls, field), doc))
    return rows


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | valid | description |", "|---|---|---|---|---|"]
    out += [f"| `{k}` | {t} | {d} | {v} | {doc} |" for k, t, d, v, doc in rows]
    return out


def config_reference(registry: Any = None) -> str:
    """The configuration reference page body (``registry``: default, every installed plugin)."""
    from nrl_core.config.schema import ALGORITHM_CONFIGS

    if registry is None:
        from nrl_core.plugins import PluginHost

        registry = PluginHost.discover().registry()
    out = [
        "Every key below can be set in a YAML config or overridden on the command line "
        "(`nrl run grpo policy.optimizer.lr=1e-5`); `nrl config show ALGO` prints the resolved "
        "values. Generated from the attrs classes of `nrl_core.config.schema` and the config "
        "classes that the installed plugins register.",
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
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# MkDocs hook


ALGORITHMS_PAGE = "algorithms.md"


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """MkDocs event: a placeholder for the SFT/DPO/RM page while it is not written yet, so the
    GRPO page and the navigation can link to it and ``mkdocs build --strict`` still passes."""
    if files.get_file_from_path(ALGORITHMS_PAGE) is None:
        from mkdocs.structure.files import File

        files.append(
            File.generated(
                config,
                ALGORITHMS_PAGE,
                content="# SFT, DPO and reward models\n\nThis page is not written yet; "
                "see `nrl_core/losses/` and `nrl config show sft|dpo|rm`.\n",
            )
        )
    return files


def on_page_markdown(markdown: str, page: Any = None, **_: Any) -> str:
    """MkDocs event: fill the placeholders of the reference pages."""
    if HOOK_PLACEHOLDER in markdown:
        markdown = markdown.replace(HOOK_PLACEHOLDER, hook_reference())
    if CONFIG_PLACEHOLDER in markdown:
        markdown = markdown.replace(CONFIG_PLACEHOLDER, config_reference())
    return markdown


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("hooks", "config"):
        sys.exit("usage: python docs/gen_reference.py hooks|config")
    print(hook_reference() if which == "hooks" else config_reference())
