"""Functions the LoRA tests run in spawned megatron ranks (``group.run_all(fn, ...)`` calls
``fn(worker, ...)``): they must be importable there, hence a module of their own."""

from __future__ import annotations

import torch


def split_state(worker) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's model state, base and adapter tensors apart (copies)."""
    from nrl_megatron.lora import is_lora_name

    out: dict[str, dict[str, torch.Tensor]] = {"base": {}, "lora": {}}
    for name, tensor in worker.module.state_dict().items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        out["lora" if is_lora_name(name) else "base"][name] = tensor.detach().clone()
    return out


def trainable(worker) -> dict[str, object]:
    """Names of the parameters that train and of those the optimizer steps."""
    names = {id(p): n for n, p in worker.module.named_parameters()}
    stepped = [names[id(p)] for g in worker.optimizer.param_groups for p in g["params"]]
    grads = [n for n, p in worker.module.named_parameters() if p.requires_grad]
    return {"requires_grad": sorted(grads), "optimizer": sorted(stepped)}


def full_adapters(worker) -> dict[str, torch.Tensor]:
    """``lora_adapter_tensors()`` copied (a collective)."""
    return {k: v.detach().clone() for k, v in worker.lora_adapter_tensors().items()}


def base_buckets(worker) -> dict[str, torch.Tensor]:
    """The streamed weights with the adapters left out (``lora_weights="base"``)."""
    buckets = worker.state_dict_buckets(1 << 30, lora_weights="base")
    return {k: v.clone() for bucket in buckets for k, v in bucket.items()}


def merged_buckets(worker) -> dict[str, torch.Tensor]:
    """The streamed weights with the adapters merged (what a merged refit sends)."""
    buckets = worker.state_dict_buckets(1 << 30)
    return {k: v.clone() for bucket in buckets for k, v in bucket.items()}
