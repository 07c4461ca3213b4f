"""Stage ``megatron``: the nrl-megatron policy worker (Megatron-Core ``GPTModel``, TP=1): the
refit's Hugging Face-named buckets bit-exact against the checkpoint, packed against padded
logprobs, training steps, logprobs and the hand-over."""

from __future__ import annotations

import time
from typing import Any

from .common import (
    MEGATRON_MISSING,
    Skip,
    StageContext,
    check,
    have_megatron,
    require_model,
    synchronize,
)
from .policy import measure_policy, run_config, train_batch


def check_megatron_path(ctx: StageContext, worker: Any) -> bool:
    """On a GPU the worker must take Megatron's own path (DDP + distributed optimizer) with its
    parameters on the device; on CPU it falls back to torch.optim over the same module (see
    nrl_megatron.worker). Returns whether Megatron's distributed optimizer is in use."""
    uses_megatron_optimizer = worker.megatron_optimizer is not None
    check(
        uses_megatron_optimizer == ctx.on_gpu,
        f"Megatron distributed optimizer in use: {uses_megatron_optimizer} on {ctx.device}",
    )
    devices = {p.device.type for p in worker.module.parameters()}
    check(devices == {ctx.device}, f"parameters on {devices}, expected {ctx.device}")
    return uses_megatron_optimizer


def stage_megatron(ctx: StageContext) -> dict[str, Any]:
    """One rank of the megatron policy (it starts its own one-rank world)."""
    if not have_megatron():
        raise Skip(MEGATRON_MISSING)
    import torch.distributed as dist
    from nrl_megatron.config import MegatronConfig
    from nrl_megatron.worker import MegatronPolicyWorker

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    config = run_config(ctx, "megatron")
    worker = MegatronPolicyWorker(MegatronConfig(), ComponentContext(config=config, seed=0))
    try:
        uses_megatron_optimizer = check_megatron_path(ctx, worker)
        refit = _megatron_refit_content(ctx, worker)
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        # policy.sequence_packing=auto: the steps and logprobs above run packed (THD).
        check(policy.packing, "the megatron policy did not pack (sequence_packing=auto)")
        figures = {**measure_policy(ctx, worker, policy, worker.hf_config.vocab_size), **refit}
        figures.update(_packed_against_padded(ctx, worker, config, policy))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    optimizer = "megatron-distributed" if uses_megatron_optimizer else "torch"
    return {"optimizer": optimizer, "backend": "nccl" if ctx.on_gpu else "gloo", **figures}


def _packed_against_padded(ctx: StageContext, worker, config, packed) -> dict[str, Any]:
    """Logprobs of one batch through the packed (THD) path and the padded one, same weights:
    the packed row attends within each sample (Megatron's ``PackedSeqParams``), so the two
    agree up to the precision's rounding (bf16 on a GPU: different kernel shapes round
    differently; float32 on CPU: within 1e-4 on average)."""
    import attrs
    import torch

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.policy import Policy

    padded = Policy.from_config(
        InProcessGroup(worker), attrs.evolve(config.policy, sequence_packing=False)
    )
    check(not padded.packing, "sequence_packing=false still packs")
    batch = train_batch(ctx, worker.hf_config.vocab_size)
    got, want = packed.get_logprobs(batch), padded.get_logprobs(batch)
    valid = torch.arange(got.shape[1])[None, :] < batch["lengths"][:, None]
    valid[:, 0] = False
    diff = (got - want)[valid].abs()
    mean_tol = 0.05 if ctx.on_gpu else 1e-4
    check(
        float(diff.mean()) <= mean_tol,
        f"packed and padded logprobs differ by {float(diff.mean()):.3g} on average "
        f"(max {float(diff.max()):.3g}; allowed mean {mean_tol})",
    )
    return {
        "packed": True,
        "packed_vs_padded_mean_abs": float(f"{float(diff.mean()):.3g}"),
        "packed_vs_padded_max_abs": float(f"{float(diff.max()):.3g}"),
    }


def _megatron_refit_content(ctx: StageContext, worker) -> dict[str, Any]:
    """What a refit from this worker sends an engine, before any step: the Hugging Face-named
    buckets of ``state_dict_buckets`` (Megatron -> HF conversion, gathered on the device) must
    be bit-exact copies of the checkpoint the worker loaded."""
    import torch
    from safetensors.torch import load_file

    p = ctx.profile
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(require_model(ctx).glob("*.safetensors")):
        saved.update(load_file(str(file)))
    synchronize(ctx)
    started = time.perf_counter()
    sent: dict[str, str] = {}
    total_bytes = buckets = 0
    differ = []
    for bucket in worker.state_dict_buckets(int(p.refit_bucket_mb * 2**20)):
        buckets += 1
        for name, tensor in bucket.items():
            sent[name] = str(tensor.device.type)
            total_bytes += tensor.numel() * tensor.element_size()
            if name in saved and not torch.equal(tensor.cpu(), saved[name]):
                differ.append(name)
    synchronize(ctx)
    seconds = time.perf_counter() - started
    # Tied embeddings: a checkpoint may hold lm_head.weight or not; the engine ties it either way.
    missing = sorted(set(saved) - set(sent) - {"lm_head.weight"})
    extra = sorted(set(sent) - set(saved) - {"lm_head.weight"})
    check(not missing, f"refit lacks {len(missing)} checkpoint tensors, e.g. {missing[:3]}")
    check(not extra, f"refit sends {len(extra)} names the checkpoint lacks, e.g. {extra[:3]}")
    check(not differ, f"refit: {len(differ)} tensors differ from the checkpoint: {differ[:3]}")
    check(set(sent.values()) == {ctx.device}, f"refit buckets on {set(sent.values())}")
    return {
        "refit_tensors": len(sent),
        "refit_buckets": buckets,
        "refit_gb": round(total_bytes / 1e9, 4),
        "refit_gather_gb_per_s": round(total_bytes / 1e9 / seconds, 3),
        "refit_bit_exact": True,
    }
