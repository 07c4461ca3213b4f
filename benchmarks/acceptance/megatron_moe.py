"""Stage ``megatron_moe``: the nrl-megatron policy worker on a tiny Qwen3-MoE built in the work
folder (4 experts, top-2); on ``cuda`` the path CPU cannot build."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .common import (
    MEGATRON_MISSING,
    Skip,
    StageContext,
    check,
    have_megatron,
    load_safetensors,
    peak_memory_gb,
    torch_dtype,
)
from .megatron import check_megatron_path
from .policy import run_config, timed_training, train_batch

MOE_EXPERTS, MOE_TOP_K = 4, 2
"""The tiny Qwen3-MoE of the ``megatron_moe`` stage (as plugins/nrl-megatron/tests/test_moe.py)."""

GROUPED_EXPERTS = ("GroupedMatmulExperts", "TEGroupedMLP", "GroupedMLP")
"""The expert modules that run a layer's local experts as grouped GEMMs: nrl's
``GroupedMatmulExperts`` (nrl_megatron.grouped_experts: torch's ``grouped_mm``, what nrl
builds), and Megatron-Core's ``TEGroupedMLP`` (Transformer Engine) and legacy ``GroupedMLP``;
``SequentialMLP`` loops over the experts, a GEMM pair each."""


def expert_classes(model: Any) -> list[str]:
    """The class names of the experts of every MoE layer in ``model`` (a module with both a
    ``router`` and ``experts``, Megatron-Core's ``MoELayer``; wrappers such as DDP are walked
    through), each once, sorted."""
    return sorted(
        {
            type(module.experts).__name__
            for module in model.modules()
            if hasattr(module, "router") and hasattr(module, "experts")
        }
    )


def _experts_are_grouped(model: Any) -> bool:
    """Whether every MoE layer of ``model`` runs its experts as a grouped GEMM (the GPU path):
    at least one MoE layer, and each one's experts a :data:`GROUPED_EXPERTS` class. By class
    name, so that it needs no Megatron import and is one place to adjust."""
    classes = expert_classes(model)
    return bool(classes) and all(name in GROUPED_EXPERTS for name in classes)


def _moe_model(ctx: StageContext) -> Path:
    """The tiny Qwen3-MoE (every layer a mixture of 4 experts, top-2) in the profile's
    precision, built once per workdir; whatever the profile, the stage checks the MoE path,
    not throughput."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.testing.tiny import build_tiny_model

    target = Path(ctx.workdir) / f"moe-{ctx.profile.dtype}"
    if (target / "config.json").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    source = build_tiny_model(
        partial.with_name(partial.name + "-f32"),
        arch="qwen3_moe",
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    # transformers' router init (std 0.02) routes nearly every token to the same experts;
    # larger router weights spread them, so that the routing and its statistics mean something.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    # Saved in the policy's precision, so that the refit and the export can be bit-exact.
    model = model.to(torch_dtype(ctx.profile.dtype))
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(source).save_pretrained(partial)
    shutil.rmtree(source, ignore_errors=True)
    del model
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def stage_megatron_moe(ctx: StageContext) -> dict[str, Any]:
    """One rank of the megatron policy on the tiny Qwen3-MoE: on ``cuda`` the path CPU cannot
    build (Megatron-Core's ``alltoall`` dispatcher creates a CUDA stream; Megatron DDP with the
    experts in its buffers; the distributed optimizer), bf16; on ``cpu`` the ``allgather``
    dispatcher and torch.optim, float32. Checks, in order: on ``cuda`` the experts run as a
    grouped GEMM (:func:`_experts_are_grouped`; their class is a figure on both devices); the refit's Hugging Face-named
    tensors are transformers' in-memory state dict, each name once, bit-exact; ``export_hf``
    writes the checkpoint's per-expert files, each expert once, bit-exact; logprobs equal
    transformers' forward of the same weights on the device; training steps lower the loss and
    report the router statistics (``train/moe/*``)."""
    if not have_megatron():
        raise Skip(MEGATRON_MISSING)
    import math

    import torch
    import torch.distributed as dist
    from nrl_megatron.config import MegatronConfig
    from nrl_megatron.moe import METRIC_REDUCTIONS
    from nrl_megatron.worker import MegatronPolicyWorker
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.losses.nll import NLLLoss
    from nrl_core.policy import Policy

    p = ctx.profile
    path = _moe_model(ctx)
    # The tiny model's learning rate whatever the profile: a few steps must lower the loss
    # clearly above bf16's rounding (the 0.5B profiles' 1e-4 is sized for the 0.5B model).
    config = run_config(ctx, "megatron", model=path, lr=1e-3)
    dtype = torch_dtype(p.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    worker = MegatronPolicyWorker(MegatronConfig(), ComponentContext(config=config, seed=0))
    try:
        dispatcher = worker.module.config.moe_token_dispatcher_type
        want = "alltoall" if ctx.on_gpu else "allgather"
        check(dispatcher == want, f"MoE token dispatcher {dispatcher!r}, expected {want!r}")
        uses_megatron_optimizer = check_megatron_path(ctx, worker)
        expert_kinds = expert_classes(worker.module)
        check(bool(expert_kinds), "no MoE layer (router and experts) in the built model")
        grouped = _experts_are_grouped(worker.module)
        # The GPU config builds grouped-GEMM experts; SequentialMLP there is the slow path.
        check(
            grouped or not ctx.on_gpu,
            f"experts are {expert_kinds}, not a grouped GEMM ({', '.join(GROUPED_EXPERTS)})",
        )

        # The refit: transformers' in-memory names (experts stacked), each once, bit-exact.
        sent: list[str] = []
        differ = []
        for bucket in worker.state_dict_buckets(int(p.refit_bucket_mb * 2**20)):
            for name, tensor in bucket.items():
                sent.append(name)
                want_t = hf_state.get(name)
                if want_t is None or not torch.equal(tensor.cpu(), want_t):
                    differ.append(name)
        twice = sorted({n for n in sent if sent.count(n) > 1})
        check(not twice, f"refit sends {len(twice)} names more than once, e.g. {twice[:3]}")
        missing = sorted(set(hf_state) - set(sent) - {"lm_head.weight"})
        check(not missing, f"refit lacks {len(missing)} tensors, e.g. {missing[:3]}")
        check(not differ, f"refit: {len(differ)} tensors differ from transformers': {differ[:3]}")

        # The export: the checkpoint's published (per-expert) files, each expert once.
        exported = Path(ctx.workdir) / "moe-export"
        shutil.rmtree(exported, ignore_errors=True)
        worker.export_hf(str(exported))
        saved = load_safetensors(path, load_file)
        written = load_safetensors(exported, load_file)
        experts = [n for n in written if ".mlp.experts." in n]
        layers = worker.hf_config.num_hidden_layers
        # gate, up and down of every expert of every layer, each under its own name.
        check(
            len(experts) == len(set(experts)) == 3 * MOE_EXPERTS * layers,
            f"export holds {len(experts)} expert tensors, expected {3 * MOE_EXPERTS * layers}",
        )
        check(
            written.keys() == saved.keys(),
            f"export names differ from the checkpoint's: {sorted(written.keys() ^ saved.keys())[:3]}",
        )
        differ = [n for n in saved if not torch.equal(written[n], saved[n])]
        check(not differ, f"export: {len(differ)} tensors differ from the checkpoint: {differ[:3]}")

        # Logprobs before any step against transformers' forward of the same weights.
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        batch = train_batch(ctx, worker.hf_config.vocab_size)
        got = policy.get_logprobs(batch).float()
        hf.to(ctx.device)
        ids = batch["input_ids"].to(ctx.device)
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids).logits[:, :-1].float(), -1)
        want_lp = torch.nn.functional.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        del hf
        valid = torch.arange(got.shape[1])[None, :] < batch["lengths"][:, None]
        valid[:, 0] = False
        diff = (got - want_lp.cpu())[valid].abs()
        # float32 on CPU: the experts' outputs are summed in another order (test_moe.py: 1e-5
        # absolute per token); bf16 on a GPU rounds each kernel shape differently.
        mean_tol = 0.05 if ctx.on_gpu else 1e-5
        check(
            float(diff.mean()) <= mean_tol,
            f"Megatron and transformers logprobs differ by {float(diff.mean()):.3g} on average "
            f"(max {float(diff.max()):.3g}; allowed mean {mean_tol})",
        )

        # Training steps with the router statistics of each.
        loss = NLLLoss()
        tokens = int(batch["lengths"].sum())
        first, last, train_s = timed_training(ctx, policy, batch, loss)
        moe = {}
        for key in METRIC_REDUCTIONS:
            check(key in last, f"the step reports no {key} (keys: {sorted(last)})")
            check(math.isfinite(last[key]), f"{key} is {last[key]}")
            moe[f"train/{key}"] = round(float(last[key]), 5)
        # Dropless top-k routing: the busiest expert takes at least the mean load and at most
        # every token (num_experts / top_k times the mean).
        check(
            1 <= moe["train/moe/max_load"] <= MOE_EXPERTS / MOE_TOP_K + 1e-6,
            f"train/moe/max_load {moe['train/moe/max_load']} outside [1, {MOE_EXPERTS / MOE_TOP_K}]",
        )
        peak_gb = peak_memory_gb(ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "dispatcher": dispatcher,
        "experts_class": ",".join(expert_kinds),
        "grouped_gemm": grouped,
        "optimizer": "megatron-distributed" if uses_megatron_optimizer else "torch",
        "backend": "nccl" if ctx.on_gpu else "gloo",
        "dtype": p.dtype,
        "experts": MOE_EXPERTS,
        "top_k": MOE_TOP_K,
        "hf_logprob_mean_abs": float(f"{float(diff.mean()):.3g}"),
        "hf_logprob_max_abs": float(f"{float(diff.max()):.3g}"),
        "refit_tensors": len(sent),
        "refit_bit_exact": True,
        "export_tensors": len(written),
        "export_expert_tensors": len(experts),
        "export_bit_exact": True,
        "train_tokens_per_s": round(tokens * p.train_steps / train_s, 1),
        "loss_first": round(first["loss"], 4),
        "loss_last": round(last["loss"], 4),
        "grad_norm": round(last["grad_norm"], 4),
        "peak_mem_gb": round(peak_gb, 3),
        **moe,
    }
