"""Stage ``memory_plan``: the memory preflight's static estimate of a policy GPU against what
torch really allocates, for the ``dtensor`` stage's layout (FSDP2 on one GPU) and the
``megatron`` one (Megatron DDP + distributed optimizer, TP=1).

Each layout runs in a process of its own (a clean CUDA context and allocator, and Megatron's
process groups apart from the dtensor one's): the worker is built on the stage's model, the peak
counter reset, then ONE training step (forward, backward, optimizer step) on a tiny batch (2
sequences of 64 tokens); ``torch.cuda.max_memory_allocated()`` after it is the measured static
part: at the optimizer step the weights, the gradients and the optimizer state all live at once,
and the tiny batch keeps activations and logits small beside them.

PASS when ``estimate / measured`` is within :data:`RATIO_BAND` (0.8 to 1.5) for every layout.
The band is asymmetric on purpose: an estimate below the measurement is the dangerous side (a
layout the preflight accepts runs out of memory minutes into the first step), so it may miss at
most 20 %, what transient buffers the plan does not count (FSDP's all-gather and reduce-scatter
buffers, the fused optimizer's temporaries, the tiny batch's activations and logits, the
allocator's rounding) can explain; an estimate above it only refuses some layouts that would
have fit, so it may overcount by half (e.g. a conservative dtype for the gradients).
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Any

from .common import Skip, StageContext, StageFailed, check, free_port, have_megatron, require_model

RATIO_BAND = (0.8, 1.5)
"""Accepted ``estimate / measured`` (see the module docstring for why this band)."""
TINY_BATCH = {"train_batch": 2, "micro_batch": 2, "train_seq": 64}
"""The step's batch: small enough that activations are noise beside the static bytes."""


def _planned_static_bytes(model_dir: Path, options: Any, precision: str) -> int:
    """The memory preflight's static bytes of ONE policy GPU for the model in ``model_dir``
    placed by the backend ``options`` (``DTensorConfig`` or ``MegatronConfig``, as the stage
    builds its worker) on a one-GPU run in ``precision`` (``policy.precision``): the weights,
    gradients and optimizer state (fp32 main weights included) and any gathered compute copy
    the plan counts, in bytes; no logits (no micro batch), no colocated engine, not capped by
    the device's memory. The one call into ``nrl_core.memory_plan``; the stage SKIPs when that
    module is absent."""
    from nrl_core.memory_plan import ModelShape, layout_of, plan_memory

    layout = layout_of(options, num_ranks=1, precision=precision)
    if layout is None:
        raise StageFailed(f"{type(options).__name__} describes no memory layout for one GPU")
    shape = ModelShape.from_folder(model_dir)
    plan = plan_memory(shape, layout, device_bytes=float("inf"))
    return int(plan.total)


def _layouts(ctx: StageContext) -> list[tuple[str, Any]]:
    """The layouts measured here: (policy backend, its options), as the dtensor and megatron
    stages build their workers; megatron only where megatron-core is importable."""
    from nrl_dtensor.config import DTensorConfig

    out: list[tuple[str, Any]] = [("dtensor", DTensorConfig(data_parallel="shard"))]
    if have_megatron():
        from nrl_megatron.config import MegatronConfig

        out.append(("megatron", MegatronConfig()))
    return out


def _measure(ctx_json: str, backend: str, conn: Any) -> None:
    """In a process of its own: build ``backend``'s worker, one training step on the tiny
    batch; sends ``{"peak": bytes, "kept": bytes, "before_step": bytes}`` (or ``{"error":
    text}``) through ``conn``."""
    try:
        import os

        import torch
        import torch.distributed as dist

        from nrl_core.distributed.worker_group import InProcessGroup
        from nrl_core.interfaces import ComponentContext
        from nrl_core.losses.nll import NLLLoss
        from nrl_core.policy import Policy

        from .policy import run_config, train_batch

        ctx = StageContext.from_json(ctx_json)
        options = dict(_layouts(ctx))[backend]  # rebuilt here: nothing but JSON crosses
        config = run_config(ctx, backend)
        if backend == "dtensor":
            from nrl_dtensor.worker import DTensorPolicyWorker

            world = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
            os.environ.update(world, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            context = ComponentContext(config=config, rank=0, world_size=1, seed=config.seed)
            worker = DTensorPolicyWorker(options, context)
        else:
            from nrl_megatron.worker import MegatronPolicyWorker

            worker = MegatronPolicyWorker(options, ComponentContext(config=config, seed=0))
        try:
            policy = Policy.from_config(InProcessGroup(worker), config.policy)
            batch = train_batch(ctx, worker.hf_config.vocab_size)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            policy.train(batch, NLLLoss())
            torch.cuda.synchronize()
            result = {
                "peak": torch.cuda.max_memory_allocated(),
                "kept": torch.cuda.memory_allocated(),
                "before_step": before,
            }
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    conn.send(result)


def _measure_apart(ctx: StageContext, backend: str) -> dict[str, int]:
    """:func:`_measure` in a spawned process (the stage's limit bounds it: it is in the stage's
    process group)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_measure, args=(ctx.to_json(), backend, theirs))
    process.start()
    theirs.close()
    try:
        result = ours.recv()
    except EOFError:  # it died before sending (killed, out of memory)
        process.join()
        result = {"error": f"the measuring process exited {process.exitcode} without a result"}
    process.join()
    if "error" in result:
        print(result["error"], flush=True)  # the stage's log
        last = result["error"].strip().splitlines()[-1]
        raise StageFailed(f"{backend}: {last}")
    return result


def stage_memory_plan(ctx: StageContext) -> dict[str, Any]:
    """Estimate against measurement for each layout (see the module docstring)."""
    try:
        import nrl_core.memory_plan  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "nrl_core.memory_plan":
            raise
        raise Skip("memory plan not available (no nrl_core.memory_plan)") from None
    model_dir = require_model(ctx)
    layouts = _layouts(ctx)
    dtype = ctx.profile.dtype
    estimates = {name: _planned_static_bytes(model_dir, opts, dtype) for name, opts in layouts}
    check(all(v > 0 for v in estimates.values()), f"estimates {estimates}")
    if not ctx.on_gpu:
        shown = ", ".join(f"{name} {v / 2**20:.1f} MiB" for name, v in estimates.items())
        raise Skip(
            "compares with torch.cuda.max_memory_allocated(): needs --device cuda "
            f"(the plan's static estimates here: {shown})"
        )
    tiny = dataclasses.replace(ctx, profile=dataclasses.replace(ctx.profile, **TINY_BATCH))
    figures: dict[str, Any] = {"band": list(RATIO_BAND), "dtype": dtype}
    outside = []
    for name, _ in layouts:
        measured = _measure_apart(tiny, name)
        ratio = estimates[name] / measured["peak"]
        figures[f"{name}_estimate_gb"] = round(estimates[name] / 2**30, 3)
        figures[f"{name}_measured_gb"] = round(measured["peak"] / 2**30, 3)
        figures[f"{name}_kept_gb"] = round(measured["kept"] / 2**30, 3)
        figures[f"{name}_weights_gb"] = round(measured["before_step"] / 2**30, 3)
        figures[f"{name}_ratio"] = round(ratio, 3)
        if not RATIO_BAND[0] <= ratio <= RATIO_BAND[1]:
            outside.append(f"{name} {ratio:.2f}")
    if not have_megatron():
        figures["megatron"] = "not measured: megatron-core not installed"
    check(
        not outside,
        f"estimate / measured outside {RATIO_BAND[0]}-{RATIO_BAND[1]}: {', '.join(outside)} "
        f"({figures})",
    )
    return figures
