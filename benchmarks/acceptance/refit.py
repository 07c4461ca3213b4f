"""Stage ``cuda_ipc_refit``: the built model's weights from one Ray actor to another through
``WeightSender`` (``cuda_ipc`` on one GPU, ``shm`` on CPU), every tensor checked bit-exact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .common import StageContext, check, require_model

BENCHMARKS = Path(__file__).resolve().parents[1]
"""The folder the Ray actors import this package from (``acceptance.refit:RefitEndpoint``)."""


class RefitEndpoint:
    """One end of the refit stage, built in a Ray actor by a WorkerGroup: the sender holds the
    built model's weights (as a policy rank holds its state dict) and pushes them through a
    :class:`~nrl_core.weight_sync.WeightSender`; the receiver implements the engine side of
    :class:`~nrl_core.interfaces.WeightSync` with :func:`~nrl_core.weight_sync.receive_into`
    and keeps copies of what arrived, for the bit-exact check.

    With :meth:`use_wire_form` on, the receiver first sends each message through msgpack in
    nrl's wire form (``BucketMeta.to_wire`` / ``handle_to_wire``), as an engine behind a
    plain-data RPC layer receives it (vLLM's engine core; see nrl_core/weight_sync/wire.py), and
    opens the rebuilt handle: on a GPU, CUDA IPC handles that crossed msgpack."""

    def __init__(self, model_path: str, device: str, dtype: str, load: bool) -> None:
        import torch

        if device == "cuda":
            from nrl_core.distributed.devices import select_cuda_device

            self.device = select_cuda_device()
        else:
            self.device = torch.device("cpu")
        self.tensors: dict[str, torch.Tensor] = {}
        if load:
            from safetensors.torch import load_file

            for file in sorted(Path(model_path).glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    self.tensors[name] = tensor.to(self.device, getattr(torch, dtype))
        self.received: dict[str, torch.Tensor] = {}
        self.updates = 0
        self.wire_form = False

    def memory_gb(self) -> float:
        """GPU memory torch holds in this process (0 on CPU)."""
        import torch

        if self.device.type != "cuda":
            return 0.0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) / 2**30

    def describe(self) -> dict[str, Any]:
        """Process id, device and (on a GPU) the GPU's UUID and CUDA_VISIBLE_DEVICES."""
        import torch

        info = {"pid": os.getpid(), "device": str(self.device)}
        if self.device.type == "cuda":
            info["gpu_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
            info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        return info

    # -- sender

    def push_weights(self, sender, bucket_bytes: int):
        """Send every tensor through ``sender`` (as ``DTensorPolicyWorker.push_weights`` on a
        single rank); returns the :class:`~nrl_core.weight_sync.RefitStats`."""
        from nrl_core.weight_sync import iter_buckets

        return sender.send(iter_buckets(iter(self.tensors.items()), bucket_bytes))

    # -- receiver (WeightSync)

    def use_wire_form(self, on: bool) -> None:
        """Receive the next refits through msgpack in the wire form (see the class doc)."""
        self.wire_form = on

    def begin_weight_update(self) -> None:
        self.received = {}

    def receive_bucket(self, meta, handle) -> int:
        from nrl_core.weight_sync import receive_into

        if self.wire_form:
            import msgpack  # a dependency of Ray, so present wherever this actor runs

            from nrl_core.weight_sync import BucketMeta, handle_from_wire, handle_to_wire

            packed = msgpack.packb([meta.to_wire(), handle_to_wire(handle)])
            wire_meta, wire_handle = msgpack.unpackb(packed)
            meta, handle = BucketMeta.from_wire(wire_meta), handle_from_wire(wire_handle)

        def load(named) -> None:
            for name, tensor in named:
                self.received[name] = tensor.clone()  # the views die with the bucket

        return receive_into(meta, handle, load, device=self.device)

    def finish_weight_update(self) -> None:
        self.updates += 1

    # -- both

    def digests(self, which: str) -> dict[str, str]:
        """sha256 of each tensor's bytes (``which``: ``tensors`` or ``received``)."""
        import hashlib

        import torch

        out = {}
        for name, tensor in getattr(self, which).items():
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha256(raw).hexdigest()
        return out


def stage_cuda_ipc_refit(ctx: StageContext) -> dict[str, Any]:
    """The built model's weights from one Ray actor to another through WeightSender."""
    import uuid

    from nrl_core.config.schema import ClusterConfig, RunConfig
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.weight_sync import WeightSender

    p = ctx.profile
    path = str(require_model(ctx))
    transport = "cuda_ipc" if ctx.on_gpu else "shm"
    config = RunConfig(cluster=ClusterConfig(num_cpus=2, gpus_per_node=1 if ctx.on_gpu else 0))
    cluster = LocalCluster(
        None,
        ComponentContext(config=config),
        log_dir=Path(ctx.workdir) / "refit-ray",
        temp_dir=f"/tmp/nrl-acc-{uuid.uuid4().hex[:6]}",
    )
    cluster.start()
    groups = []
    try:
        # Half a GPU each: Ray places both actors on the one GPU, each with its own narrowed
        # CUDA_VISIBLE_DEVICES, as a colocated policy rank and engine are placed.
        common = {
            "num_cpus_per_worker": 0.5,
            "num_gpus_per_worker": 0.5 if ctx.on_gpu else 0,
            "timeout_s": ctx.limit_s,
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])
            },
        }
        target = f"{__name__}:RefitEndpoint"
        sender_group = WorkerGroup.start(
            target, 1, args=(path, ctx.device, p.dtype, True), name="refit-sender", **common
        )
        groups.append(sender_group)
        receiver_group = WorkerGroup.start(
            target, 1, args=(path, ctx.device, p.dtype, False), name="refit-receiver", **common
        )
        groups.append(receiver_group)
        ends = [sender_group.run_all("describe")[0], receiver_group.run_all("describe")[0]]
        check(ends[0]["pid"] != ends[1]["pid"], "sender and receiver share a process")
        if ctx.on_gpu:
            check(
                ends[0]["gpu_uuid"] == ends[1]["gpu_uuid"],
                f"sender and receiver on different GPUs: {ends}",
            )
        sender = WeightSender(
            receivers=receiver_group.actors, transport=transport, timeout_s=ctx.limit_s
        )
        bucket_bytes = int(p.refit_bucket_mb * 2**20)
        sent = sender_group.run_all("digests", "tensors")[0]

        def refits(count: int, phase: str) -> list:
            runs = [
                sender_group.run_all("push_weights", sender, bucket_bytes)[0] for _ in range(count)
            ]
            got = receiver_group.run_all("digests", "received")[0]
            check(
                sorted(got) == sorted(sent),
                f"{phase}: received names differ: {sorted(set(got) ^ set(sent))[:5]}",
            )
            differ = [name for name in sent if got[name] != sent[name]]
            check(not differ, f"{phase}: {len(differ)} tensors differ, e.g. {differ[:3]}")
            return runs

        memory = {"before": [g.run_all("memory_gb")[0] for g in groups]}
        runs = refits(1, "first refit")
        memory["after_first"] = [g.run_all("memory_gb")[0] for g in groups]
        runs += refits(p.refit_repeats, "refit")
        memory["after_last"] = [g.run_all("memory_gb")[0] for g in groups]
        # Repeated refits must not pile up memory in either process (a bucket each at most:
        # a transport may keep its staging buffer for the next refit).
        bucket_gb = bucket_bytes / 2**30
        grown = [b - a for a, b in zip(memory["after_first"], memory["after_last"], strict=True)]
        check(
            max(grown) <= bucket_gb + 0.01,
            f"memory grew by {grown} GiB (sender, receiver) over {p.refit_repeats} refits",
        )
        receiver_group.run_all("use_wire_form", True)
        wire = refits(1, "refit through msgpack in the wire form")
    finally:
        for group in reversed(groups):
            group.shutdown()
        cluster.shutdown()
    best = min(runs[1:], key=lambda r: r.seconds)
    return {
        "transport": transport,
        "gb_per_s": round(best.bytes / 1e9 / best.seconds, 3),
        "first_gb_per_s": round(runs[0].bytes / 1e9 / runs[0].seconds, 3),
        "gb": round(best.bytes / 1e9, 4),
        "buckets": best.buckets,
        "tensors": best.tensors,
        "seconds": round(best.seconds, 4),
        "bit_exact": True,
        "wire_form_gb_per_s": round(wire[0].bytes / 1e9 / wire[0].seconds, 3),
        "mem_gb_sender_receiver": {k: [round(x, 3) for x in v] for k, v in memory.items()},
        "processes": [ends[0]["pid"], ends[1]["pid"]],
        "devices": [ends[0]["device"], ends[1]["device"]],
    }
