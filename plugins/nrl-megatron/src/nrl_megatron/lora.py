"""LoRA on Megatron-Core's tensor-parallel linear layers (``policy.megatron.lora_rank > 0``).

No peft here: peft wraps ``torch.nn.Linear`` and knows nothing of tensor parallelism. Each
targeted ``ColumnParallelLinear``/``RowParallelLinear`` of the local layer spec becomes a
:class:`LoraColumnParallelLinear`/:class:`LoraRowParallelLinear` (same object, class swapped:
its base ``weight`` keeps its state-dict name, so the converters, loaders and checkpoints see
the base model as before), with two ``ParameterDict`` s, ``lora_A`` and ``lora_B``, keyed by the
Hugging Face projection: ``decoder.layers.3.self_attention.linear_qkv.lora_A.q_proj``.

Layout, chosen so that the adapters are *peft's* adapters of the Hugging Face model, exactly:

- **Fused layers get one adapter per projection**, not one over the fused matrix. ``linear_qkv``
  carries ``q_proj``/``k_proj``/``v_proj`` adapters (each its own ``A [r, hidden]`` and
  ``B [rows, r]``), ``linear_fc1`` ``gate_proj``/``up_proj``. A single adapter on the fused
  output would couple q, k and v through one ``A`` (rank r shared by three projections), which
  no peft adapter of the HF model equals; per-projection ``A`` s and ``B`` s (peft's own, and
  a block-diagonal ``B`` in the fused space) make the export a renaming, and the merge
  ``W_q + B_q A_q * alpha / r`` the one peft's ``merge_and_unload`` computes.
- The projections' outputs are put in the fused layer's order: for ``linear_qkv`` *per query
  group* (each group's query heads, then its key head, then its value head, as
  :func:`nrl_megatron.convert.fuse_qkv`), for ``linear_fc1`` ``[gate_r; up_r]``.
- **Column-parallel** (``linear_qkv``, ``linear_fc1``: output split over TP): ``A`` replicated
  (its input is whole on every rank), ``B`` split along its rows like the base weight (whole
  query groups; a contiguous chunk of each projection's HF rows, since groups hold contiguous
  heads). The rank-``r`` activation ``h = A x`` goes through Megatron's
  ``copy_to_tensor_model_parallel_region``: identity forward, all-reduce of ``dL/dh`` backward,
  because each rank's ``B`` rows see only part of ``dL/dh``; ``A`` then gets the same, whole
  gradient on every rank and stays replicated.
- **Row-parallel** (``linear_proj``, ``linear_fc2``: input split over TP): ``A`` split along
  its columns like the base weight, ``B`` replicated. Each rank's partial ``h = A_r x_r``
  travels in the *same* all-reduce as the base layer's partial output (concatenated to it),
  so one collective sums both; ``B`` then sees the whole ``h`` and gets the same gradient on
  every rank.

``B`` starts at zero (peft's default), so step 0 is the base model exactly (the adapter adds
``+0.0`` to every output); ``A`` is peft's Kaiming-uniform init of the *whole* tensor from a
generator seeded by the run's seed and the parameter's whole-model name, then sliced: every
tensor-parallel, pipeline and data-parallel layout starts from the same adapters.

Dropout (``lora_dropout``): masks come from one generator per policy worker seeded by the run's
seed and the data-parallel rank, the same on tensor-parallel peers (a column layer's replicated
``A`` must see the same masked input on every rank; a row layer draws the whole input's mask and
keeps its slice), so the layout does not change the masks either.

Importing this module imports megatron-core (the plugin's ``engine`` extra).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from nrl_megatron.errors import MegatronSetupError

FUSED: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""Megatron layer (suffix inside a decoder layer) -> the HF projections it computes, in the
order its output (column) or its only adapter (row) holds them."""

HF_MODULE: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
"""HF projection -> its module inside ``model.layers.N`` (peft's adapter names)."""


def is_lora_name(name: str) -> bool:
    """Whether Megatron state-dict entry ``name`` is an adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """A whole-model Megatron adapter name -> peft's saved name of the HF model's adapter
    (``decoder.layers.3.self_attention.linear_qkv.lora_A.q_proj`` ->
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``)."""
    parts = name.split(".")
    layer, proj, which = parts[2], parts[-1], parts[-2]
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[proj]}.{which}.weight"


class LoraDropout:
    """The dropout masks of one policy worker's adapters (see the module docstring): a
    generator on the weights' device, the same on tensor-parallel peers."""

    def __init__(self, p: float, seed: int, device: torch.device) -> None:
        self.p = p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, x: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
        """``x`` with dropout; ``tp_size > 1``: ``x`` is rank ``tp_rank``'s slice of the last
        dim of the whole input, whose whole mask is drawn (so the layout keeps the masks)."""
        if self.p == 0 or not torch.is_grad_enabled():
            return x
        shape = (*x.shape[:-1], x.shape[-1] * tp_size)
        keep = torch.rand(shape, generator=self.generator, device=x.device) >= self.p
        if tp_size > 1:
            keep = keep.chunk(tp_size, dim=-1)[tp_rank]
        return x * keep.to(x.dtype) / (1 - self.p)


class _LoraMixin:
    """What both adapted layers share: the adapters' settings and their dropout."""

    lora_A: torch.nn.ParameterDict
    lora_B: torch.nn.ParameterDict
    lora_scaling: float
    lora_dropout: LoraDropout | None
    lora_tp: tuple[int, int]  # (rank, size)

    def _dropped(self, x: torch.Tensor, *, split: bool) -> torch.Tensor:
        if self.lora_dropout is None or not self.training:
            return x
        rank, size = self.lora_tp if split else (0, 1)
        return self.lora_dropout(x, tp_rank=rank, tp_size=size)


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` (output split over TP) plus per-projection LoRA adapters:
    ``A`` replicated, ``B`` split along its rows (module docstring)."""

    lora_parts: tuple[str, ...]  # the fused projections in output order
    lora_sizes: tuple[int, ...]  # each projection's local output width
    lora_groups: int  # query groups on this rank (linear_qkv), 0 for [gate; up]

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return output + self._lora_output(input_).to(output.dtype), bias

    def _lora_output(self, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for proj, size in zip(self.lora_parts, self.lora_sizes, strict=True):
            if proj not in self.lora_A:
                parts.append(x.new_zeros((*x.shape[:-1], size)))
                continue
            h = F.linear(self._dropped(x, split=False), self.lora_A[proj])
            # B holds only this rank's rows: dL/dh is summed over TP in the backward.
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            parts.append(F.linear(h, self.lora_B[proj]) * self.lora_scaling)
        if self.lora_groups:
            # Per query group: its query heads, its key head, its value head (fuse_qkv).
            g = self.lora_groups
            parts = [p.reshape(*p.shape[:-1], g, p.shape[-1] // g) for p in parts]
            out = torch.cat(parts, dim=-1)
            return out.reshape(*out.shape[:-2], -1)
        return torch.cat(parts, dim=-1)


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """A ``RowParallelLinear`` (input split over TP) plus a LoRA adapter: ``A`` split along its
    columns, ``B`` replicated, the partial ``A x`` summed in the base output's all-reduce."""

    lora_parts: tuple[str, ...]  # one projection

    def forward(self, input_):
        (proj,) = self.lora_parts
        # The base layer's own product (tensor_parallel/layers.py, 0.16.1:
        # ``torch.matmul(input, weight.t())``), so that step 0 equals the base model bitwise.
        base = torch.matmul(input_, self.weight.t())
        h = F.linear(self._dropped(input_, split=True), self.lora_A[proj])
        width = base.shape[-1]
        both = reduce_from_tensor_model_parallel_region(
            torch.cat([base, h.to(base.dtype)], dim=-1), group=self.tp_group
        )
        output = both[..., :width] + F.linear(both[..., width:], self.lora_B[proj]) * (
            self.lora_scaling
        )
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def _kaiming_a(shape: tuple[int, int], seed: int, name: str, dtype, device) -> torch.Tensor:
    """peft's ``A`` init (``kaiming_uniform_(a=sqrt(5))``: uniform in ``±1/sqrt(fan_in)``) of
    the whole tensor, from a generator seeded by ``seed`` and ``name`` (the same on every rank
    and in every layout)."""
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    )
    bound = 1 / math.sqrt(shape[1])
    full = torch.rand(shape, generator=generator, dtype=torch.float64) * 2 * bound - bound
    return full.to(dtype=dtype, device=device)


def apply_lora(
    model: torch.nn.Module,
    *,
    targets: tuple[str, ...],
    rank: int,
    alpha: float,
    dropout: LoraDropout | None,
    seed: int,
    layer_offset: int,
    tp_rank: int,
    tp_size: int,
    num_query_groups: int,
) -> None:
    """Freeze ``model`` and give the layers computing ``targets`` (HF projection names) LoRA
    adapters of rank ``rank`` (see the module docstring). ``layer_offset``: the stage's first
    decoder layer in the whole model (adapter init and names use whole-model layer numbers)."""
    from nrl_megatron.pipeline import global_name

    model.requires_grad_(False)
    wanted = set(targets)
    for name, module in list(model.named_modules()):
        suffix = next((s for s in FUSED if name.endswith("." + s)), None)
        if suffix is None or not wanted & set(FUSED[suffix]):
            continue
        whole = global_name(name + ".", layer_offset).rstrip(".")
        if type(module) is ColumnParallelLinear:
            _adapt_column(module, suffix, wanted, whole, rank, seed, tp_rank, tp_size)
            if suffix == "self_attention.linear_qkv":
                module.lora_groups = num_query_groups // tp_size
        elif type(module) is RowParallelLinear:
            _adapt_row(module, suffix, whole, rank, seed, tp_rank, tp_size)
        else:
            # The Transformer Engine spec's fused layernorm-linears, or an expert's layers.
            raise MegatronSetupError(
                f"LoRA on {name} ({type(module).__name__}) is not implemented by the megatron "
                "policy (dense models on the local layer spec only); set policy.megatron."
                "lora_rank=0 or use policy.backend=dtensor"
            )
        module.lora_scaling = alpha / rank
        module.lora_dropout = dropout
        module.lora_tp = (tp_rank, tp_size)


def _adapt_column(module, suffix, wanted, whole, rank, seed, tp_rank, tp_size) -> None:
    if module.gather_output or module.sequence_parallel:
        raise MegatronSetupError(f"LoRA needs {whole} without gather_output/sequence_parallel")
    weight = module.weight
    parts = FUSED[suffix]
    if suffix == "self_attention.linear_qkv":
        groups = module.config.num_query_groups // tp_size
        d = module.config.kv_channels
        per_group = module.config.num_attention_heads // module.config.num_query_groups
        sizes = (groups * per_group * d, groups * d, groups * d)
    else:
        sizes = (weight.shape[0] // 2, weight.shape[0] // 2)
    module.__class__ = LoraColumnParallelLinear
    module.lora_parts, module.lora_sizes, module.lora_groups = parts, sizes, 0
    module.lora_A = torch.nn.ParameterDict()
    module.lora_B = torch.nn.ParameterDict()
    for proj, size in zip(parts, sizes, strict=True):
        if proj not in wanted:
            continue
        a = _kaiming_a(
            (rank, weight.shape[1]), seed, f"{whole}.lora_A.{proj}", weight.dtype, weight.device
        )
        module.lora_A[proj] = torch.nn.Parameter(a)
        b = torch.nn.Parameter(torch.zeros(size, rank, dtype=weight.dtype, device=weight.device))
        _mark_split(b, dim=0)
        module.lora_B[proj] = b


def _adapt_row(module, suffix, whole, rank, seed, tp_rank, tp_size) -> None:
    if not module.input_is_parallel or module.sequence_parallel or module.explicit_expert_comm:
        raise MegatronSetupError(f"LoRA needs {whole} with its input split, no sequence parallel")
    weight = module.weight
    (proj,) = FUSED[suffix]
    module.__class__ = LoraRowParallelLinear
    module.lora_parts = (proj,)
    full_in = weight.shape[1] * tp_size
    a = _kaiming_a((rank, full_in), seed, f"{whole}.lora_A.{proj}", weight.dtype, weight.device)
    a = torch.nn.Parameter(a.chunk(tp_size, dim=1)[tp_rank].contiguous())
    _mark_split(a, dim=1)
    module.lora_A = torch.nn.ParameterDict({proj: a})
    b = torch.zeros(weight.shape[0], rank, dtype=weight.dtype, device=weight.device)
    module.lora_B = torch.nn.ParameterDict({proj: torch.nn.Parameter(b)})


def _mark_split(param: torch.nn.Parameter, dim: int) -> None:
    """Megatron's ``tensor_model_parallel`` attributes (the gradient norm sums a split
    parameter's squares over TP, counts a replicated one once)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the adapted layers of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, _LoraMixin):
            yield name, module
