"""Options of the SGLang generation backend (``generation.sglang``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import option


@attrs.define
class SglangConfig:
    tensor_parallel_size: int = option(1, "GPUs per engine.")
    num_engines: int = option(1, "Engines (data parallel).")
    colocated: bool = option(True, "Share GPUs with the policy (release/resume memory).")
    mem_fraction_static: float = option(0.6, "Fraction of GPU memory SGLang may use.")
    refit_bucket_mb: int = option(512, "Size bound of each weight bucket during refit.")
    dtype: str = option("bfloat16", "Engine weight and activation dtype (refit casts to it).")
    context_length: int | None = option(None, "Context length (default: the model's).")
    refit_transport: str = option(
        "auto", "`auto` (cuda_ipc when colocated, nccl otherwise), `cuda_ipc`, `nccl` or `shm`."
    )
