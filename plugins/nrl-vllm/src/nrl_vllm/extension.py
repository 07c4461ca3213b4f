"""Runs INSIDE each vLLM worker process (vLLM's ``worker_extension_cls``): the engine side of
nrl's weight sync. The engine actor reaches these methods with ``collective_rpc``.

Arguments arrive in their wire form (plain dicts, see ``nrl_core.weight_sync``'s "Wire form"):
vLLM 0.32 msgpack-encodes ``collective_rpc`` arguments on their way to the engine core
(``vllm/v1/engine/core_client.py:1091-1098`` -> ``call_utility``, decoded untyped at
``vllm/v1/engine/core.py:1912-1913``), which turns attrs objects into dicts and refuses Python
types. From the engine core to tensor-parallel workers (``mp`` executor) they are pickled
(``vllm/v1/executor/multiproc_executor.py:427``, ``shm_broadcast.py`` ``enqueue``), which keeps
the dicts as they are.

vLLM adds this class to its worker's bases and refuses any attribute name the worker already
has (``vllm/v1/worker/worker_base.py:301-310``): every name here starts with ``nrl_``.

Imported only in the engine's venv (it touches ``self.model_runner``, a vLLM 0.32 worker
attribute); never imported by the driver.
"""

from __future__ import annotations

from typing import Any

from nrl_core.weight_sync import BucketMeta, handle_from_wire, init_nccl_group, receive_into


class NrlWeightReceiver:
    """Mixed into vLLM's GPU worker class: receives nrl buckets and loads them."""

    def nrl_receive_bucket(self, meta: dict[str, Any], handle: dict[str, Any]) -> int:
        """Open the bucket that ``handle`` (``handle_to_wire``'s form) names, on this worker's
        GPU, and load it with the model's own ``load_weights`` (which fuses q/k/v and gate/up
        and shards for tensor parallelism). ``meta`` is ``BucketMeta.to_wire()``'s form.
        Returns the payload bytes loaded."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return receive_into(
            BucketMeta.from_wire(meta),
            handle_from_wire(handle),
            model.load_weights,
            device=self.device,  # type: ignore[attr-defined]
        )

    def nrl_init_nccl_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's refit group as rank ``rank_offset + tp_rank``."""
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        init_nccl_group(name, master_addr, master_port, rank, world_size, device=self.device)  # type: ignore[attr-defined]

    def nrl_weights_checksum(self) -> dict[str, Any]:
        """Sum of every parameter (float64), for tests that check a refit arrived."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
