"""Options of the dtensor policy (``policy.dtensor``) and torch generation (``generation.torch``).

Import-light: only attrs. The CLI validates configs with these classes without torch.
"""

from typing import Any, ClassVar, Literal

import attrs

from nrl_core.config.schema import Valid, between, ge, gt, option


@attrs.define
class DTensorConfig:
    tensor_parallel_size: int = option(
        1,
        (
            "Tensor parallel degree via DTensor plans (Llama/Qwen2-style models); must divide the "
            "number of ranks and the number of key/value heads."
        ),
        validator=ge(1),
    )
    data_parallel: Literal["auto", "shard", "replicate"] = option(
        "auto",
        (
            "How data-parallel ranks hold the model. `shard`: FSDP2 (ZeRO-3), each rank keeps "
            "a 1/N shard of the weights, gradients and optimizer state and gathers the weights "
            "to compute. `replicate`: every rank keeps the whole model and optimizer state, as "
            "in DDP; one all-reduce averages the gradients per step (through shared memory "
            "between CPU ranks of one host), and nothing else is exchanged (not with "
            "tensor_parallel_size > 1 or cpu_offload). `auto`: `replicate` "
            "on CPU without tensor parallelism or cpu_offload when N copies of the training "
            "state (16 bytes per parameter with AdamW) take at most half of the host's memory, "
            "`shard` otherwise (always on GPUs)."
        ),
        validator=attrs.validators.in_(("auto", "shard", "replicate")),
    )
    activation_checkpointing: bool = option(False, "Recompute activations in backward.")
    cpu_offload: bool = option(False, "FSDP2 CPU offload of parameters and gradients.")
    fsdp_units: Literal["auto", "blocks", "model"] = option(
        "auto",
        (
            "What FSDP2 gathers and reduces as one unit (sharded weights only, see "
            "`data_parallel`). `blocks`: each decoder block, freed after its forward and "
            "gathered again in the backward (least memory; on GPUs FSDP "
            "overlaps a block's communication with the next block's compute). `model`: the "
            "whole model, one all-gather and one reduce-scatter per step (full weights and "
            "gradients on every rank during a step; the optimizer state stays sharded). "
            "`auto`: `blocks` on GPUs, `model` on CPU, where collectives cannot overlap compute "
            "and each unit only adds a synchronisation point."
        ),
        validator=attrs.validators.in_(("auto", "blocks", "model")),
    )
    head: str = option(
        "auto",
        (
            "Model head: `lm` (causal LM; logprobs), `scalar` (a one-output score head, "
            "AutoModelForSequenceClassification with num_labels=1, for reward models; its "
            "per-token values stand where logprobs are), or `auto` (`scalar` for `nrl run rm` "
            "and for the critic of `nrl run ppo`, whose fresh head starts at zero; `lm` "
            "otherwise)."
        ),
        validator=attrs.validators.in_(("auto", "lm", "scalar")),
    )
    lora_rank: int = option(
        0,
        (
            "LoRA rank; 0 trains all weights. Above 0 only adapters are trained, which needs "
            "`peft` in the policy's actor environment (the plugin's `lora` extra)."
        ),
        validator=ge(0),
    )
    lora_alpha: float = option(
        16.0, "LoRA scaling numerator (the update is scaled by alpha/rank).", validator=gt(0)
    )
    lora_dropout: float = option(
        0.0, "Dropout on the LoRA input.", validator=between(0, 1, high_open=True)
    )
    lora_target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get LoRA adapters (peft `target_modules`; `all-linear` for all).",
        validator=Valid(
            "a non-empty list of module names",
            lambda names: bool(names) and all(isinstance(n, str) and n for n in names),
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.data_parallel == "replicate" and self.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel=replicate does not combine with tensor_parallel_size > 1; use "
                "data_parallel=shard (or auto)"
            )
        if self.data_parallel == "replicate" and self.cpu_offload:
            raise ValueError(
                "cpu_offload is FSDP2's offload of sharded weights; use data_parallel=shard "
                "(or auto) with it"
            )

    def memory_layout(self, *, num_ranks: int, precision: str) -> Any:
        """The :class:`nrl_core.memory_plan.Layout` of these options on ``num_ranks`` GPUs
        (the memory preflight's protocol), or ``None`` when ``tensor_parallel_size`` does not
        divide the ranks. FSDP2 keeps fp32 master weights and fp32 gradients sharded over the
        data-parallel ranks and gathers each unit in ``policy.precision`` to compute; the TP
        plan leaves the embedding and LM head whole on every TP rank; with LoRA only adapters
        train, which this plan does not count (no plan)."""
        from nrl_core.memory_plan import Layout

        tp = self.tensor_parallel_size
        if num_ranks % tp or self.lora_rank > 0:
            return None
        key = "policy.dtensor"
        fsdp = self.data_parallel != "replicate"
        return Layout(
            backend="dtensor",
            world=num_ranks,
            tp=tp,
            param_bytes=4,
            grad_bytes=4,
            fsdp=fsdp,
            gathered="model" if self.fsdp_units == "model" else "blocks",
            vocab_tp=False,
            main_params=False,
            params_offload=self.cpu_offload,
            fixes={
                "params": f"set {key}.cpu_offload=true",
                "optimizer": f"set {key}.cpu_offload=true",
                "gathered": f"set {key}.fsdp_units=blocks",
                "logits": "lower policy.logprob_batch_size / policy.train_micro_batch_size",
            },
        )

    def required_modules(self) -> dict[str, tuple[str, str]]:
        """Modules the policy's actors must import for these options: ``{module: (extra of
        nrl-dtensor that installs it, the setting that needs it)}``; the driver checks them
        before anything starts (:func:`nrl_core.preflight.check_component_requirements`)."""
        return {"peft": ("lora", f"lora_rank={self.lora_rank}")} if self.lora_rank > 0 else {}


@attrs.define
class TorchGenerationConfig:
    # Separate torch engines load the policy's state dict into a transformers model as it is
    # (nrl_core.config.schema.EngineOptions.weight_layout).
    weight_layout: ClassVar[str] = "in_memory"
    # Separate torch engines apply adapter-only LoRA refits through peft (TorchEngine), which
    # their venv then gets with the `lora` extra (nrl_core.distributed.actor_env).
    accepts_lora_adapters: ClassVar[bool] = True
    lora_adapter_extras: ClassVar[tuple[str, ...]] = ("lora",)

    def in_flight_refit_problem(self) -> str | None:
        """Separate torch engines swap a refit in between two decode steps of a call in
        flight (:class:`nrl_dtensor.engine.TorchEngine`); generation inside the policy
        workers has no refit to land."""
        if self.colocated:
            return "set generation.torch.colocated=false (separate engines)"
        return None

    generation_batch_size: int = option(
        64, "Prompts generated together per rank (1 to 65,536).", validator=between(1, 2**16)
    )
    stop_at_eos: bool = option(
        True, ("Stop a sample at the tokenizer's EOS token (off only for fixed-length benchmarks).")
    )
    gather_weights_once: bool = option(
        True,
        "All-gather the FSDP-sharded weights once per generation call and keep them gathered "
        "until it returns: one full copy of the weights per rank meanwhile, and no collective "
        "per decode step (none at all without tensor parallelism). `false`: FSDP gathers each "
        "layer at every decode step (least memory, much slower).",
    )
    colocated: bool = option(
        True,
        "`true`: generate inside the policy workers from the policy's own weights (no refit). "
        "`false`: separate engines, each a Ray worker holding its own copy of the weights and "
        "refitted from the policy through shared memory after every training step (the path "
        "vLLM and SGLang take; needed by `grpo.async`).",
    )
    num_engines: int = option(
        1,
        "Separate engines when `colocated=false` (data parallel: each gets an even share of "
        "the prompts). Each takes one GPU on a GPU cluster, a share of a core on CPU.",
        validator=ge(1),
    )
    refit_bucket_mb: int = option(
        64,
        "Size bound of each weight bucket sent to separate engines, in MB (>= 1).",
        validator=ge(1),
    )
    refit_transport: Literal["shm"] = option(
        "shm",
        "How weights reach separate torch engines: `shm` (shared memory; policy and engines on "
        "one node), the only transport they implement.",
        validator=attrs.validators.in_(("shm",)),
    )
