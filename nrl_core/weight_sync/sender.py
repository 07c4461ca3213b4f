"""The sending side: :class:`WeightSender` iterates a policy's buckets and delivers each to every
engine through the configured transport."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.weight_sync.cuda_ipc import send_ipc
from nrl_core.weight_sync.interface import (
    TRANSPORTS,
    BucketHandle,
    BucketMeta,
    RefitStats,
    WeightSyncError,
)
from nrl_core.weight_sync.layout import CHECKPOINT, WEIGHT_LAYOUTS
from nrl_core.weight_sync.names import NameMap
from nrl_core.weight_sync.nccl import send_nccl
from nrl_core.weight_sync.packing import _dtype
from nrl_core.weight_sync.shm import send_shm

if TYPE_CHECKING:
    import torch

    from nrl_core.weight_sync.adapters import LoraAdapter


@attrs.define
class WeightSender:
    """Pushes a policy's buckets to engine workers; built by the driver, run by the policy.

    The driver creates it with the engine workers' actor handles (``receivers``: Ray actor
    handles of :class:`nrl_core.distributed.worker_group.WorkerGroup` actors whose worker
    implements :class:`~nrl_core.interfaces.WeightSync`) and passes it to every policy rank's ``push_weights``;
    each rank calls :meth:`send` with its bucket iterator.

    Args:
        receivers: one actor handle per engine (its driver-facing worker).
        transport: ``shm`` (CPU, same node), ``cuda_ipc`` (colocated GPUs) or ``nccl``
            (separate GPUs, after :func:`init_nccl_group`).
        name_map: renames policy parameters to engine names (None: same names).
        dtype: cast floating-point tensors to this dtype before sending (e.g. ``"bfloat16"``
            for a bf16 engine fed from float32 master weights: half the bytes).
        nccl_group: the group name for ``nccl``.
        nccl_per_tensor: broadcast each tensor on its own instead of the packed bucket (SGLang's
            ``update_weights_from_distributed`` receives that way).
        timeout_s: bound on each engine's answer per bucket.
        ipc_ranks: for ``cuda_ipc``, the policy ranks whose GPU hosts an engine (None: every
            rank). Only they share a CUDA IPC handle: a handle no engine opens keeps its block
            alive in torch's IPC bookkeeping, so each refit would strand a full copy of the
            weights on every other GPU until it runs out of memory.
        layout: the weight layout the engines load (:data:`~nrl_core.weight_sync.CHECKPOINT`
            or :data:`~nrl_core.weight_sync.IN_MEMORY`); the policy ranks yield their
            buckets in it (``state_dict_buckets(bucket_bytes, layout=sender.layout)``).
        lora_weights: what a LoRA policy's ``push_weights`` streams: ``"merged"`` (the
            adapters merged into the base weights) or ``"base"`` (the base weights alone, for
            engines that then take the adapters on their own: :meth:`send_adapter`). Plain
            names either way; ignored by a policy without LoRA.
    """

    receivers: list[Any]
    transport: str = "shm"
    name_map: NameMap | None = None
    dtype: str | None = None
    nccl_group: str = "nrl-refit"
    nccl_per_tensor: bool = False
    timeout_s: float = 600.0
    ipc_ranks: frozenset[int] | None = None
    layout: str = CHECKPOINT
    lora_weights: str = "merged"

    def __attrs_post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise WeightSyncError(
                f"unknown weight-sync transport {self.transport!r}; use one of {TRANSPORTS}"
            )
        if self.lora_weights not in ("merged", "base"):
            raise WeightSyncError(
                f"unknown lora_weights {self.lora_weights!r}; use 'merged' or 'base'"
            )
        if self.layout not in WEIGHT_LAYOUTS:
            raise WeightSyncError(
                f"unknown weight layout {self.layout!r}; use one of {WEIGHT_LAYOUTS}"
            )

    def _prepare(self, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.name_map is not None:
            bucket = self.name_map.apply(bucket)
        if self.dtype is not None:
            target = _dtype(self.dtype)
            bucket = {k: v.to(target) if v.is_floating_point() else v for k, v in bucket.items()}
        return bucket

    def _call_all(self, method: str, *args: Any) -> list:
        refs = [r.call.remote(method, args, {}) for r in self.receivers]
        return refs if method == "receive_bucket" else self._wait(refs)

    def _post(self, meta: BucketMeta, handle: BucketHandle) -> list:
        """Ask every engine to receive one bucket; the transport awaits the answers (``_wait``)
        when its sending side allows."""
        return self._call_all("receive_bucket", meta, handle)

    def _wait(self, refs: list) -> list:
        import ray

        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if pending:
            raise WeightSyncError(
                f"{len(pending)} engine(s) did not answer a weight update within "
                f"{self.timeout_s:g}s"
            )
        return ray.get(ready)

    def send(
        self,
        buckets: Iterable[dict[str, torch.Tensor]],
        *,
        rank: int = 0,
        gather_object=None,
    ) -> RefitStats | None:
        """Iterate ``buckets`` to the end (on every policy rank: it is a collective there) and
        deliver each to every receiver. Rank 0 talks to the engines and returns the
        :class:`RefitStats`; other ranks return None.

        ``gather_object(obj) -> list`` (all policy ranks' objects in rank order) is needed by
        ``cuda_ipc`` with several policy ranks, so that every GPU's handle reaches the engines.
        """
        started = time.perf_counter()
        lead = rank == 0
        if lead:
            self._call_all("begin_weight_update")
        total = count = tensors = 0
        for raw in buckets:
            bucket = self._prepare(raw)
            if not bucket:
                continue
            if self.transport == "shm":
                if lead:
                    total += send_shm(bucket, self._post, self._wait)
            elif self.transport == "cuda_ipc":
                share = self.ipc_ranks is None or rank in self.ipc_ranks
                total += send_ipc(bucket, self._post, self._wait, lead, gather_object, share)
            elif lead:
                total += send_nccl(
                    bucket, self._post, self._wait, self.nccl_group, self.nccl_per_tensor
                )
            count += 1
            tensors += len(bucket)
        if not lead:
            return None
        self._call_all("finish_weight_update")
        return RefitStats(time.perf_counter() - started, total, count, tensors)

    def send_adapter(self, tensors: dict[str, torch.Tensor], adapter: LoraAdapter) -> RefitStats:
        """Deliver one LoRA adapter (PEFT-named ``tensors`` and its ``adapter`` settings) to
        every engine's ``load_lora_adapter(adapter, meta, handle)``, in one bucket that travels
        with the call (:mod:`nrl_core.weight_sync.adapters`); call on policy rank 0 only.
        Returns the :class:`RefitStats` (the bytes are the adapter's)."""
        from nrl_core.weight_sync.adapters import inline_bucket

        started = time.perf_counter()
        # PEFT names, not the policy's parameter names: the name map does not apply.
        bucket = tensors
        if self.dtype is not None:
            target = _dtype(self.dtype)
            bucket = {k: v.to(target) if v.is_floating_point() else v for k, v in bucket.items()}
        if not bucket:
            raise WeightSyncError("an adapter refit has no adapter tensors to send")
        meta, handle = inline_bucket(bucket)
        self._call_all("load_lora_adapter", adapter, meta, handle)
        return RefitStats(time.perf_counter() - started, meta.payload_bytes, 1, len(bucket))
