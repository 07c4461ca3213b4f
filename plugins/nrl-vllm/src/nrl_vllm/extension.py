"""Runs INSIDE each vLLM worker process (vLLM's ``worker_extension_cls``): the engine side of
nrl's weight sync. The engine actor reaches these methods with ``collective_rpc``.

Imported only in the engine's venv (it touches ``self.model_runner``, a vLLM 0.32 worker
attribute); never imported by the driver.
"""

from __future__ import annotations

from typing import Any

from nrl_core.weight_sync import BucketHandle, BucketMeta, init_nccl_group, receive_into


class NrlWeightReceiver:
    """Mixed into vLLM's GPU worker class: receives nrl buckets and loads them."""

    def nrl_receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Open ``handle`` on this worker's GPU and load the bucket with the model's own
        ``load_weights`` (which fuses q/k/v and gate/up and shards for tensor parallelism)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return receive_into(meta, handle, model.load_weights, device=self.device)  # type: ignore[attr-defined]

    def nrl_init_nccl_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's refit group as rank ``rank_offset + tp_rank``."""
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        init_nccl_group(name, master_addr, master_port, rank, world_size, device=self.device)  # type: ignore[attr-defined]

    def nrl_weights_checksum(self) -> dict[str, Any]:
        """Sum of every parameter (float64), for tests that check a refit arrived."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {n: float(p.double().sum()) for n, p in model.named_parameters()}
