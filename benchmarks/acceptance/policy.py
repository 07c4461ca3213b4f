"""What the policy stages share (``dtensor``, ``megatron``, ``megatron_moe``): the run config,
a training batch, the timed steps and logprobs through the core's ``Policy`` facade, and the
hand-over to colocated engines (offload/onload)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import (
    StageContext,
    check,
    peak_memory_gb,
    require_model,
    reset_peak_memory,
    synchronize,
)


def run_config(ctx: StageContext, backend: str, model: Path | None = None, lr: float | None = None):
    """A GRPO run config whose policy section is the built model (or ``model``) in the
    profile's precision (learning rate: the profile's, or ``lr``)."""
    from nrl_core.config.schema import GRPOConfig, OptimizerConfig, PolicyConfig

    p = ctx.profile
    policy = PolicyConfig(
        backend=backend,
        model_name=str(model or require_model(ctx)),
        precision=p.dtype,
        num_workers=1,
        train_global_batch_size=p.train_batch,
        train_micro_batch_size=p.micro_batch,
        logprob_batch_size=p.micro_batch,
        max_total_sequence_length=p.train_seq,
        max_grad_norm=1.0,
        optimizer=OptimizerConfig(name="adamw", lr=lr or p.lr),
    )
    return GRPOConfig(seed=0, policy=policy)


def train_batch(ctx: StageContext, vocab_size: int):
    """Random sequences, lengths between half and all of ``train_seq``, loss on all but the
    first 4 tokens (a "prompt")."""
    import torch

    from nrl_core.data import Batch, pad_sequences

    p = ctx.profile
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(p.train_seq // 2, p.train_seq + 1, (p.train_batch,), generator=g)
    rows = [torch.randint(7, vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    ids = pad_sequences(rows, pad_value=0)
    pos = torch.arange(ids.shape[1])[None, :]
    return Batch(
        {
            "input_ids": ids,
            "lengths": lengths,
            "loss_mask": ((pos >= 4) & (pos < lengths[:, None])).float(),
            "sample_mask": torch.ones(p.train_batch),
        }
    )


def timed_training(ctx: StageContext, policy, batch, loss) -> tuple[dict, dict, float]:
    """A warm-up step, then the profile's ``train_steps`` timed steps on ``batch`` (peak memory
    counted from the warm-up on); checks that the warm-up loss is finite, that the last grad
    norm is finite and positive, and that the loss went down on the batch it trains on.
    Returns the warm-up's and the last step's metrics and the timed steps' seconds."""
    import math

    reset_peak_memory(ctx)
    first = policy.train(batch, loss)
    check(math.isfinite(first["loss"]), f"warm-up loss is {first['loss']}")
    synchronize(ctx)
    started = time.perf_counter()
    for _ in range(ctx.profile.train_steps):
        last = policy.train(batch, loss)
    synchronize(ctx)
    train_s = time.perf_counter() - started
    check(math.isfinite(last["grad_norm"]) and last["grad_norm"] > 0, f"grad_norm {last}")
    check(
        last["loss"] < first["loss"],
        f"loss did not go down on the batch it trains on: {first['loss']} -> {last['loss']}",
    )
    return first, last, train_s


def measure_policy(ctx: StageContext, worker, policy, vocab_size: int) -> dict[str, Any]:
    """Warm-up step, timed steps and a timed logprob pass over one batch; checks that the
    loss is finite and goes down on the batch it trains on, and that logprobs are sane. Then
    the colocated-engine hand-over (:func:`offload_round_trip`)."""

    import torch

    from nrl_core.losses.nll import NLLLoss

    p = ctx.profile
    batch = train_batch(ctx, vocab_size)
    tokens = int(batch["lengths"].sum())
    loss = NLLLoss()
    first, last, train_s = timed_training(ctx, policy, batch, loss)
    policy.get_logprobs(batch)  # warm-up of the no-grad path
    synchronize(ctx)
    started = time.perf_counter()
    logprobs = policy.get_logprobs(batch)
    synchronize(ctx)
    logprob_s = time.perf_counter() - started
    valid = torch.arange(logprobs.shape[1])[None, :] < batch["lengths"][:, None]
    valid[:, 0] = False
    check(tuple(logprobs.shape) == tuple(batch["input_ids"].shape), f"logprobs {logprobs.shape}")
    check(bool(torch.isfinite(logprobs).all()), "non-finite logprobs")
    check(bool((logprobs[valid] <= 0).all()), "a logprob above 0")
    peak_gb = peak_memory_gb(ctx)
    handover = offload_round_trip(ctx, worker, lambda: policy.train(batch, loss), last["loss"])
    return {
        "train_tokens_per_s": round(tokens * p.train_steps / train_s, 1),
        "logprob_tokens_per_s": round(tokens / logprob_s, 1),
        "tokens_per_step": tokens,
        "train_step_s": round(train_s / p.train_steps, 4),
        "loss_first": round(first["loss"], 4),
        "loss_last": round(last["loss"], 4),
        "grad_norm": round(last["grad_norm"], 4),
        "peak_mem_gb": round(peak_gb, 3),
        "dtype": p.dtype,
        **handover,
    }


def offload_round_trip(ctx: StageContext, worker, train_step, loss_before: float) -> dict:
    """What the core does around a refit into engines colocated on the policy's GPU
    (:class:`nrl_core.generation.GenerationEngines`): ``offload(["optimizer"])``, then
    ``offload(["weights"])``, then ``onload()`` before the next step. On a GPU the memory
    must go down and come back; on CPU both are no-ops. The step after must still train."""
    import math

    def allocated() -> float:
        if not ctx.on_gpu:
            return 0.0
        import torch

        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**30

    before = allocated()
    started = time.perf_counter()
    worker.offload(["optimizer"])
    worker.offload(["weights"])
    offload_s = time.perf_counter() - started
    during = allocated()
    if ctx.on_gpu:
        # Weights, gradients and Adam state are most of what a trained policy holds.
        check(during < 0.5 * before, f"offload left {during:.2f} of {before:.2f} GiB on the GPU")
    started = time.perf_counter()
    worker.onload()
    onload_s = time.perf_counter() - started
    after_onload = allocated()
    after = train_step()
    check(
        math.isfinite(after["loss"]) and after["loss"] < loss_before,
        f"the step after offload/onload did not train: loss {loss_before} -> {after['loss']}",
    )
    return {
        "mem_before_offload_gb": round(before, 3),
        "mem_offloaded_gb": round(during, 3),
        "mem_after_onload_gb": round(after_onload, 3),
        "offload_freed_gb": round(before - during, 3),
        "offload_s": round(offload_s, 3),
        "onload_s": round(onload_s, 3),
        "loss_after_onload": round(after["loss"], 4),
    }
