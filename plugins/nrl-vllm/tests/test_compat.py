"""nrl_vllm.compat without vLLM: the supported versions and the engine's environment."""

from __future__ import annotations

import importlib.util
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
