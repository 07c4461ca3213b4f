"""Stage ``grpo_step``: ``nrl run grpo`` through the real CLI on the built model, 2 steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import StageContext, check, require_model
from .profiles import GRACE_S

GRPO_KEYS = (
    "timing/step_s",
    "timing/generation_s",
    "timing/logprobs_s",
    "timing/train_s",
    "timing/refit_s",
    "throughput/tokens_per_s",
    "train/loss",
    "train/response_length_mean",
    "train/gen_logprob_error",
    "train/gen_logprob_error_max",
)


def stage_grpo_step(ctx: StageContext) -> dict[str, Any]:
    """``nrl run grpo`` for 2 steps on the built model; figures of the last step."""
    import math

    path = require_model(ctx)
    log_dir = Path(ctx.workdir) / "grpo"
    shutil.rmtree(log_dir, ignore_errors=True)  # a finished run would not train again
    steps = 2
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        "-q",
        f"policy.model_name={path}",
        f"policy.precision={ctx.profile.dtype}",
        "policy.backend=dtensor",
        "policy.num_workers=1",
        f"policy.optimizer.lr={ctx.profile.lr}",
        "generation.backend=torch",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.sft_warmup_steps=0",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.run_name=run",
        "cluster.num_cpus=2" if not ctx.on_gpu else f"cluster.num_cpus={os.cpu_count() or 2}",
        f"cluster.gpus_per_node={1 if ctx.on_gpu else 0}",
        f"cluster.worker_timeout_s={ctx.limit_s}",
        # The trainer recomputes the rollouts' logprobs, so that train/gen_logprob_error
        # measures how far torch generation and the trainer agree (bf16 on a GPU).
        "loss.clipped_pg.on_policy_shortcut=false",
        *ctx.profile.grpo_overrides,
    ]
    print("$", " ".join(command), flush=True)
    # NRL_ACTOR_ENV=system: the actors run in this interpreter, no per-plugin venv is built.
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    run = subprocess.Popen(command, env=env)
    try:
        code = run.wait(max(30, ctx.limit_s - GRACE_S))
    except subprocess.TimeoutExpired:
        run.terminate()  # nrl stops its Ray head and exits 143 on SIGTERM
        code = run.wait()
    check(code == 0, f"nrl run grpo exited {code}; its log: {log_dir / 'run' / 'nrl.log'}")
    lines = (log_dir / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    trained = [r for r in records if "timing/step_s" in r]
    check(len(trained) == steps, f"{len(trained)} training steps logged, want {steps}")
    last = trained[-1]
    missing = [k for k in GRPO_KEYS if k not in last]
    check(not missing, f"metrics.jsonl lacks {missing}")
    check(last["throughput/tokens_per_s"] > 0, "throughput/tokens_per_s is 0")
    check(math.isfinite(last["train/loss"]), f"train/loss is {last['train/loss']}")
    return {
        "tokens_per_s": round(last["throughput/tokens_per_s"], 1),
        "first_step_tokens_per_s": round(trained[0]["throughput/tokens_per_s"], 1),
        "step_s": round(last["timing/step_s"], 3),
        "generation_s": round(last["timing/generation_s"], 3),
        "logprobs_s": round(last["timing/logprobs_s"], 3),
        "train_s": round(last["timing/train_s"], 3),
        "refit_s": round(last["timing/refit_s"], 3),
        "response_length_mean": last["train/response_length_mean"],
        # exp(|trainer - generator| logprob), token mean and max: 1.0 is exact agreement.
        "gen_logprob_error": round(last["train/gen_logprob_error"], 5),
        "gen_logprob_error_max": round(last["train/gen_logprob_error_max"], 4),
        "steps": steps,
    }
