"""nrl_core.testing.upstream: an engine's source read without importing it."""

from __future__ import annotations

import sys

import pytest

from nrl_core.testing.upstream import calls_on, functions, methods, module_source, package_dir

ENGINE = """
def load(model, config=None, *, strict=True): ...
def anything(*args, **kwargs): ...
def needs(model, config, *, mode): ...
class Engine:
    def update(self, named, flush_cache=True): ...
"""

CALLER = """
def refit(self):
    self.engine.update(weights, flush_cache=False)
    self.engine.update(weights, flush=False)
    self.engine.update(a, b, c)
    load(model, config, strict=False, mode=1)
    other.engine.update()
"""


def test_signatures_and_calls_say_what_no_longer_fits():
    engine = methods(ENGINE, "Engine")["update"]
    calls = calls_on(CALLER, "self.engine")
    assert [(c.name, c.line) for c in calls] == [("update", 3), ("update", 4), ("update", 5)]
    assert [engine.accepts(c.positional, c.keywords, bound=True) for c in calls] == [
        [],
        ["no parameter 'flush'"],
        ["3 positional arguments, it takes 2"],
    ]
    (load,) = calls_on(CALLER, "load")
    assert functions(ENGINE)["load"].accepts(load.positional, load.keywords, bound=False) == [
        "no parameter 'mode'"
    ]
    assert functions(ENGINE)["anything"].accepts(9, ("x",), bound=False) == []
    assert functions(ENGINE)["needs"].accepts(1, (), bound=False) == [
        "parameter 'config' is required now",
        "parameter 'mode' is required now",
    ]
    assert functions(ENGINE)["needs"].accepts(1, ("config", "mode"), bound=False) == []
    with pytest.raises(AssertionError, match="class Worker is gone"):
        methods(ENGINE, "Worker")


def test_a_package_is_found_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "engine_pkg" / "sub").mkdir(parents=True)
    (tmp_path / "engine_pkg" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "engine_pkg" / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the interpreter package_dir asks
    root = package_dir("engine_pkg", python=sys.executable)
    assert root == tmp_path / "engine_pkg"
    assert module_source(root, "engine_pkg.sub.mod")[1] == "X = 1\n"
    assert module_source(root, "engine_pkg")[0].name == "__init__.py"
    with pytest.raises(AssertionError, match=r"engine_pkg\.gone is gone"):
        module_source(root, "engine_pkg.gone")
    assert package_dir("no_such_package_nrl") is None
