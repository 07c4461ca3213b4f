"""Which vLLM releases nrl-vllm runs on, and what each needs from the engine actor's process.

nrl-vllm is written against vLLM 0.32.0 (the ``engine`` extra's pin). It also runs on vLLM
0.26.0, the newest release built for torch 2.11 (the torch of the lent GPU machines:
``benchmarks/gpu_bundle.py --vllm`` carries it there). Every vLLM name nrl-vllm uses was
checked in both releases' sources (plugins/nrl-vllm/README.md, "Supported vLLM versions"): the
``LLM``/``AsyncLLM`` calls, the ``EngineArgs`` fields and ``SamplingParams`` keywords, the
engine-core client's internals read by the engine-core watch, the worker attributes and the
layerwise reload used by the weight receiver. The differences that matter are handled here:

* :func:`engine_environment`: vLLM's top-k/top-p sampler imports FlashInfer on CUDA unless
  ``VLLM_USE_FLASHINFER_SAMPLER=0`` (both releases, ``vllm/v1/sample/ops/topk_topp_sampler.py``,
  ``TopKTopPSampler.__init__`` with a raw logprobs mode): without FlashInfer installed (it is
  not carried to the lent machines) the engine would die at start-up.
* :func:`check_vllm_version`: one line naming an unsupported release, before the engine starts.

Import-light: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import importlib.util
import warnings

from nrl_core.errors import NrlError

SUPPORTED_VLLM = ("0.26", "0.32")
"""vLLM release series nrl-vllm runs on (``major.minor``; any patch release): 0.32 is the
``engine`` extra's pin, 0.26 the newest built for torch 2.11. Releases between them were not
checked (a warning); older or newer ones are refused (:func:`check_vllm_version`)."""


def _series(version: str) -> tuple[int, int]:
    from packaging.version import Version

    release = Version(version).release
    return release[0], release[1] if len(release) > 1 else 0


def check_vllm_version(version: str) -> None:
    """Raise :class:`~nrl_core.errors.NrlError` (one line) when vLLM ``version`` is outside
    :data:`SUPPORTED_VLLM`'s range; warn when it lies between two supported series (not
    checked). Local versions (``0.32.0+cpu``) count as their release."""
    series = _series(version)
    supported = sorted(_series(s) for s in SUPPORTED_VLLM)
    if series in supported:
        return
    names = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM)
    if supported[0] < series < supported[-1]:
        warnings.warn(
            f"vLLM {version} was not checked against nrl-vllm (checked: {names}); "
            "vllm==0.32.0 is the pinned one",
            stacklevel=2,
        )
        return
    raise NrlError(
        f"vLLM {version} is not supported by nrl-vllm (supported: {names}); install "
        "vllm==0.32.0 (`nrl venvs build vllm`, or nrl-vllm[engine])"
    )


def engine_environment() -> dict[str, str]:
    """Environment variables the engine's processes need here, to set before vLLM is imported
    (its engine-core and worker processes inherit them).

    Without FlashInfer: ``VLLM_USE_FLASHINFER_SAMPLER=0``, else vLLM's sampler imports its
    FlashInfer backend on CUDA and the engine fails at start-up (vLLM 0.26.0 and 0.32.0 alike;
    the lent GPU machines get vLLM without FlashInfer, see benchmarks/gpu_bundle.py). A value
    the user set wins (the caller only fills in what is unset)."""
    env: dict[str, str] = {}
    if importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env
