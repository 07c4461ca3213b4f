"""Generates the hook reference and the configuration reference of the docs site.

Used two ways:

- as a MkDocs hook (``hooks: [docs/gen_reference.py]`` in ``mkdocs.yml``): the placeholders
  ``<!-- nrl:hook-reference -->`` and ``<!-- nrl:config-reference -->`` in the pages are
  replaced by the generated Markdown at build time, so the site can never drift from the code;
- as a script: ``python docs/gen_reference.py hooks|config`` prints the Markdown, and
  ``python docs/gen_reference.py --write`` writes it into the pages, between each placeholder
  and :data:`END_MARK`, so that the pages read in the repository are complete too
  (``tests/docs/test_reference.py`` fails when they are stale).

The configuration reference itself is :func:`nrl_core.config.reference.config_reference`
(``nrl config show --docs`` and ``nrl run ALGO --help`` read the same facts).

The hook reference comes from the hook specifications (``nrl_core.hookspecs``: signature and
docstring) and the ``Register`` protocol; the configuration reference from the attrs classes of
``nrl_core.config.schema`` and the config classes that the installed plugins register (field
docs live in ``metadata["doc"]``, see ``nrl_core.config.schema.option``). The "valid" column
is derived from each field's attrs validator (``nrl_core.config.schema.describe_validator``), so
it states exactly what the loader accepts.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from nrl_core.config.reference import (  # noqa: F401  (the generator's API, used by tests)
    SECTION_OF_KIND,
    config_rows,
    valid_values,
)
from nrl_core.config.reference import config_reference as _config_reference
from nrl_core.config.reference import field_default as _default  # noqa: F401

HOOK_PLACEHOLDER = "<!-- nrl:hook-reference -->"
CONFIG_PLACEHOLDER = "<!-- nrl:config-reference -->"
END_MARK = "<!-- nrl:end of generated reference -->"
"""Closes a generated block: the pages in the repository hold the generated text between a
placeholder and this line (``--write``), and the MkDocs hook regenerates it at build time."""
DOCS = Path(__file__).resolve().parent
PAGES = {"hooks.md": HOOK_PLACEHOLDER, "configuration.md": CONFIG_PLACEHOLDER}


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


def config_reference(registry: Any = None) -> str:
    """The configuration reference page body (``registry``: default, every installed plugin)."""
    if registry is None:
        from nrl_core.plugins import PluginHost

        registry = PluginHost.discover().registry()
    return _config_reference(registry)


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


def fill(markdown: str, placeholder: str, body: str) -> str:
    """``markdown`` with the block that starts at ``placeholder`` (and runs to
    :data:`END_MARK`, or is empty) holding ``body``."""
    head, found, rest = markdown.partition(placeholder)
    if not found:
        return markdown
    _, ended, tail = rest.partition(END_MARK)
    if not ended:
        tail = rest
    return f"{head}{placeholder}\n\n{body.strip()}\n\n{END_MARK}\n{tail.lstrip()}".rstrip() + "\n"


def generated(placeholder: str) -> str:
    """The generated text of one placeholder."""
    return hook_reference() if placeholder == HOOK_PLACEHOLDER else config_reference()


def on_page_markdown(markdown: str, page: Any = None, **_: Any) -> str:
    """MkDocs event: fill the reference pages' generated blocks afresh."""
    for placeholder in (HOOK_PLACEHOLDER, CONFIG_PLACEHOLDER):
        if placeholder in markdown:
            markdown = fill(markdown, placeholder, generated(placeholder))
            # The markers only delimit the block in the repository's copy of the page.
            markdown = markdown.replace(placeholder, "").replace(END_MARK, "")
    return markdown


def write_pages() -> list[str]:
    """Regenerate the blocks of the pages in docs/; returns the pages that changed."""
    changed = []
    for name, placeholder in PAGES.items():
        path = DOCS / name
        old = path.read_text()
        new = fill(old, placeholder, generated(placeholder))
        if new != old:
            path.write_text(new)
            changed.append(name)
    return changed


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which == "--write":
        print("\n".join(f"wrote docs/{name}" for name in write_pages()) or "up to date")
    elif which in ("hooks", "config"):
        print(hook_reference() if which == "hooks" else config_reference())
    else:
        sys.exit("usage: python docs/gen_reference.py hooks|config|--write")
