"""The megatron policy worker's optimizer step: learning rate, gradient averaging over
data-parallel ranks and clipping on the CPU path, Megatron's distributed optimizer on GPU. A
mixin of :class:`nrl_megatron.worker.MegatronPolicyWorker`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nrl_core.lr_schedule import lr_scale
from nrl_megatron.convert import expert_index


class OptimizerMixin:
    """``optimizer_step`` and its gradient helpers for
    :class:`~nrl_megatron.worker.MegatronPolicyWorker`."""

    def _lr(self, step: int) -> float:
        return self.policy.optimizer.lr * lr_scale(step, self.policy.optimizer)

    def optimizer_step(self) -> dict[str, float]:
        """Average gradients over data-parallel ranks (CPU path; Megatron DDP does it on GPU),
        clip, step, zero the gradients; returns ``grad_norm`` (before clipping) and ``lr``, and
        for a mixture of experts this rank's router statistics of the step (``moe/*``, see
        :data:`nrl_megatron.moe.METRIC_REDUCTIONS`)."""
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.megatron_optimizer is not None:
            self.model.finish_grad_sync()
            # Megatron's step() computes the norm and applies the update in one call, and
            # without a grad scaler (bfloat16) it applies NaN gradients (a NaN clip
            # coefficient is not < 1); so non-finite gradients are looked for first.
            grad_norm = math.nan
            if self._ddp_gradients_finite():
                _, grad_norm, _ = self.megatron_optimizer.step()
                grad_norm = math.nan if grad_norm is None else float(grad_norm)
            if not math.isfinite(grad_norm):
                # Skipped as on the CPU path (or, had only the norm overflowed, reported so);
                # the driver sees grad_norm and stops the run (issue 40).
                self._zero_grad()
                return {"grad_norm": grad_norm, "lr": lr, **self._routing_metrics()}
        else:
            self._average_gradients_over_dp()
            grad_norm = self._clip_gradients()
            if not math.isfinite(grad_norm):
                # A NaN or infinite gradient is never applied (the norm is the same on every
                # rank, so all skip together); the driver sees grad_norm and stops the run
                # (issue 40), as with dtensor.
                self._zero_grad()
                return {"grad_norm": float(grad_norm), "lr": lr, **self._routing_metrics()}
            self.optimizer.step()
        self.step += 1
        self._zero_grad()
        return {"grad_norm": float(grad_norm), "lr": lr, **self._routing_metrics()}

    def _ddp_gradients_finite(self) -> bool:
        """Whether every gradient in Megatron DDP's buffers is finite, on every rank (a
        collective over all ranks when there are several). After the gradient sync each rank's
        buffer holds its reduced shard and its own contributions to the others, so a NaN or
        infinity any rank computed shows in some rank's buffer. One sum per buffer: finite
        exactly when all its elements are (short of an overflow of the sum itself)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for buffer in self._ddp_buffers():
            grads = getattr(buffer, "grad_data", None)
            if grads is not None and grads.numel() and not torch.isfinite(grads.sum()):
                bad.fill_(1.0)
                break
        if self.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _routing_metrics(self) -> dict[str, float]:
        return self.router_stats.metrics() if self.router_stats is not None else {}

    def _zero_grad(self) -> None:
        if self.megatron_optimizer is not None:
            self.model.zero_grad_buffer()
            self.megatron_optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _average_gradients_over_dp(self) -> None:
        """Dense gradients: the mean over data-parallel ranks. An expert's gradient (MoE): the
        sum over its expert-data-parallel peers divided by the data-parallel size, as
        Megatron's DDP scales it (``expert_gradient_scaling_factor``): with expert parallelism
        the token dispatcher brings every rank's tokens of an expert to the rank holding it, so
        its local gradient already sums over ``ep`` ranks' losses."""
        if self.dp_size == 1:
            return
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            expert = self.shape.is_moe and expert_index(name) is not None
            group, size = (
                (self.expert_dp_group, self.expert_dp_size)
                if expert
                else (self.dp_group, self.dp_size)
            )
            if size > 1:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            param.grad.div_(self.dp_size)

    def _clip_gradients(self) -> float:
        """Clip to ``policy.max_grad_norm`` (0 disables); return the norm before clipping.

        Tensor-parallel-sharded parameters (Megatron marks them ``tensor_model_parallel``)
        contribute their local squares summed over the TP group; replicated ones count once.
        Pipeline stages hold disjoint parameters: their squares add up over the stages.
        """
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        params = []
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            params.append(param)
            square = param.grad.double().pow(2).sum()
            if self.ep_size > 1 and expert_index(name) is not None:
                experts += square  # this rank's experts; the others' are on its EP peers
            elif getattr(param, "tensor_model_parallel", False):
                sharded += square
            else:
                replicated += square
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        if self.ep_size > 1:
            dist.all_reduce(experts, group=self.ep_group)
        square = sharded + replicated + experts
        if self.pp_size > 1:
            dist.all_reduce(square, group=self.pp_group)
        total = float(square) ** 0.5
        if self.policy.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(
                params, self.policy.max_grad_norm, torch.tensor(total)
            )
        return total
