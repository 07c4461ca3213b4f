"""Stage ``dtensor``: the nrl-dtensor policy worker as one rank of a real ``torch.distributed``
world (NCCL and bf16 on ``cuda``, gloo and float32 on ``cpu``; FSDP2 applied)."""

from __future__ import annotations

import os
from typing import Any

from .common import StageContext, check, free_port
from .policy import measure_policy, run_config


def stage_dtensor(ctx: StageContext) -> dict[str, Any]:
    """One rank of the dtensor policy in a real torch.distributed world of size 1."""
    # The variables a WorkerGroup gives its ranks: the worker then initialises the default
    # process group itself (env://), NCCL on a GPU and gloo otherwise, and applies FSDP2.
    os.environ.update(
        {
            "WORLD_SIZE": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    )
    import torch.distributed as dist
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    config = run_config(ctx, "dtensor")
    context = ComponentContext(config=config, rank=0, world_size=1, seed=config.seed)
    # FSDP2 explicitly: `auto` replicates small models on CPU, and this stage checks FSDP2.
    worker = DTensorPolicyWorker(DTensorConfig(data_parallel="shard"), context)
    try:
        backend = dist.get_backend()
        want = "nccl" if ctx.on_gpu else "gloo"
        check(backend == want, f"process group backend {backend}, expected {want}")
        params = list(worker.model.parameters())
        check(
            all(hasattr(p, "device_mesh") for p in params),
            "FSDP2 was not applied (parameters are not DTensors)",
        )
        devices = {p.device.type for p in params}
        check(devices == {ctx.device}, f"parameters on {devices}, expected {ctx.device}")
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        figures = measure_policy(ctx, worker, policy, worker.hf_config.vocab_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"backend": backend, "fsdp": True, **figures}
