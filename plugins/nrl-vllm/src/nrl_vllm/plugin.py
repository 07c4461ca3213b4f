"""Registers the vLLM generation backend with nrl."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_generations(register):
    register(
        "vllm",
        "nrl_vllm.worker:VllmGenerationWorker",
        extras=["engine"],
        config="nrl_vllm.config:VllmConfig",
        description="vLLM engines, colocated or on their own GPUs, with bucketed weight refit",
    )
