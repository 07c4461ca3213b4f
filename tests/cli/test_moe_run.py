"""A mixture-of-experts model through the real CLI (issue 37): `nrl run grpo` on the tiny
Qwen3-MoE (`policy.model_name=tiny-moe`, 2 dtensor ranks in Ray actors, colocated torch
generation) logs its router statistics, and `nrl convert` turns its checkpoint into a Hugging
Face folder in the published per-expert layout that `from_pretrained` loads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a Ray run: minutes on 2 shared cores


def test_grpo_on_the_tiny_moe_logs_router_statistics_and_converts(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    nrl = [sys.executable, "-m", "nrl_core.cli"]
    run = [*nrl, "run", "grpo", "-q", "policy.model_name=tiny-moe", "grpo.max_num_steps=2"]
    run += ["grpo.val_period=0", "grpo.sft_warmup_steps=0", f"logger.log_dir={tmp_path}"]
    run += [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "cluster.num_cpus=2"]
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (metrics_file,) = tmp_path.glob("*/metrics.jsonl")
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    trained = [s for s in steps if "train/loss" in s]
    assert [s["step"] for s in trained] == [1, 2]
    for step in trained:
        # 4 experts, top-2: a coefficient of variation in [0, 1], the busiest at most 2x.
        assert 0 <= step["train/moe/load_cv"] <= 1
        assert 1 <= step["train/moe/max_load"] <= 2
        assert math.isfinite(step["train/moe/aux_loss"])

    out = tmp_path / "hf"
    convert = [*nrl, "convert", str(tmp_path / "ckpt"), "--to", "hf", str(out), "-q"]
    done = subprocess.run(convert, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
