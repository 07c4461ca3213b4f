"""Fixtures of the algorithm tests: the cached tiny model, an in-process dtensor worker, and
`nrl run ALGO` on the shipped tiny CPU config in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_path():
    """The cached tiny model (built once per machine) rather than a fresh build per session."""
    from nrl_core.testing.tiny import tiny_model_path as cached

    return cached()


@pytest.fixture
def make_policy():
    """``make_policy(model_path, micro_batch_size=, seed=, lora_rank=, lr=)``: the core's policy
    facade (the training step every run uses) over a real dtensor worker in this process (no
    WORLD_SIZE: single process, no FSDP; ``policy.group.worker``), with an SFT config whose
    global batch (64) holds each test batch in one optimizer step, sequences up to 64 tokens."""
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.config.schema import PolicyConfig, SFTConfig
    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    def make(model_path, *, micro_batch_size=4, seed=0, lora_rank=0, lr=1e-2):
        config = SFTConfig(
            seed=seed,
            policy=PolicyConfig(
                model_name=str(model_path),
                train_global_batch_size=64,
                train_micro_batch_size=micro_batch_size,
                max_total_sequence_length=64,
            ),
        )
        config.policy.optimizer.lr = lr
        options = DTensorConfig(lora_rank=lora_rank)
        worker = DTensorPolicyWorker(options, ComponentContext(config=config, seed=seed))
        return Policy.from_config(InProcessGroup(worker), config.policy)

    return make


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli(algorithm, *overrides)``: `nrl run ALGO --config
    examples/configs/ALGO_tiny_cpu.yaml` in a subprocess, logs and checkpoints (``ckpt/``) under
    the test's ``tmp_path``; returns the metrics records."""

    def run(algorithm: str, *overrides: str) -> list[dict]:
        env = {**os.environ, "NRL_ACTOR_ENV": "system"}
        args = [
            sys.executable,
            "-m",
            "nrl_core.cli",
            "run",
            algorithm,
            "--config",
            str(REPO / "examples" / "configs" / f"{algorithm}_tiny_cpu.yaml"),
            f"logger.log_dir={tmp_path}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "cluster.num_cpus=2",
            *overrides,
        ]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        metrics = tmp_path / f"{algorithm}-tiny-cpu" / "metrics.jsonl"
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    return run
