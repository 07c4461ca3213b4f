"""An installed engine's source, read without importing it: what the tests of nrl's engine
adapters check (issue 48, "adapters that follow versions").

Every place nrl patches or proxies inside an engine (Megatron-Core's pipeline schedule on CPU,
vLLM's worker extension and layerwise reload, SGLang's weight-update calls) names the releases it
was checked against; a test per adapter reads the installed engine's source for the names and
signatures the adapter depends on, so an upgrade fails naming exactly what moved. The engines
are heavy (or, for the GPU builds, not importable without a GPU), so this module parses their
files with :mod:`ast` and never imports them; it runs in any interpreter, and an engine in
another interpreter (an actor venv) is found through that interpreter (:func:`package_dir`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import attrs

__all__ = [
    "Call",
    "Signature",
    "calls_on",
    "definition",
    "functions",
    "methods",
    "module_source",
    "package_dir",
    "self_attributes",
]

_FIND = (
    "import importlib.util, sys\n"
    "spec = importlib.util.find_spec(sys.argv[1])\n"
    "print(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations "
    "else '')\n"
)


def package_dir(package: str, python: str | None = None) -> Path | None:
    """The folder of the top-level ``package`` as ``python`` (default: this interpreter)
    imports it, or None when it is not installed there. Nothing is imported (``find_spec`` of
    a top-level name does not run its ``__init__``)."""
    out = subprocess.run(
        [python or sys.executable, "-c", _FIND, package],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    return Path(out) if out else None


def module_source(root: Path, module: str) -> tuple[Path, str]:
    """``(file, text)`` of the dotted ``module`` inside the package folder ``root`` (whose
    name is the module's first part). Raises ``AssertionError`` naming the file that is gone."""
    parts = module.split(".")[1:]
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path, path.read_text()
    raise AssertionError(f"{module} is gone: neither {base}.py nor {base}/__init__.py exists")


@attrs.frozen
class Signature:
    """A function's parameter names (``self`` included for methods) and whether it takes
    ``*args`` / ``**kwargs``."""

    params: tuple[str, ...]
    varargs: bool
    varkw: bool
    line: int
    required: tuple[str, ...] = ()
    """The parameters without a default (``self`` included for methods)."""

    def accepts(self, positional: int, keywords: tuple[str, ...], bound: bool) -> list[str]:
        """What is wrong with a call of ``positional`` positional arguments and ``keywords``
        (``bound``: called on an instance, so ``self`` is filled); empty when it fits."""
        params = self.params[1:] if bound else self.params
        wrong = []
        if positional > len(params) and not self.varargs:
            wrong.append(f"{positional} positional arguments, it takes {len(params)}")
        wrong += [f"no parameter {k!r}" for k in keywords if k not in params and not self.varkw]
        filled = set(params[:positional]) | set(keywords)
        required = (
            self.required[1:] if bound and self.required[:1] == self.params[:1] else self.required
        )
        wrong += [f"parameter {r!r} is required now" for r in required if r not in filled]
        return wrong


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    a = node.args
    positional = (*a.posonlyargs, *a.args)
    names = tuple(x.arg for x in (*positional, *a.kwonlyargs))
    # Defaults belong to the last positional parameters; a keyword-only one's may be None.
    required = [x.arg for x in positional[: len(positional) - len(a.defaults)]]
    required += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    return Signature(names, a.vararg is not None, a.kwarg is not None, node.lineno, tuple(required))


def functions(source: str) -> dict[str, Signature]:
    """The module-level functions ``source`` defines, by name."""
    tree = ast.parse(source)
    return {
        n.name: _signature(n)
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def methods(source: str, cls: str) -> dict[str, Signature]:
    """The methods of the module-level class ``cls`` in ``source`` (not inherited ones).
    Raises ``AssertionError`` when the class is gone."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                n.name: _signature(n)
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise AssertionError(f"class {cls} is gone")


@attrs.frozen
class Call:
    """One call ``<receiver>.<name>(...)`` found by :func:`calls_on`."""

    name: str
    positional: int
    keywords: tuple[str, ...]
    line: int


def calls_on(source: str, receiver: str) -> list[Call]:
    """Every call of a method of ``receiver`` (dotted, e.g. ``self.engine``) in ``source``, or,
    for a plain name (e.g. ``initialize_layerwise_reload``), every call of that name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        if "." not in receiver:
            if isinstance(func, ast.Name) and func.id == receiver:
                out.append(Call(receiver, len(node.args), keywords, node.lineno))
        elif isinstance(func, ast.Attribute) and ast.unparse(func.value) == receiver:
            out.append(Call(func.attr, len(node.args), keywords, node.lineno))
    return sorted(out, key=lambda c: c.line)


def definition(root: Path, module: str, name: str, hops: int = 4) -> tuple[str, Signature | None]:
    """Where ``from <module> import <name>`` really gets ``name`` inside the package at
    ``root``: ``(defining module, its signature)`` (None for a class or an assigned name),
    following up to ``hops`` re-exports (``from .layerwise import name`` in an
    ``__init__.py``). Raises ``AssertionError`` naming the module when ``name`` is gone."""
    _, source = module_source(root, module)
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return module, _signature(node)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            return module, None
    for node in ast.walk(tree):  # re-exports, possibly inside `if TYPE_CHECKING` or `try`
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            package = module if module_source(root, module)[0].name == "__init__.py" else None
            base = (package or module.rsplit(".", 1)[0]).split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if hops == 0 or not target.startswith(root.name):
                return target, None
            return definition(root, target, original, hops - 1)
    raise AssertionError(f"{module} no longer defines {name}")


def self_attributes(source: str) -> set[str]:
    """The attributes ``source`` assigns on ``self`` (``self.x = ...``, ``self.x: T = ...``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets if isinstance(node, ast.Assign | ast.AnnAssign) else []:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    out.add(t.attr)
    return out
