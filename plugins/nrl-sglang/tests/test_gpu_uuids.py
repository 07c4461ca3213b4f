"""The cuda_ipc refit names each engine rank's GPU by UUID without a CUDA context in the engine
actor (``gpu_sim``): a context there holds ~0.5 GB per GPU that SGLang's
``mem_fraction_static`` never counted. NVML is a stand-in module here (no GPU, no driver); torch's
CUDA entry points are trip-wires."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from nrl_sglang.config import SglangConfig
from nrl_sglang.worker import SglangGenerationWorker

from nrl_core.weight_sync import WeightSyncError

pytestmark = pytest.mark.gpu_sim

# As NVML reports them (the `GPU-` prefix); torch writes the same UUIDs without it.
MACHINE = [f"GPU-{n}a0c0000-1111-2222-3333-44445555666{n}" for n in range(4)]


@pytest.fixture
def nvml(monkeypatch):
    """A ``pynvml`` over the 4 GPUs of ``MACHINE``; torch's CUDA initialisation raises."""
    calls = []
    module = types.ModuleType("pynvml")
    module.nvmlInit = lambda: calls.append("init")
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(MACHINE)
    module.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
    module.nvmlDeviceGetUUID = lambda handle: MACHINE[handle[1]]
    monkeypatch.setitem(sys.modules, "pynvml", module)

    def no_cuda(*_args, **_kwargs):
        raise AssertionError("the engine actor initialised CUDA")

    for name in ("init", "_lazy_init", "get_device_properties", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    return calls


def _tp_uuids(tensor_parallel_size: int) -> list[str]:
    worker = SimpleNamespace(
        options=SglangConfig(tensor_parallel_size=tensor_parallel_size), _gpu_uuids=None
    )
    return SglangGenerationWorker._tp_gpu_uuids(worker)


def test_tp_gpu_uuids_come_from_nvml_in_cuda_numbering(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,3")
    assert _tp_uuids(2) == [MACHINE[2][4:], MACHINE[0][4:]]
    assert nvml == ["init", "shutdown"]
    assert not torch.cuda.is_initialized()


def test_visible_devices_by_uuid_prefix_and_unset(nvml, monkeypatch):
    from nrl_sglang.worker import visible_gpu_uuids

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MACHINE[3][:6]},{MACHINE[1]}")
    assert visible_gpu_uuids() == [MACHINE[3][4:], MACHINE[1][4:]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpu_uuids() == [u[4:] for u in MACHINE]


def test_too_few_visible_gpus_and_unknown_entries_are_one_line(nvml, monkeypatch):
    from nrl_sglang.worker import visible_gpu_uuids

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(WeightSyncError, match="sees 1 GPU"):
        _tp_uuids(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0000")
    with pytest.raises(WeightSyncError, match="refit_transport=nccl") as error:
        visible_gpu_uuids()
    assert "\n" not in str(error.value)
