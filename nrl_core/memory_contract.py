"""The memory contract of a colocated generation engine, and its strict emulation on CPU.

A colocated GPU engine (vLLM sleep mode, SGLang's memory saver) shares its GPU with the policy:
it *sleeps* (frees its memory) while the policy trains and *wakes* before it generates. Two of
its rules are easy to break in driver code and invisible on CPU, where the engines have no
sleep mode at all:

* **Weights are lost at a deep sleep.** vLLM ``sleep(level=2)`` discards them (level 1 keeps a
  host copy); SGLang releases them without a copy unless ``enable_weights_cpu_backup``. Only a
  refit makes them valid again: a generate before it runs on undefined memory (silently wrong
  tokens, or an illegal-address crash).
* **A tag is woken once.** vLLM 0.32.0's executor ignores a ``wake_up(tags)`` that names an
  awake tag: it logs a warning and wakes *nothing* (``vllm/v1/executor/abstract.py``), so the
  KV cache would stay unmapped. An allocator that re-maps mapped memory on a tag-less wake
  fails in ``cuMemMap`` (GPU review 3, B1, read against newer vLLM sources; 0.32.0's
  ``cumem.py`` skips awake allocations). SGLang refuses to resume a tag it does not hold as
  released. A refit wakes ``weights`` only, so the next generate wakes ``kv_cache`` only.

:class:`EngineMemory` is that contract as state: which tags sleep and whether the weights are
valid, raising :class:`MemoryContractError` on any breach. With ``NRL_MEMORY_CONTRACT=1``
(:func:`enabled`; the test suite and ``nox -s plugin-*`` set it) the CPU engines (the torch
engine, vLLM's CPU build through nrl's worker extension) keep one and honour it as a GPU engine
would, and the core drives the sleep/wake hand-off of ``colocated`` engines on CPU too, so the
CPU tests run the GPU path's order of calls. An engine plugin's CPU implementation uses this
module; see docs/testing.md, "The memory contract".

Import-light (no torch at import): the driver imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from nrl_core.errors import NrlError

ENV_VAR = "NRL_MEMORY_CONTRACT"
"""Set to ``1`` to make CPU engines emulate GPU sleep mode strictly (see :func:`enabled`)."""

TAGS = ("weights", "kv_cache")
"""The memory regions of an engine, as vLLM names them (SGLang adds ``cuda_graph``, which
follows ``kv_cache`` here)."""


class MemoryContractError(NrlError):
    """An engine was asked for something its memory state does not allow (generate on lost
    weights, wake an awake tag, refit sleeping weights)."""


def enabled() -> bool:
    """Whether CPU engines emulate GPU sleep mode strictly (``NRL_MEMORY_CONTRACT=1``, read
    in each process: an engine actor inherits it from the driver that started the cluster)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class EngineMemory:
    """The memory state of one engine: the tags that sleep and whether the weights hold a
    refit's values. Starts awake with valid weights (an engine loads its model folder).

    Every method checks the contract first and raises :class:`MemoryContractError`, naming
    the call and the state, when it is broken; nothing changes then.
    """

    def __init__(self, name: str = "engine") -> None:
        self.name = name
        self.sleeping: set[str] = set()
        """Tags (:data:`TAGS`) whose memory is freed now."""
        self.weights_valid = True
        """False from a sleep that drops the weights until the next refit finishes."""

    def sleep(self, *, keeps_weights: bool) -> None:
        """Free every awake tag. ``keeps_weights``: the weights survive (vLLM level 1, SGLang
        with a CPU backup); else they are lost until a refit (vLLM level 2)."""
        if "weights" not in self.sleeping and not keeps_weights:
            self.weights_valid = False
        self.sleeping.update(TAGS)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Re-allocate ``tags`` (None: all). Waking a tag that is awake is an error (see the
        module docstring: vLLM wakes nothing, or re-maps mapped memory; SGLang refuses)."""
        wanted = set(TAGS) if tags is None else set(tags)
        unknown = wanted - set(TAGS)
        if unknown:
            raise MemoryContractError(f"{self.name}: unknown memory tag(s) {sorted(unknown)}")
        awake = sorted(wanted - self.sleeping)
        if awake:
            raise MemoryContractError(
                f"{self.name}: wake_up({None if tags is None else sorted(wanted)}) while "
                f"{awake} {'is' if len(awake) == 1 else 'are'} awake; a GPU engine wakes "
                "nothing then (vLLM's executor) or re-maps mapped memory (cuMemMap fails). "
                "Wake only the tags that sleep."
            )
        self.sleeping -= wanted

    def begin_refit(self) -> None:
        """A refit starts: the weights must be awake to be written."""
        if "weights" in self.sleeping:
            raise MemoryContractError(
                f"{self.name}: a refit started while the weights sleep; wake_up(['weights']) first"
            )

    def finish_refit(self) -> None:
        """A refit wrote every weight: they are valid again."""
        self.weights_valid = True

    def check_generate(self) -> None:
        """Generation needs every tag awake and weights that a deep sleep has not dropped."""
        if self.sleeping:
            raise MemoryContractError(
                f"{self.name}: generate while {sorted(self.sleeping)} sleep; wake them first"
            )
        if not self.weights_valid:
            raise MemoryContractError(
                f"{self.name}: generate on weights dropped at sleep (vLLM sleep level 2, SGLang "
                "without a weight backup) and not refitted since; a GPU engine would run on "
                "undefined memory. The driver must refit after such a sleep."
            )

    @property
    def asleep(self) -> bool:
        """Whether any tag sleeps."""
        return bool(self.sleeping)


def drop(tensors: Iterable[Any]) -> None:
    """Fill the floating tensors of ``tensors`` with NaN: what a CPU engine emulating a deep
    sleep holds instead of its weights (on a GPU they are undefined memory), so a generate
    that slipped past :meth:`EngineMemory.check_generate` cannot pass for a correct one."""
    import torch

    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
