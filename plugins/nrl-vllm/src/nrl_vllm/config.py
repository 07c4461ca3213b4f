"""Options of the vLLM generation backend (``generation.vllm``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import option


@attrs.define
class VllmConfig:
    tensor_parallel_size: int = option(1, "GPUs per engine.")
    num_engines: int = option(1, "Engines (data parallel).")
    colocated: bool = option(True, "Share GPUs with the policy (sleep/wake between phases).")
    gpu_memory_utilization: float = option(0.6, "Fraction of GPU memory vLLM may use.")
    enforce_eager: bool = option(False, "Disable CUDA graphs.")
    async_engine: bool = option(False, "Use vLLM's async engine.")
    expose_http_server: bool = option(False, "Serve an OpenAI-compatible endpoint for agents.")
    refit_bucket_mb: int = option(512, "Size bound of each weight bucket during refit.")
    dtype: str = option("bfloat16", "Engine weight and activation dtype (refit casts to it).")
    max_model_len: int | None = option(None, "Context length (default: the model's).")
    logprobs_mode: str = option(
        "auto",
        "vLLM logprobs_mode; `auto` picks the mode that matches the trainer's logprobs "
        "(see docs/generation-engines.md).",
    )
    sleep_level: int = option(1, "vLLM sleep level between phases when colocated (1 or 2).")
    refit_transport: str = option(
        "auto", "`auto` (cuda_ipc when colocated, nccl otherwise), `cuda_ipc`, `nccl` or `shm`."
    )
