"""A policy rank and a generation engine that record what the core asks of them.

For testing what the core owns between components — placement on (logical) GPUs, the order of
the memory hand-off around colocated engines, refit delivery — without the GPU engines, which
cannot run on a CPU machine. The refit is real: the policy sends its tensors through
:class:`~nrl_core.weight_sync.WeightSender` and the engine opens them with
:func:`~nrl_core.weight_sync.receive_into`. Register them as a test plugin (``policy.backend`` /
``generation.backend`` ``recording``) and read ``events()`` from every rank: each event is
``(time_ns, name, detail)``, comparable across processes of one machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import attrs

from nrl_core.config.schema import (
    ENGINE_DTYPES,
    REFIT_TRANSPORTS,
    EngineOptions,
    ge,
    one_of,
    option,
)
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams


def _where() -> dict[str, Any]:
    """The GPUs Ray gave this actor, as it sees them."""
    from nrl_core.distributed.devices import ray_gpu_ids, visible_gpu_index

    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ray_gpu_ids": ray_gpu_ids(),
        "gpu_index": visible_gpu_index(),
        "pid": os.getpid(),
    }


class _Recorder:
    def __init__(self) -> None:
        self._events: list[tuple[int, str, Any]] = []

    def _record(self, name: str, detail: Any = None) -> None:
        self._events.append((time.time_ns(), name, detail))

    def events(self) -> list[tuple[int, str, Any]]:
        """Everything recorded so far, oldest first."""
        return list(self._events)

    def where(self) -> dict[str, Any]:
        """``CUDA_VISIBLE_DEVICES``, Ray's GPU ids and the GPU index the core would pick."""
        return _where()

    def where_env(self) -> dict[str, str | None]:
        """The rank variables the worker group set (``RANK``, ``LOCAL_RANK``, ...)."""
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        return {key: os.environ.get(key) for key in keys}


class RecordingPolicyWorker(_Recorder):
    """A policy rank holding a few named tensors; records offload/onload, refits and the
    state calls. Built as ``RecordingPolicyWorker(options, context)``."""

    def __init__(self, options: Any, context: ComponentContext) -> None:
        import torch

        super().__init__()
        self.rank = context.rank
        self.weights = {
            "model.embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "model.head.bias": torch.full((5,), 0.5),
        }

    def offload(self, what: list[str]) -> None:
        self._record("offload", sorted(what))

    def onload(self) -> None:
        self._record("onload")

    def push_weights(self, sender: Any, bucket_bytes: int) -> Any:
        self._record("push_weights")
        return sender.send(iter([dict(self.weights)]), rank=self.rank)

    def set_reference(self, path: str) -> None:
        self._record("set_reference", path)

    def save_checkpoint(self, path: str) -> None:
        self._record("save_checkpoint", path)


@attrs.define
class RecordingEngineConfig(EngineOptions):
    """The generation options the core reads from an engine plugin (as ``generation.vllm``):
    :class:`~nrl_core.config.schema.EngineOptions`, with defaults for a CPU test."""

    colocated: bool = option(False, "Share the policy's GPUs.")
    refit_bucket_mb: int = option(1, "Refit bucket size (MiB).", validator=ge(1))
    refit_transport: str = option(
        "shm", "Refit transport (shm runs on CPU).", validator=one_of(*REFIT_TRANSPORTS)
    )
    dtype: str | None = option(
        None,
        "Weight dtype of the engine.",
        validator=attrs.validators.optional(one_of(*ENGINE_DTYPES)),
    )


class RecordingEngineWorker(_Recorder):
    """A generation engine that records its calls and keeps the weights it receives; answers
    each prompt with its own tokens reversed. Sleeps at start-up when colocated, as the real
    engines do, and keeps the GPU engines' memory contract
    (:class:`~nrl_core.memory_contract.EngineMemory`): a sleep drops the weights (vLLM level 2),
    a refit wakes them and makes them valid, ``generate`` wakes the KV cache and raises
    :class:`~nrl_core.memory_contract.MemoryContractError` on dropped weights."""

    def __init__(self, options: RecordingEngineConfig | None, context: ComponentContext) -> None:
        from nrl_core.memory_contract import EngineMemory

        super().__init__()
        self.options = options or RecordingEngineConfig()
        self.received: dict[str, list[float]] = {}
        self.memory = EngineMemory(f"recording engine {context.rank}")
        if self.options.colocated:
            self.sleep()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        self.memory.wake_up(sorted(self.memory.sleeping))  # what still sleeps
        self.memory.check_generate()
        self._record("generate", len(prompts))
        tokens = [list(reversed(p)) for p in prompts]
        return GenerationOutput(
            token_ids=tokens,
            logprobs=[[0.0] * len(t) for t in tokens],
            finish_reasons=["stop"] * len(tokens),
        )

    def sleep(self) -> bool:
        """Drops the weights (returns False: they do not survive)."""
        self._record("sleep")
        self.memory.sleep(keeps_weights=False)
        return False

    def begin_weight_update(self) -> None:
        self._record("begin_weight_update")
        if "weights" in self.memory.sleeping:
            self.memory.wake_up(["weights"])
        self.memory.begin_refit()

    def receive_bucket(self, meta: Any, handle: Any) -> int:
        from nrl_core.weight_sync import receive_into

        self._record("receive_bucket", meta.names)

        def load(named: list) -> None:
            for name, tensor in named:
                self.received[name] = tensor.reshape(-1).tolist()

        return receive_into(meta, handle, load)

    def finish_weight_update(self) -> None:
        self._record("finish_weight_update")
        self.memory.finish_refit()

    def weights(self) -> dict[str, list[float]]:
        """The flattened values of every tensor received so far."""
        return dict(self.received)
