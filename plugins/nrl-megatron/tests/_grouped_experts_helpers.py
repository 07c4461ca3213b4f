"""Functions for ``test_grouped_experts.py`` that run in a spawned rank with a one-rank Megatron
``parallel_state`` (``_megatron_helpers.ParallelStateProbe``): building Megatron's expert
modules needs its process groups."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
"""``torch.Tensor`` methods that read a value on the host: on a CUDA tensor each one waits for
the device (a host sync)."""


def _experts(cls_name: str, counts: list[int], dtype: torch.dtype, seed: int = 0, **overrides):
    """A ``SequentialMLP`` or ``GroupedMatmulExperts`` (``cls_name``) of ``len(counts)`` local
    experts (hidden 64, expert width 48, gated silu as for Qwen3), weights drawn from ``seed``,
    and routed inputs: ``sum(counts)`` tokens sorted by expert, probabilities, counts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nrl_megatron.grouped_experts import GroupedMatmulExperts
    from nrl_megatron.model import experts_submodules, moe_submodules

    experts = len(counts)
    settings = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        moe_ffn_hidden_size=48,
        num_moe_experts=experts,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    config = TransformerConfig(**{**settings, **overrides})
    moe = moe_submodules(get_gpt_layer_local_spec(num_experts=experts).submodules.mlp)
    cls = {
        "sequential": SequentialMLP,
        "grouped": GroupedMatmulExperts,
        "reference": _PlainTorchExperts,
    }[cls_name]
    module = cls(
        experts,
        config,
        experts_submodules(moe),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    tokens = sum(counts)
    x = torch.randn(tokens, 64, generator=generator).to(dtype)
    probs = torch.rand(tokens, generator=generator)
    return module, x, probs, torch.tensor(counts)


class _PlainTorchExperts(torch.nn.Module):
    """``SequentialMLP``'s modules and names, its forward written out in plain torch per expert
    as megatron-core 0.16.1's ``MLP.forward`` computes an expert (unfused): ``fc1`` plus its
    bias, the gated activation (clamped, offset), times the probability, ``fc2``, plus its
    bias times the probability. The reference for biased experts: ``SequentialMLP`` itself
    cannot backpropagate them on one rank (``MLP.forward`` adds fc2's bias in place into the
    view a tensor-parallel region returns, which autograd refuses)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__()
        from megatron.core.transformer.moe.experts import SequentialMLP

        self._sequential = [SequentialMLP(num_local_experts, config, submodules, pg_collection)]
        self.local_experts = self._sequential[0].local_experts
        self.config = config

    def forward(self, x, tokens_per_expert, probs):
        config, outputs = self.config, []
        for expert, rows, p in zip(
            self.local_experts,
            torch.split(x, tokens_per_expert.tolist()),
            torch.split(probs, tokens_per_expert.tolist()),
            strict=True,
        ):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            h = rows @ fc1.weight.t() + (fc1.bias if fc1.bias is not None else 0)
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
            h = config.activation_func(gate) * (linear + config.glu_linear_offset)
            out = (h * p[:, None]) @ fc2.weight.t()
            if fc2.bias is not None:
                out = out + fc2.bias * p[:, None]
            outputs.append(out)
        return torch.cat(outputs), None


def forward_backward(
    _probe, cls_name: str, counts: list[int], dtype_name: str, overrides: dict | None = None
) -> dict:
    """Output and every gradient (weights by name, input, probabilities) of one forward and
    backward with a random upstream gradient (``overrides``: config fields)."""
    dtype = getattr(torch, dtype_name)
    module, x, probs, counts_t = _experts(cls_name, counts, dtype, **(overrides or {}))
    x.requires_grad_(True)
    probs.requires_grad_(True)
    saved = []  # the shapes of the tensors autograd keeps for the backward

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out, bias = module(x, counts_t, probs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(upstream)
    return {
        "type": type(module).__name__,
        "bias": bias,
        "out": out.detach(),
        "grads": {name: p.grad for name, p in module.named_parameters()},
        "grad_x": x.grad,
        "grad_probs": probs.grad,
        "saved": saved,
    }


@contextlib.contextmanager
def _host_reads_raise():
    def refuse(name):
        def method(self, *args, **kwargs):
            raise RuntimeError(f"host read: Tensor.{name}")

        return method

    # Most are inherited from torch._C.TensorBase: restore by deleting the override.
    own = {
        name: torch.Tensor.__dict__[name] for name in HOST_READS if name in torch.Tensor.__dict__
    }
    for name in HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name in HOST_READS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


def host_read_in_forward(_probe, cls_name: str, overrides: dict | None = None) -> str | None:
    """The host read a forward of ``cls_name``'s experts makes (the error raised when the
    :data:`HOST_READS` methods raise), or None (``overrides``: config fields)."""
    module, x, probs, counts = _experts(cls_name, [5, 0, 9, 2], torch.float32, **(overrides or {}))
    with _host_reads_raise():
        try:
            module(x, counts, probs)
        except RuntimeError as error:
            if "host read" not in str(error):
                raise
            return str(error)
    return None


def gpu_config_moe_model(_probe, hf_config_kwargs: dict) -> dict:
    """The GPU path's ``TransformerConfig`` (``on_gpu=True``, bfloat16) for a Qwen3-MoE shape and
    the local-spec ``GPTModel`` built from it on the host (the GPU-only steps left out:
    allocating on ``torch.cuda.current_device()``, and the alltoall token dispatcher, whose
    constructor creates a CUDA stream; the allgather one routes the same tokens on one rank):
    its experts' classes, their parameter names, and a bfloat16 forward and backward."""
    from nrl_megatron.convert import ModelShape
    from nrl_megatron.model import (
        build_gpt_model,
        local_layer_spec,
        moe_submodules,
        transformer_config,
    )
    from transformers import Qwen3MoeConfig

    hf_config = Qwen3MoeConfig(**hf_config_kwargs)
    config = transformer_config(hf_config, dtype=torch.bfloat16, on_gpu=True)
    spec = local_layer_spec(ModelShape.from_hf_config(hf_config))
    host = dataclasses.replace(
        config, use_cpu_initialization=True, moe_token_dispatcher_type="allgather"
    )
    model = build_gpt_model(hf_config, host)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    ids = torch.randint(0, hf_config.vocab_size, (2, 10), generator=generator)
    positions = torch.arange(10)[None, :].expand(2, -1)
    logits = model(ids, positions, None)
    logits.float().logsumexp(-1).mean().backward()
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    return {
        "use_cpu_initialization": config.use_cpu_initialization,
        "dispatcher": config.moe_token_dispatcher_type,
        "spec_experts": _builder_name(moe_submodules(spec.submodules.mlp).experts),
        "expert_types": sorted({type(m).__name__ for m in experts}),
        "expert_params": sorted(
            name for name, _ in model.named_parameters() if ".mlp.experts." in name
        ),
        "finite": bool(torch.isfinite(logits).all()),
        "expert_grads": [
            float(p.grad.abs().sum()) for m in experts for p in m.parameters() if p.grad is not None
        ],
    }


def _builder_name(builder) -> str:
    """The class a spec builds: a ``ModuleSpec``'s module (megatron-core 0.16), a
    ``functools.partial``'s function (0.17+)."""
    return (
        getattr(builder, "module", None).__name__
        if hasattr(builder, "module")
        else builder.func.__name__
    )
