"""The dtensor policy's GPU path, pinned on CPU (``gpu_sim``): the process-group backend with
``cpu_offload``, where ``onload`` puts the optimizer state, and the replicated gradient
all-reduce's buffer. Each runs the worker's own method on a stand-in object that holds only
the attributes it reads, with the ``meta`` device standing in for the GPU where a tensor's
device matters (no other device than the CPU exists here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from nrl_dtensor.config import DTensorConfig
from nrl_dtensor.worker import DTensorPolicyWorker

pytestmark = pytest.mark.gpu_sim


@pytest.mark.parametrize("cpu_offload", [True, False])
def test_cpu_offload_on_gpus_gives_cpu_tensors_a_backend(cpu_offload, monkeypatch):
    """FSDP2's CPU offload keeps shards as CPU tensors, and clipping and the refit's
    ``full_tensor()`` run collectives on them: the default group the worker starts on a GPU
    must have a CPU backend then (gloo), NCCL for CUDA tensors either way."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    started = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        "nrl_core.distributed.devices.select_cuda_device", lambda: torch.device("cuda", 0)
    )
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: started.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda *_: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *_: 2)
    worker = SimpleNamespace(options=DTensorConfig(cpu_offload=cpu_offload))
    worker._backend = lambda: DTensorPolicyWorker._backend(worker)

    DTensorPolicyWorker._init_distributed(worker)

    assert len(started) == 1
    backends = BackendConfig(Backend(started[0])).get_device_backend_map()
    assert backends["cuda"] == "nccl"
    if cpu_offload:
        assert backends.get("cpu") == "gloo"


def _stepped_adamw() -> torch.optim.AdamW:
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    layer(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_onload_keeps_the_optimizer_state_beside_cpu_offloaded_parameters(monkeypatch):
    """With ``cpu_offload`` the parameters stay in host memory through a colocated
    generation; ``onload`` must not move their AdamW state to the GPU (fused AdamW refuses
    state on another device than its parameter at the next step)."""
    optimizer = _stepped_adamw()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    worker = SimpleNamespace(
        device_type="cuda",
        device=torch.device("meta"),  # the GPU
        options=DTensorConfig(cpu_offload=True),
        optimizer=optimizer,
    )

    DTensorPolicyWorker.offload(worker, ["optimizer", "weights"])
    DTensorPolicyWorker.onload(worker)

    placed = {
        (param.device, value.device)
        for param, state in optimizer.state.items()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    assert placed == {(torch.device("cpu"), torch.device("cpu"))}
    optimizer.step()  # and the next step runs


def test_replicated_gradients_and_their_presence_flags_share_a_device(monkeypatch):
    """``data_parallel=replicate`` sends the gradients and one presence flag per parameter in
    one all-reduce; the flags must be on the gradients' device (the GPU with NCCL), or the
    concatenation fails at the first step. The core's ``HostAllReduce`` runs for real up to
    the all-reduce, which stops the step (meta tensors hold no values)."""
    from nrl_core.distributed import host_all_reduce

    class Reduced(Exception):
        pass

    reduced = []

    def all_reduce(tensor, group=None):
        reduced.append((tensor.device, tensor.numel()))
        raise Reduced

    monkeypatch.setattr(host_all_reduce.dist, "get_rank", lambda *_: 0)
    monkeypatch.setattr(host_all_reduce.dist, "get_world_size", lambda *_: 2)
    monkeypatch.setattr(host_all_reduce.dist, "all_reduce", all_reduce)
    params = [torch.nn.Parameter(torch.empty(3, 2, device="meta")) for _ in range(2)]
    params[0].grad = torch.empty(3, 2, device="meta")  # the other has none on this rank
    worker = SimpleNamespace(
        optimizer=SimpleNamespace(param_groups=[{"params": params}]),
        dp_size=2,
        _gradient_all_reduce=host_all_reduce.HostAllReduce(group=None),
    )

    with pytest.raises(Reduced):
        DTensorPolicyWorker._average_replica_gradients(worker)
    assert reduced == [(torch.device("meta"), 6 + 6 + 2)]
