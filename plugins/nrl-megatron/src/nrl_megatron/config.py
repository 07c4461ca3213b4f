"""Options of the megatron policy (``policy.megatron``). Import-light: only attrs."""

from typing import Any

import attrs

from nrl_core.config.schema import Valid, between, ge, gt, option

LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
"""LoRA target (the Hugging Face projection, peft's ``target_modules`` name) -> the Megatron
layer that computes it inside a decoder layer (q/k/v share the fused ``linear_qkv``, gate/up the
fused ``linear_fc1``; :mod:`nrl_megatron.lora`)."""


@attrs.define
class MegatronConfig:
    tensor_model_parallel_size: int = option(1, "Tensor model parallel degree.", validator=ge(1))
    pipeline_model_parallel_size: int = option(
        1, "Pipeline model parallel degree.", validator=ge(1)
    )
    context_parallel_size: int = option(1, "Context parallel degree.", validator=ge(1))
    expert_model_parallel_size: int = option(1, "Expert parallel degree (MoE).", validator=ge(1))
    transformer_engine: bool = option(
        False, "Use the Transformer Engine layer spec (GPU, extra `te`)."
    )
    grad_reduce_in_fp32: bool = option(
        True,
        (
            "GPU (Megatron DDP): keep the gradient buffer in fp32, so that gradients summed over "
            "micro batches and reduced over data-parallel ranks do not round to bf16 at each "
            "add (Megatron's own default is false). Costs 4 bytes per local parameter instead "
            "of 2 (Qwen3-30B-A3B at EP=8: 19.3 GiB instead of 9.6 per GPU); set false when the "
            "memory plan says it does not fit. On CPU the torch optimizer keeps fp32 gradients "
            "either way."
        ),
    )
    optimizer_cpu_offload: bool = option(
        False,
        (
            "GPU: keep `optimizer_offload_fraction` of Adam's moments on the CPU and step them "
            "there (megatron-core's HybridDeviceOptimizer; decoupled weight decay, as AdamW "
            "here). The fp32 main weights stay on the GPU (4 bytes per parameter over the "
            "data-parallel shards), the moments leave it (8 bytes). Slower steps (host copies "
            "and a CPU Adam); the fix when the optimizer state does not fit, e.g. experts at "
            "expert-DP 1."
        ),
    )
    optimizer_offload_fraction: float = option(
        1.0,
        "Share of the optimizer state offloaded with `optimizer_cpu_offload=true` (0 to 1).",
        validator=between(0, 1),
    )

    lora_rank: int = option(
        0,
        (
            "LoRA rank (0 to 65,536); 0 trains all weights. Above 0 only the adapters train "
            "(the base weights are frozen and out of the optimizer); the same settings and "
            "adapter names as policy.dtensor's (peft's), on Megatron's tensor-parallel layers."
        ),
        validator=between(0, 2**16),
    )
    lora_alpha: float = option(
        16.0, "LoRA scaling numerator (> 0; the update is scaled by alpha/rank).", validator=gt(0)
    )
    lora_dropout: float = option(
        0.0, "Dropout on the LoRA input (0 <= p < 1).", validator=between(0, 1, high_open=True)
    )
    lora_target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        (
            "Hugging Face projections that get LoRA adapters (peft `target_modules`): any of "
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or `all-linear` "
            "for all seven (the LM head never gets one)."
        ),
        validator=Valid(
            "a non-empty list of module names",
            lambda names: bool(names) and all(isinstance(n, str) and n for n in names),
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.lora_rank <= 0:
            return
        unknown = [n for n in self.lora_target_modules if n not in LORA_TARGETS]
        if unknown and self.lora_target_modules != ["all-linear"]:
            raise ValueError(
                f"lora_target_modules={unknown[0]!r} is not a projection of a Megatron "
                f"decoder layer; use some of {', '.join(LORA_TARGETS)} or all-linear"
            )
        if self.transformer_engine:
            raise ValueError(
                "LoRA (lora_rank > 0) runs on the local layer spec only: Transformer Engine's "
                "layers fuse the norm into q/k/v and gate/up; set transformer_engine=false"
            )

    def lora_targets(self) -> tuple[str, ...]:
        """The resolved LoRA targets (``all-linear`` expanded), in :data:`LORA_TARGETS`'
        order; empty without LoRA."""
        if self.lora_rank <= 0:
            return ()
        names = self.lora_target_modules
        return tuple(n for n in LORA_TARGETS if n in names or names == ["all-linear"])

    def memory_layout(self, *, num_ranks: int, precision: str) -> Any:
        """The :class:`nrl_core.memory_plan.Layout` of these options on ``num_ranks`` GPUs
        (the memory preflight's protocol), or ``None`` when the sizes do not divide the ranks
        (the worker reports that one) or with LoRA (only adapters train: no plan). bf16 weights in Megatron's DDP buffers, a gradient
        buffer per ``grad_reduce_in_fp32``, the distributed optimizer (Adam's fp32 main weights
        and moments sharded over DP, experts over expert-DP), vocabulary split over TP."""
        from nrl_core.memory_plan import Layout

        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp, ep = self.context_parallel_size, self.expert_model_parallel_size
        if num_ranks % (tp * pp * cp) or num_ranks % (tp * ep * pp) or self.lora_rank > 0:
            # With LoRA only adapters train, which this plan does not count (no plan).
            return None
        bf16 = precision == "bfloat16"
        key = "policy.megatron"
        fixes = {"optimizer": f"set {key}.optimizer_cpu_offload=true"}
        if self.grad_reduce_in_fp32:
            fixes["grads"] = f"set {key}.grad_reduce_in_fp32=false"
        if not bf16:
            fixes["params"] = "set policy.precision=bfloat16"
        if self.optimizer_cpu_offload and self.optimizer_offload_fraction < 1:
            fixes["optimizer"] = f"set {key}.optimizer_offload_fraction=1.0"
        elif self.optimizer_cpu_offload:
            fixes.pop("optimizer")
        fixes["logits"] = "lower policy.logprob_batch_size / policy.train_micro_batch_size"
        return Layout(
            backend="megatron",
            world=num_ranks,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            param_bytes=2 if bf16 else 4,
            grad_bytes=4 if self.grad_reduce_in_fp32 or not bf16 else 2,
            main_params=bf16,
            optimizer_offload=self.optimizer_offload_fraction if self.optimizer_cpu_offload else 0,
            offload_main_params=False,
            fixes=fixes,
        )

    def required_modules(self) -> dict[str, tuple[str, str]]:
        """Modules the policy's actors must import for these options: ``{module: (extra of
        nrl-megatron that installs it, the setting that needs it)}``, checked by the driver
        before anything starts (:func:`nrl_core.preflight.check_component_requirements`); the
        actor venv is built with those extras
        (:func:`nrl_core.distributed.actor_env.component_extras`). Transformer Engine is not a
        registered extra: it builds only against CUDA, so it cannot go into every venv."""
        if self.transformer_engine:
            return {"transformer_engine": ("te", "transformer_engine=true")}
        return {}
