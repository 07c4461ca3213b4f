"""``policy.megatron.grad_reduce_in_fp32`` and the optimizer CPU offload reach Megatron's
``DistributedDataParallelConfig`` and ``OptimizerConfig`` (issue 46, GPU review 3 M4), pinned on
CPU (``gpu_sim``): the two configs are megatron-core's real dataclasses, built here; only
``DistributedDataParallel`` and ``get_megatron_optimizer``, which allocate CUDA buffers, are
replaced by recorders of what they are given.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _megatron_helpers import requires_megatron

from nrl_core.config.schema import PolicyConfig

pytestmark = [pytest.mark.gpu_sim, requires_megatron]


def _built_configs(monkeypatch, **options):
    import megatron.core.distributed as distributed
    import megatron.core.optimizer as optimizer
    from nrl_megatron.config import MegatronConfig
    from nrl_megatron.worker import MegatronPolicyWorker

    seen = {}

    def ddp(*, config, ddp_config, module):
        seen["ddp"] = ddp_config
        return module

    def get_optimizer(config, models):
        seen["optimizer"] = config
        return SimpleNamespace()

    monkeypatch.setattr(distributed, "DistributedDataParallel", ddp)
    monkeypatch.setattr(optimizer, "get_megatron_optimizer", get_optimizer)
    worker = SimpleNamespace(
        policy=PolicyConfig(precision="bfloat16"),
        options=MegatronConfig(**options),
        module=SimpleNamespace(config=None),
        dtype=torch.bfloat16,
    )
    MegatronPolicyWorker._build_megatron_optimizer(worker)
    return seen["ddp"], seen["optimizer"]


def test_defaults_keep_fp32_grads_and_no_offload(monkeypatch):
    ddp, opt = _built_configs(monkeypatch)
    assert ddp.grad_reduce_in_fp32 is True
    assert opt.optimizer_cpu_offload is False and opt.optimizer_offload_fraction == 0.0


def test_bf16_grads_and_full_offload_reach_megatron(monkeypatch):
    ddp, opt = _built_configs(monkeypatch, grad_reduce_in_fp32=False, optimizer_cpu_offload=True)
    assert ddp.grad_reduce_in_fp32 is False
    assert opt.optimizer_cpu_offload is True and opt.optimizer_offload_fraction == 1.0
    # HybridDeviceOptimizer needs decoupled weight decay (megatron.core.optimizer:306).
    assert opt.decoupled_weight_decay is True and opt.use_distributed_optimizer is True


def test_a_partial_offload_fraction_is_passed_only_with_offload(monkeypatch):
    _, opt = _built_configs(monkeypatch, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    assert opt.optimizer_offload_fraction == 0.5
    _, opt = _built_configs(monkeypatch, optimizer_offload_fraction=0.5)
    assert opt.optimizer_cpu_offload is False and opt.optimizer_offload_fraction == 0.0


def test_the_fraction_is_validated():
    from nrl_megatron.config import MegatronConfig

    with pytest.raises(ValueError, match="optimizer_offload_fraction"):
        MegatronConfig(optimizer_offload_fraction=1.5)
