"""Megatron-Core MoE experts through ``torch.nn.functional.grouped_mm``: one grouped GEMM per
projection for all local experts, with ``SequentialMLP``'s parameters and names.

Megatron-Core 0.16.1's ``SequentialMLP`` (``transformer/moe/experts.py:876-928``) turns
``tokens_per_expert`` into a Python list (``.tolist()``) and runs each local expert's
``linear_fc1``/``linear_fc2`` in a Python loop: 16 (Qwen3-30B-A3B at EP=8) to 128 (EP=1) small
GEMM pairs per layer. Its grouped paths do not fit this plugin: the legacy ``GroupedMLP`` needs
the ``grouped_gemm`` package (on PyPI only as a CUDA source distribution), ``TEGroupedMLP``
needs Transformer Engine, and both store the experts under other parameter names than
``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``, which the converter, the
expert-parallel gather, the refit and the checkpoints key on.

:class:`GroupedMatmulExperts` keeps ``SequentialMLP``'s modules (so the state dict, the
sharded state dict and every consumer of the names are unchanged) and replaces only its
forward: the local experts' weights are stacked and both projections run as one
``grouped_mm`` each, with the group boundaries (``offs``, the cumulative token counts) on the
tokens' device. The forward reads no count on the host (no ``.tolist()``, no ``.item()``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from nrl_core.errors import NrlError


class GroupedExpertsError(NrlError):
    """A Megatron config feature that :class:`GroupedMatmulExperts` does not reproduce."""


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of group e] = x[rows of group e] @ weights[e].T`` (``weights[e]``: one expert's
    ``[out, in]`` linear weight, group ``e`` the rows ``offs[e-1]:offs[e]``).

    Autograd through ``torch.stack`` + ``grouped_mm`` would keep the stacked copy of every
    local expert's weight alive until the backward (``grouped_mm`` saves it for the input's
    gradient): ≈150 MiB per layer for Qwen3-30B-A3B at EP=8 in bf16, ≈7 GiB over 48 layers. This
    function saves the parameters themselves and stacks them again in the backward. The
    gradients are torch's own ``grouped_mm`` derivatives (same operand layouts), so the CUDA
    kernels see the layouts they accept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return F.grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        # grouped_mm needs real strides: an upstream gradient may be an expanded view.
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad, torch.stack(weights), offs=offs)
        if not any(ctx.needs_input_grad[2:]):
            return grad_x, None, *([None] * len(weights))
        # [out, T] x [T, in], the token dimension split by offs -> [E, out, in]; an expert
        # with no tokens gets zeros.
        grad_w = F.grouped_mm(grad.t(), x, offs=offs)
        return grad_x, None, *grad_w.unbind(0)


class GroupedMatmulExperts(SequentialMLP):
    """``SequentialMLP`` (same constructor, parameters, state dict, sharded state dict) whose
    forward runs the local experts as two ``torch.nn.functional.grouped_mm`` calls.

    Per token of expert ``e``: ``fc2_e(act(fc1_e(x)) * prob)``, with ``act`` Megatron's MLP
    activation (gated: ``linear_fc1``'s output split in halves, ``activation_func(first) *
    (second + glu_linear_offset)``, both clamped by ``activation_func_clamp_value`` when it is
    set; for Qwen3 ``silu(gate) * up``), the probability applied in the activation's dtype and
    the result cast back, as ``MLP.forward`` does with ``per_token_scale``.

    The experts' ``linear_fc1``/``linear_fc2`` modules are not called (their weights are read
    directly); forward pre-hooks registered on them (Megatron DDP's ``overlap_param_gather``
    waits) are run first, so a parameter all-gather is still awaited.

    Linear biases (``add_bias_linear``, gpt-oss) as ``MLP.forward`` adds them to an expert's
    tokens: fc1's before the activation, fc2's scaled by the token's probability (``fc2(prob *
    act) + prob * bias``); each row's expert comes from the counts on the device.

    Refused at construction (:class:`GroupedExpertsError`): expert tensor parallelism (this
    plugin runs MoE with TP=1), FP8/FP4.

    On CUDA, torch's grouped GEMM kernel (no host sync) takes bfloat16 on SM90+; float32 or
    float16 operands take torch's per-group fallback loop instead (correct, no speed-up
    expected). The GPU path of this plugin trains in bfloat16.
    """

    def __init__(
        self, num_local_experts, config, submodules, pg_collection: Any = None, **kwargs: Any
    ):
        # kwargs: what newer megatron-core passes on (0.19's MoELayer adds ``name``).
        super().__init__(
            num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs
        )
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        if tp_size != 1:
            raise GroupedExpertsError(
                f"grouped experts run with expert tensor parallel size 1, not {tp_size}"
            )
        if self.config.fp8 or self.config.fp4:
            raise GroupedExpertsError("grouped experts do not run FP8/FP4")
        # CUDA's grouped GEMM wants every operand stride a multiple of 16 bytes ("strides
        # should be multiple of 16 bytes"): the hidden and expert widths in elements. Other
        # shapes (no Qwen3-MoE has one) run SequentialMLP's loop on CUDA.
        item = torch.empty((), dtype=self.config.params_dtype).element_size()
        widths = (self.config.hidden_size, self.config.moe_ffn_hidden_size)
        self.cuda_aligned = all(width * item % 16 == 0 for width in widths)
        if not self.cuda_aligned and not self.config.use_cpu_initialization:
            warnings.warn(
                f"hidden/expert widths {widths} are not multiples of {16 // item} elements: "
                "the MoE experts run SequentialMLP's per-expert loop on CUDA",
                stacklevel=2,
            )

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s unfused activation (megatron-core 0.16.1 ``transformer/mlp.py``)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(x)
        gate, linear = torch.chunk(x, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)

    def _run_pre_hooks(self) -> None:
        for expert in self.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                for hook in linear._forward_pre_hooks.values():
                    hook(linear, ())

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """``[T, hidden]`` tokens sorted by local expert, ``[num_local_experts]`` token counts
        (on any device), ``[T]`` probabilities -> ``([T, hidden], None)``."""
        if permuted_local_hidden_states.is_cuda and not self.cuda_aligned:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            # As SequentialMLP: the probabilities scale the input, then count as 1.
            assert self.config.moe_router_topk == 1, "moe_apply_probs_on_input needs top-1"
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        self._run_pre_hooks()
        # The alltoall dispatcher hands the counts over on the host, the allgather one on the
        # device: either way the group ends move to the tokens' device (a host-to-device copy
        # at most, never a device-to-host read).
        offs = torch.cumsum(tokens_per_expert.to(hidden.device, non_blocking=True), 0)
        offs = offs.to(torch.int32)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        projected = _GroupedLinear.apply(hidden.contiguous(), offs, *fc1)
        if self.config.add_bias_linear:
            # Row r's expert, without reading the counts on the host (output_size is known).
            experts = torch.repeat_interleave(
                torch.arange(len(self.local_experts), device=hidden.device),
                tokens_per_expert.to(hidden.device),
                output_size=hidden.shape[0],
            )
            fc1_bias = torch.stack([expert.linear_fc1.bias for expert in self.local_experts])
            projected = projected + fc1_bias[experts]
        intermediate = self._activation(projected)
        scaled = intermediate * permuted_probs.unsqueeze(-1)
        intermediate = scaled.to(intermediate.dtype)
        output = _GroupedLinear.apply(intermediate, offs, *fc2)
        if self.config.add_bias_linear:
            fc2_bias = torch.stack([expert.linear_fc2.bias for expert in self.local_experts])
            output = output + fc2_bias[experts] * permuted_probs.unsqueeze(-1)
        return output, None
