"""Options of the SGLang generation backend (``generation.sglang``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import between, ge, one_of, option, optional

ENGINE_DTYPES = ("bfloat16", "float16", "float32")
"""Engine dtypes: torch dtype names, since refit casts the policy's tensors to it."""
REFIT_TRANSPORTS = ("auto", "cuda_ipc", "nccl", "shm")


@attrs.define
class SglangConfig:
    tensor_parallel_size: int = option(1, "GPUs per engine.", validator=ge(1))
    num_engines: int = option(1, "Engines (data parallel).", validator=ge(1))
    colocated: bool = option(True, "Share GPUs with the policy (release/resume memory).")
    mem_fraction_static: float = option(
        0.6, "Fraction of GPU memory SGLang may use.", validator=between(0, 1, low_open=True)
    )
    refit_bucket_mb: int = option(
        512, "Size bound of each weight bucket during refit.", validator=ge(1)
    )
    dtype: str = option(
        "bfloat16",
        "Engine weight and activation dtype (refit casts to it).",
        validator=one_of(*ENGINE_DTYPES),
    )
    context_length: int | None = option(
        None, "Context length (default: the model's).", validator=optional(ge(1))
    )
    refit_transport: str = option(
        "auto",
        "`auto` (cuda_ipc when colocated, nccl otherwise), `cuda_ipc`, `nccl` or `shm`.",
        validator=one_of(*REFIT_TRANSPORTS),
    )
