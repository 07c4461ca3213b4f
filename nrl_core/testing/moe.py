"""An independent reference for the router statistics (``train/moe/*``): transformers' own
router logits and load-balancing loss of a Hugging Face MoE checkpoint, which a policy
backend's :class:`nrl_core.moe.RouterStatistics` must reproduce."""

from __future__ import annotations

import torch

from nrl_core.data import Batch


def transformers_router_metrics(path: str, batch: Batch) -> dict[str, float]:
    """``moe/*`` of ``batch`` from the Qwen3-MoE checkpoint at ``path``, computed by transformers
    itself (``output_router_logits`` and ``load_balancing_loss_func``), padding excluded."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from nrl_core.training import valid_token_mask

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    ids = batch["input_ids"]
    valid = valid_token_mask(batch, ids.shape[1])
    with torch.no_grad():
        layers = model(input_ids=ids, output_router_logits=True).router_logits
    cvs, max_loads, aux = [], [], []
    for logits in layers:
        top = logits.softmax(-1).topk(top_k, dim=-1).indices[valid.reshape(-1)]
        counts = torch.bincount(top.reshape(-1), minlength=experts).double()
        cvs.append(float(counts.std(correction=0) / counts.mean()))
        max_loads.append(float(counts.max() / counts.mean()))
        aux.append(float(load_balancing_loss_func((logits,), experts, top_k, valid.long())))
    return {
        "moe/load_cv": sum(cvs) / len(cvs),
        "moe/max_load": max(max_loads),
        "moe/aux_loss": sum(aux) / len(aux),
    }
