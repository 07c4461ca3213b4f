"""Registers the SGLang generation backend with nrl."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_generations(register):
    register(
        "sglang",
        "nrl_sglang.worker:SglangGenerationWorker",
        extras=["engine"],
        config="nrl_sglang.config:SglangConfig",
        description="SGLang engines with weight refit through SGLang's update-weights API",
    )
