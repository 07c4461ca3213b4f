"""No import circle inside ``nrl_core``: a lower module never imports a higher one.

Found statically: every module's ``import`` statements are read with :mod:`ast` (nothing is
imported), each as one edge ``importer -> imported module`` of one of three kinds:

* ``module``: at module level (a class body included), run when the module is imported;
* ``typing``: at module level under ``if TYPE_CHECKING:``, a dependency of the module's
  annotations (a circle through one is still a circle in the layering);
* ``function``: inside a function, run when the function is.

A circle of ``module`` and ``typing`` edges fails. A circle that needs a ``function`` edge is
listed in the test's report (``-rA`` shows it) and must be one of :data:`KNOWN_CYCLES`, each
named with why it is still there.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

import nrl_core

Edges = dict[str, dict[str, set[str]]]
"""importer -> imported -> the kinds of import between them."""

KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root`` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, known: set[str]):
    """The modules of ``known`` that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            # Relative: the importer's package, minus one level per extra dot.
            anchor = name.split(".") if is_pkg else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # `from pkg import sub` imports the submodule `pkg.sub`; `from mod import obj`, `mod`.
        wanted = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            for alias in node.names
        ]
    for target in wanted:
        # `import a.b.c` names a.b.c; an object path falls back to its longest module prefix.
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            yield ".".join(parts)


def import_edges(modules: dict[str, Path]) -> Edges:
    """The edges between ``modules`` (see the module docstring), self-imports left out."""
    known = set(modules)
    edges: Edges = {name: {} for name in modules}

    def visit(nodes: Iterable[ast.AST], name: str, is_pkg: bool, kind: str) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, name, is_pkg, known):
                    if target != name:
                        edges[name].setdefault(target, set()).add(kind)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(ast.iter_child_nodes(node), name, is_pkg, "function")
            elif isinstance(node, ast.If) and kind == "module" and _is_type_checking(node.test):
                visit(node.body, name, is_pkg, "typing")
                visit(node.orelse, name, is_pkg, kind)
            else:
                visit(ast.iter_child_nodes(node), name, is_pkg, kind)

    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visit(tree.body, name, path.name == "__init__.py", "module")
    return edges


def cycles(edges: Edges, kinds: set[str]) -> list[frozenset[str]]:
    """The strongly connected groups of two or more modules, over the edges of ``kinds``
    (Tarjan's algorithm, iterative: no recursion limit on a deep package)."""
    graph = {a: sorted(b for b, k in out.items() if k & kinds) for a, out in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(graph[node]):
                work.append((node, i + 1))
                nxt = graph[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(frozenset(group))
    return found


def describe(group: frozenset[str], edges: Edges) -> str:
    """``group``'s edges between its own members, each with its kinds, one per line."""
    lines = [
        f"  {a} -> {b} ({', '.join(sorted(edges[a][b]))})"
        for a in sorted(group)
        for b in sorted(edges[a])
        if b in group
    ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def core_edges() -> Edges:
    root = Path(nrl_core.__file__).parent
    return import_edges(module_files(root, "nrl_core"))


def test_no_module_level_import_cycle_in_nrl_core(core_edges):
    found = cycles(core_edges, {"module", "typing"})
    report = "\n".join(describe(group, core_edges) for group in found)
    assert not found, (
        f"module-level import circles in nrl_core (move the shared piece down):\n{report}"
    )


def test_function_level_import_cycles_are_the_known_ones(core_edges):
    found = cycles(core_edges, {"module", "typing", "function"})
    for group in found:
        reason = KNOWN_CYCLES.get(group, "NEW")
        print(f"function-level import circle ({reason}):\n{describe(group, core_edges)}")
    new = [group for group in found if group not in KNOWN_CYCLES]
    assert not new, "new import circles in nrl_core (through imports inside functions):\n" + (
        "\n".join(describe(group, core_edges) for group in new)
    )
    gone = [KNOWN_CYCLES[group] for group in KNOWN_CYCLES if group not in found]
    assert not gone, f"known import circles that are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_finder_tells_the_kinds_apart(tmp_path):
    """On a package written here: a circle at module level is found, one through
    ``TYPE_CHECKING`` is module-level too, one through a function import only with it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "from pkg import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import X\n",
        "d.py": "from .c import Y\n",
        "e.py": "def f():\n    from pkg.sub.f import g\n",
        "sub/__init__.py": "from .f import g\n",
        "sub/f.py": "from ..e import f\n\nclass K:\n    from pkg import a\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    edges = import_edges(module_files(pkg, "pkg"))
    assert edges["pkg.c"] == {"pkg.d": {"typing"}}
    assert edges["pkg.sub"] == {"pkg.sub.f": {"module"}}
    assert edges["pkg.sub.f"] == {"pkg.e": {"module"}, "pkg.a": {"module"}}
    module_level = set(cycles(edges, {"module", "typing"}))
    assert module_level == {frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.d"})}
    every = set(cycles(edges, {"module", "typing", "function"}))
    assert every == module_level | {frozenset({"pkg.e", "pkg.sub.f"})}


if __name__ == "__main__":  # a listing of every circle, for a look by hand
    graph = import_edges(module_files(Path(nrl_core.__file__).parent, "nrl_core"))
    for group in cycles(graph, {"module", "typing", "function"}):
        print(describe(group, graph), file=sys.stdout)
