"""The megatron policy worker: a Megatron-Core ``GPTModel`` built from a Hugging Face
Llama/Qwen2 checkpoint, one instance per rank.

Parallelism: ranks are laid out by ``megatron.core.parallel_state`` (tensor-parallel peers are
adjacent ranks). The core shards batches over all ranks, so tensor-parallel peers must receive
the SAME shard: the worker checks this and raises otherwise. Context parallel sizes above 1
are refused for now (see docs/megatron.md).

Pipeline parallelism (``pipeline_model_parallel_size`` > 1): each stage builds only its layers
(:mod:`nrl_megatron.pipeline`); a training step runs all of the rank's micro batches through
Megatron-Core's own schedule (``get_forward_backward_func()``, 1F1B) in
:meth:`MegatronPolicyWorker.forward_backward_micro_batches`, and logprobs through the same
schedule forward-only. The loss (and the logprobs) exist on the last stage only; the core reads
each data shard's result from that stage (``ParallelLayout.result_rank``). On CPU the schedule
runs under :func:`nrl_megatron.pipeline.megatron_pipeline_on_cpu`. Pipeline stages of a mixture
of experts are refused (not wired together yet).

Mixtures of experts (Qwen3-MoE): expert parallelism (``expert_model_parallel_size``) splits each
layer's experts over ``ep`` of the data-parallel ranks (Megatron's ``SequentialMLP`` with
``E / ep`` local experts); the dense weights stay replicated over them. On the CPU path an
expert's gradient is averaged over its expert-data-parallel group (the ranks holding the same
experts) and scaled as Megatron's DDP scales it, and the gradient norm sums the experts' squares
over the expert-parallel group; export and refit gather every expert once
(:meth:`MegatronPolicyWorker._full_megatron_tensors`). Router statistics (``moe/*``):
:mod:`nrl_megatron.moe`.

Optimizer, two paths:

- GPU: Megatron-Core's ``DistributedDataParallel`` plus ``get_megatron_optimizer`` with the
  distributed optimizer (optimizer state sharded over data-parallel ranks, float32 main weights).
- CPU: Megatron-Core's DDP buffers and distributed optimizer allocate on
  ``torch.cuda.current_device()`` and reject non-CUDA tensors, so on CPU the worker uses
  ``torch.optim`` over the Megatron module and averages gradients over the data-parallel group
  itself (gloo all-reduce). The model, its forward and its tensor parallelism are Megatron's.

Training step: the core runs it (:mod:`nrl_core.training`): micro batches, the globally
normalised loss scaled by the data-parallel size (gradients are *averaged* over data-parallel
ranks, by Megatron DDP and by our CPU all-reduce), metric reduction. This worker implements the
per-rank parts: :meth:`MegatronPolicyWorker.forward_backward` and ``optimizer_step``.

Temperature: logprobs are ``log_softmax(logits / T)`` with ``T`` the run's generation
temperature (1 when absent or greedy), computed with Megatron's vocab-parallel cross entropy.

Generation: ``generate`` (colocated, what ``generation.backend=torch`` calls on the policy
workers) samples from this Megatron model itself; see :mod:`nrl_megatron.generation`.

PPO critic (the ``critic`` section, whose ``value_head`` the worker reads from its ``policy``):
the last stage ends in a per-token scalar head (:class:`nrl_megatron.model.ValueHead`, zero at
the start) instead of the LM output layer; ``get_logprobs`` then returns the values ``[B, T]``
(value ``t`` of the prefix ending at token ``t``, :mod:`nrl_core.reward_model`), which the
core's step trains with :class:`nrl_core.losses.value.ClippedValueLoss`, packed or padded. A
critic neither generates nor exports to Hugging Face (both refused in one line).

Without ``WORLD_SIZE`` in the environment and no process group, the worker starts a one-rank
gloo (or NCCL) group on a free local port: Megatron-Core always needs ``parallel_state``.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from nrl_core.interfaces import ComponentContext
from nrl_core.policy_setup import (
    LazyReference,
    logprob_temperature,
    model_and_tokenizer,
    policy_dtype,
)
from nrl_megatron.checkpoint import CheckpointMixin
from nrl_megatron.config import MegatronConfig
from nrl_megatron.convert import ModelShape
from nrl_megatron.errors import MegatronSetupError
from nrl_megatron.forward import ForwardMixin
from nrl_megatron.optim import OptimizerMixin
from nrl_megatron.weights import WeightsMixin

__all__ = ["MegatronPolicyWorker", "MegatronSetupError"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MegatronPolicyWorker(ForwardMixin, OptimizerMixin, CheckpointMixin, WeightsMixin):
    """One rank of the megatron policy (see :class:`nrl_core.interfaces.PolicyWorker`).

    Built as ``MegatronPolicyWorker(options, context)`` with ``options`` the
    ``policy.megatron`` section. Every public method is a collective.
    """

    def __init__(self, options: MegatronConfig | None, context: ComponentContext) -> None:
        self.options = options or MegatronConfig()
        self.context = context
        self.policy = context.config.policy
        self.dtype = policy_dtype(self.policy, MegatronSetupError)
        # A PPO critic (its section declares `value_head`): a per-token scalar value head in
        # place of the LM output layer (nrl_megatron.model.ValueHead); values stand where
        # logprobs are, so the core's batching, micro batching and packing serve both.
        self.value_head = bool(getattr(self.policy, "value_head", False))
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu and self.dtype != torch.float32:
            raise MegatronSetupError(
                "the megatron policy runs bfloat16 only on GPU; set policy.precision=float32 on CPU"
            )
        if self.options.transformer_engine and not self.on_gpu:
            raise MegatronSetupError(
                "policy.megatron.transformer_engine=true needs a GPU; set it to false on CPU"
            )
        self._init_distributed()
        self._init_parallel_state()
        torch.manual_seed(context.seed + self.rank)

        from transformers import AutoConfig

        self.model_path, self.tokenizer = model_and_tokenizer(self.policy)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        self._check_pipeline_fits()
        for what, count in (
            ("attention", self.shape.num_heads),
            ("key/value", self.shape.num_kv_heads),
        ):
            if count % self.tp_size:
                raise MegatronSetupError(
                    f"tensor_model_parallel_size={self.tp_size} does not divide the {count} "
                    f"{what} heads; lower policy.megatron.tensor_model_parallel_size"
                )
        self.lora_dropout = None  # nrl_megatron.lora.LoraDropout with lora_dropout > 0
        self.model = self._build_model(self.model_path, trainable=True)
        # The frozen reference (KL penalties, DPO), built on first use.
        self.reference = LazyReference(
            lambda path: self._build_model(path, trainable=False), self.model_path
        )
        from nrl_megatron.moe import METRIC_REDUCTIONS, RouterStatistics

        moe = self.shape.is_moe
        self.router_stats = RouterStatistics(self.model) if moe else None
        self.metric_reductions = dict(METRIC_REDUCTIONS) if moe else {}
        self._build_optimizer()
        self.step = 0
        self._offloaded: set[str] = set()  # "optimizer"/"weights" in CPU memory (offload)

        self.logprob_temperature = logprob_temperature(context.config)
        self._generator = None  # built on the first colocated generate call

    # -- setup ----------------------------------------------------------------------------------

    def _init_distributed(self) -> None:
        if self.on_gpu:
            from nrl_core.distributed.devices import select_cuda_device

            # Under Ray each rank sees only its own GPU (CUDA_VISIBLE_DEVICES narrowed), so
            # the local rank is no device index here; the core makes the choice for all plugins.
            self.device = select_cuda_device()
        else:
            self.device = torch.device("cpu")
        backend = "nccl" if self.on_gpu else "gloo"
        if not dist.is_initialized():
            if "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend)
            else:
                dist.init_process_group(
                    backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
                )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps

        o = self.options
        tp, pp, cp, ep = (
            o.tensor_model_parallel_size,
            o.pipeline_model_parallel_size,
            o.context_parallel_size,
            o.expert_model_parallel_size,
        )
        unsupported = {
            "context_parallel_size": cp,
        }
        for key, value in unsupported.items():
            if value != 1:
                raise MegatronSetupError(
                    f"policy.megatron.{key}={value} is not implemented yet by the megatron "
                    "policy (see docs/megatron.md); set it to 1"
                )
        if tp < 1 or self.world_size % (tp * pp):
            raise MegatronSetupError(
                f"policy.megatron.tensor_model_parallel_size={tp} x "
                f"pipeline_model_parallel_size={pp} must divide the {self.world_size} policy ranks"
            )
        # A later worker in the same process (tests) reuses matching groups, rebuilds others.
        if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size() != tp
            or ps.get_expert_model_parallel_world_size() != ep
            or ps.get_pipeline_model_parallel_world_size() != pp
        ):
            ps.destroy_model_parallel()
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                context_parallel_size=cp,
                expert_model_parallel_size=ep,
            )
        self.tp_size = tp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.ep_size = ep
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        # The ranks holding the same experts (dp / ep of them): an expert's data-parallel peers.
        self.expert_dp_size = ps.get_expert_data_parallel_world_size()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.pp_size = pp
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage = self.pp_rank == 0
        self.last_stage = self.pp_rank == pp - 1

    def _check_pipeline_fits(self) -> None:
        """Refuse, in one line, what this pipeline split does not support."""
        if self.pp_size == 1:
            return
        layers = self.shape.num_layers
        if layers % self.pp_size:
            raise MegatronSetupError(
                f"policy.megatron.pipeline_model_parallel_size={self.pp_size} does not divide "
                f"the model's {layers} layers; choose a divisor of {layers}"
            )
        if self.shape.is_moe:
            raise MegatronSetupError(
                "pipeline parallelism with a mixture-of-experts model is not implemented by the "
                "megatron policy yet; set policy.megatron.pipeline_model_parallel_size=1 (expert "
                "parallelism works: expert_model_parallel_size)"
            )
        if self.shape.tie_word_embeddings:
            # Megatron-Core 0.16.1 builds the last stage's copy of tied embeddings with
            # `weight.data.cuda()` (language_module.py:244), and the gradient all-reduce between
            # the two copies is not wired here.
            raise MegatronSetupError(
                "pipeline parallelism with tied input and output embeddings is not implemented "
                "by the megatron policy; set policy.megatron.pipeline_model_parallel_size=1"
            )

    def _build_model(self, path: str, trainable: bool):
        from nrl_megatron.loading import load_local_state
        from nrl_megatron.model import VALUE_HEAD as VALUE_HEAD_PARAMETER
        from nrl_megatron.model import build_gpt_model, transformer_config

        config = transformer_config(
            self.hf_config,
            tp=self.tp_size,
            ep=self.ep_size,
            pp=self.pp_size,
            dtype=self.dtype,
            on_gpu=self.on_gpu,
        )
        # Micro batches are trimmed to their own longest sample, so stages exchange their
        # activation shapes before each transfer.
        config.variable_seq_lengths = self.pp_size > 1
        model = build_gpt_model(
            self.hf_config,
            config,
            transformer_engine=self.options.transformer_engine,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            value_head=self.value_head,
        )
        # One rank reads and converts; every rank keeps its slices (nrl_megatron.loading).
        state = load_local_state(
            path,
            self.shape,
            model.state_dict(),
            te=self.options.transformer_engine,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            device=self.device if self.on_gpu else "cpu",
        )
        if self.value_head:
            # The checkpoint's LM head (absent when tied) is not the critic's: its value head
            # starts at zero (ValueHead), on the last stage, where it is the output layer.
            state.pop("output_layer.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [
            k for k in missing if not k.endswith("_extra_state") and k != VALUE_HEAD_PARAMETER
        ]
        if missing or unexpected:
            raise MegatronSetupError(
                f"Megatron model and converted checkpoint disagree: missing {missing}, "
                f"unexpected {unexpected}"
            )
        model = model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        if self.options.lora_rank > 0:
            self._apply_lora(model)
        return model.train()

    def _apply_lora(self, model) -> None:
        """Freeze ``model`` and add the LoRA adapters (:mod:`nrl_megatron.lora`)."""
        from nrl_megatron.lora import LoraDropout, apply_lora

        o = self.options
        if self.shape.is_moe:
            raise MegatronSetupError(
                "LoRA on a mixture-of-experts model is not implemented by the megatron policy; "
                "set policy.megatron.lora_rank=0 or use policy.backend=dtensor"
            )
        if self.value_head:
            raise MegatronSetupError(
                "LoRA on a PPO critic is not implemented by the megatron policy (its value "
                "head would stay frozen); set critic.megatron.lora_rank=0"
            )
        if o.lora_dropout > 0:
            # The same masks on tensor-parallel peers, other ones per data-parallel rank.
            seed = self.context.seed * 7919 + 104729 * (self.dp_rank + 1)
            self.lora_dropout = LoraDropout(o.lora_dropout, seed, self.device)
        from nrl_megatron.pipeline import layers_per_stage

        apply_lora(
            model,
            targets=o.lora_targets(),
            rank=o.lora_rank,
            alpha=o.lora_alpha,
            dropout=self.lora_dropout,
            seed=self.context.seed,
            layer_offset=self.pp_rank * layers_per_stage(self.shape.num_layers, self.pp_size),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            num_query_groups=self.shape.num_kv_heads,
        )

    def set_reference(self, model_path: str) -> None:
        """Convert the Hugging Face folder ``model_path`` (on next use) into the frozen
        reference ``GPTModel``, sharded over tensor parallelism like the policy."""
        self.reference.set_path(model_path)

    def _build_optimizer(self) -> None:
        opt = self.policy.optimizer
        if opt.name not in ("adamw", "sgd"):
            raise MegatronSetupError(
                f"policy.optimizer.name={opt.name!r} is not supported; use `adamw` or `sgd`"
            )
        self.module = self.model  # the bare GPTModel (the DDP wrapper, if any, is self.model)
        if self.on_gpu:
            self._build_megatron_optimizer()
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        if opt.name == "adamw":
            self.optimizer = torch.optim.AdamW(
                params,
                lr=opt.lr,
                betas=tuple(opt.betas),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
        else:
            self.optimizer = torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
        self.megatron_optimizer = None

    def _build_megatron_optimizer(self) -> None:
        """Megatron DDP + distributed optimizer (GPU only; not run yet, see docs/megatron.md)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt = self.policy.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.options.grad_reduce_in_fp32,
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
        )
        self.model = DistributedDataParallel(
            config=self.module.config, ddp_config=ddp_config, module=self.module
        )
        optim_config = OptimizerConfig(
            optimizer="adam" if opt.name == "adamw" else "sgd",
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.betas[0],
            adam_beta2=opt.betas[1],
            adam_eps=opt.eps,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=True,
            clip_grad=self.policy.max_grad_norm,
            # HybridDeviceOptimizer; without the precision-aware optimizer (it reads the TE
            # version) the fp32 main weights stay on the GPU and only the moments move.
            optimizer_cpu_offload=self.options.optimizer_cpu_offload,
            optimizer_offload_fraction=(
                self.options.optimizer_offload_fraction
                if self.options.optimizer_cpu_offload
                else 0.0
            ),
        )
        self.megatron_optimizer = get_megatron_optimizer(optim_config, [self.model])
        self.optimizer = self.megatron_optimizer
