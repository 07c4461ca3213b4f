"""Fixtures of the megatron plugin tests: tiny HF models and spawned gloo worlds.

Megatron-Core needs ``torch.distributed`` and ``parallel_state`` in every process that builds a
model, so all Megatron code runs in spawned ranks (``SpawnPool``); the pytest process itself
never initialises ``torch.distributed`` and hosts the single-process dtensor reference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# --import-mode=importlib keeps test folders off sys.path; the helpers must also be importable
# by the spawned ranks (which inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from nrl_core.testing.ranks import SpawnPool


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nrl-cache")


@pytest.fixture(scope="session")
def tiny_path(cache_dir):
    """Tiny Llama (4 heads, 2 key/value groups, untied embeddings)."""
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(cache_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_path(cache_dir):
    """Tiny Qwen2 (q/k/v biases, tied embeddings)."""
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(cache_dir, arch="qwen2", tie_word_embeddings=True)


def _pool(size: int):
    assert "WORLD_SIZE" not in os.environ
    spawned = SpawnPool(size, preload=("transformers", "megatron.core"))
    return spawned


@pytest.fixture(scope="session")
def pool1():
    """One spawned rank (a one-process gloo world)."""
    spawned = _pool(1)
    yield spawned
    spawned.close()


@pytest.fixture(scope="session")
def pool2():
    """Two spawned ranks forming a gloo world."""
    spawned = _pool(2)
    yield spawned
    spawned.close()


@pytest.fixture(scope="session")
def pool4():
    """Four spawned ranks forming a gloo world (pipeline x tensor or data parallel)."""
    spawned = _pool(4)
    yield spawned
    spawned.close()


@pytest.fixture
def start_group():
    """``start_group(pool, target, args)`` -> a group with run_all/run_sharded/shutdown."""
    groups = []

    def start(pool, target: str, args: tuple, name: str = "policy"):
        # Tensor-parallel peers share a data-parallel shard, as in a run's worker group.
        tp = getattr(args[0], "tensor_model_parallel_size", 1) if args else 1
        pp = getattr(args[0], "pipeline_model_parallel_size", 1) if args else 1
        group = pool.start(
            target=target, num_workers=pool.num_workers, args=args, name=name, tp=tp, pp=pp
        )
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.shutdown()
