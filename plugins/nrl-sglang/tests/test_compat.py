"""nrl_sglang.compat: the SGLang releases the worker was checked against, and the installed
SGLang's source against every ``self.engine.<method>(...)`` call the worker makes.

The source test needs SGLang installed in the test's interpreter; the dev environment cannot
hold it (its ``engine`` extra pins torch 2.14.1 and transformers 5.19.0, the dev group the
newest: pyproject's conflicts), so there it skips, saying so. Run it with SGLang importable,
e.g. ``PYTHONPATH=<unpacked sglang wheel> pytest plugins/nrl-sglang/tests/test_compat.py``:
nothing of SGLang is imported, its files are parsed.
"""

from __future__ import annotations

import ast
import inspect

import nrl_sglang.worker
import pytest
from nrl_sglang.compat import CHECKED_SGLANG, check_sglang_version
from nrl_sglang.translate import MEMORY_TAGS

from nrl_core.errors import NrlError
from nrl_core.testing.upstream import calls_on, methods, module_source, package_dir

SGLANG = package_dir("sglang")
requires_sglang = pytest.mark.skipif(
    SGLANG is None,
    reason="SGLang is not installed in this environment (its engine extra conflicts with the "
    "dev group); put an unpacked sglang wheel on PYTHONPATH to run this check",
)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23+cu130"])
def test_checked_releases_pass(version):
    check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "unknown"])
def test_another_release_is_one_line_naming_it(version):
    with pytest.raises(NrlError) as raised:
        check_sglang_version(version)
    message = str(raised.value)
    assert "\n" not in message
    assert f"SGLang {version} was not checked" in message
    assert CHECKED_SGLANG[-1] in message


def test_the_checked_release_is_the_pinned_one():
    """The engine extra's pin is a checked release (an upgrade of the pin re-checks)."""
    from importlib.metadata import requires

    pins = [r for r in requires("nrl-sglang") or [] if r.startswith("sglang==")]
    assert len(pins) == 1, pins
    check_sglang_version(pins[0].split("==")[1].split(";")[0].strip())


@requires_sglang
def test_installed_sglang_has_every_engine_call_the_worker_makes():
    """Each ``self.engine.<method>(...)`` in worker.py exists on the installed
    ``sglang.Engine`` and takes the arguments the worker passes (by line, so an upgrade names
    what moved); ``sglang.Engine`` is still exported; SGLang's "all memory tags" are nrl's."""
    from importlib.metadata import version

    found = version("sglang")
    _, init = module_source(SGLANG, "sglang")
    assert "Engine" in init, f"sglang {found}: sglang/__init__.py no longer names Engine"
    _, source = module_source(SGLANG, "sglang.srt.entrypoints.engine")
    engine = methods(source, "Engine")
    calls = calls_on(inspect.getsource(nrl_sglang.worker), "self.engine")
    assert len({c.name for c in calls}) >= 9  # generate, memory, refit, flush, shutdown...
    wrong = []
    for call in calls:
        if call.name not in engine:
            wrong.append(f"worker.py:{call.line} calls Engine.{call.name}, which is gone")
            continue
        for problem in engine[call.name].accepts(call.positional, call.keywords, bound=True):
            wrong.append(f"worker.py:{call.line} Engine.{call.name}: {problem}")
    assert wrong == [], f"sglang {found}: " + "; ".join(wrong)

    _, constants = module_source(SGLANG, "sglang.srt.constants")
    names: dict[str, object] = {}
    for node in ast.parse(constants).body:  # string constants, then the list naming them
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.List):
                names[node.targets[0].id] = [
                    names.get(e.id) if isinstance(e, ast.Name) else ast.literal_eval(e)
                    for e in value.elts
                ]
            elif isinstance(value, ast.Constant):
                names[node.targets[0].id] = value.value
    tags = names.get("GPU_MEMORY_ALL_TYPES")
    assert tags == list(MEMORY_TAGS), f"sglang {found}: GPU_MEMORY_ALL_TYPES is {tags}"
