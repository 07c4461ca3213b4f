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

Without ``WORLD_SIZE`` in the environment and no process group, the worker starts a one-rank
gloo (or NCCL) group on a free local port: Megatron-Core always needs ``parallel_state``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from nrl_core.data import Batch
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.packing import PackedSequences
from nrl_core.policy_setup import (
    LazyReference,
    logprob_temperature,
    model_and_tokenizer,
    policy_dtype,
)
from nrl_core.weight_sync.layout import CHECKPOINT, IN_MEMORY, hf_skeleton, in_layout
from nrl_megatron.config import MegatronConfig
from nrl_megatron.convert import (
    ModelShape,
    expert_index,
    global_expert_name,
    iter_megatron_to_hf,
    megatron_to_hf_names,
    shard_for_tp,
    tp_split_dim,
    unshard_from_tp,
)


class MegatronSetupError(NrlError):
    """The megatron policy's options do not fit the model, the cluster or this machine."""


@contextlib.contextmanager
def _adam_step_set_aside(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Hide torch Adam's per-parameter ``step`` while Megatron-Core loads the distributed
    optimizer's parameter state, and put it back after.

    Without Apex or Transformer Engine, Megatron-Core 0.16.1 runs torch's Adam:
    ``load_state_dict`` sets ``state[p]["step"]`` (distrib_optimizer.py:817), but the parameter
    state file holds only ``param``, ``exp_avg`` and ``exp_avg_sq`` ("step" is handled separately
    when saving, :1819), and ``_set_main_param_and_optimizer_states`` copies every key the live
    state has (:939), so the load fails with ``KeyError: 'step'`` (seen on an H100,
    2026-11-26). The step count itself comes from the optimizer state dict loaded before, but
    as ONE tensor shared by every parameter (:825); torch's Adam increments each parameter's
    ``step`` in place, so a shared one would count every parameter's update and skew the bias
    correction after a resume. Each parameter gets its own copy back."""
    states = [optimizer.state for optimizer in optimizers]
    aside = [{p: s.pop("step") for p, s in state.items() if "step" in s} for state in states]
    try:
        yield
    finally:
        for state, steps in zip(states, aside, strict=True):
            for param, step in steps.items():
                state[param]["step"] = step.detach().clone()


def _input_ids(micro_batch: Batch | PackedSequences) -> torch.Tensor:
    """``[B, T]`` token ids of a padded micro batch, ``[1, total]`` of a packed one."""
    if isinstance(micro_batch, PackedSequences):
        return micro_batch.input_ids
    return micro_batch["input_ids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MegatronPolicyWorker:
    """One rank of the megatron policy (see :class:`nrl_core.interfaces.PolicyWorker`).

    Built as ``MegatronPolicyWorker(options, context)`` with ``options`` the
    ``policy.megatron`` section. Every public method is a collective.
    """

    def __init__(self, options: MegatronConfig | None, context: ComponentContext) -> None:
        self.options = options or MegatronConfig()
        self.context = context
        self.policy = context.config.policy
        self.dtype = policy_dtype(self.policy, MegatronSetupError)
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
        )
        from nrl_megatron.loading import load_local_state

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
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise MegatronSetupError(
                f"Megatron model and converted checkpoint disagree: missing {missing}, "
                f"unexpected {unexpected}"
            )
        model = model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        return model.train()

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

    def _lr(self, step: int) -> float:
        warmup = self.policy.optimizer.warmup_steps
        scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return self.policy.optimizer.lr * scale

    # -- logprobs --------------------------------------------------------------------------------

    @property
    def supports_sequence_packing(self) -> bool:
        """Micro batches may come packed (:mod:`nrl_core.packing`): they run in Megatron's THD
        layout (``PackedSeqParams``), through Transformer Engine's varlen attention or, on the
        local spec, :class:`nrl_megatron.model.SDPAttention`'s per-sample path."""
        return True

    def _logprobs(self, model, micro_batch: Batch | PackedSequences) -> torch.Tensor:
        """``[B, T]`` logprobs of the micro batch's ``input_ids`` (position 0 is 0), with the
        graph if enabled; ``[1, total]`` in the packed layout for packed sequences."""
        output, input_ids = self._stage_forward(model, micro_batch)
        return self._token_logprobs(output, input_ids)

    def _stage_forward(
        self, model, micro_batch: Batch | PackedSequences
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's forward of the micro batch: ``(output, input_ids)``, the output being
        the ``[B, T, V / tp]`` logits on the last stage and the hidden states it sends on
        before (a later stage's input comes from Megatron's ``set_input_tensor``)."""
        packed_seq_params = None
        if isinstance(micro_batch, PackedSequences):
            from megatron.core.packed_seq_params import PackedSeqParams

            packed = micro_batch.to(self.device)
            input_ids, positions = packed.input_ids, packed.position_ids
            # THD: the [1, total] row runs as one sequence of total tokens; attention and RoPE
            # restart at every boundary (the same boundaries context parallelism would split).
            packed_seq_params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=packed.cu_seqlens,
                cu_seqlens_kv=packed.cu_seqlens,
                max_seqlen_q=packed.max_seqlen,
                max_seqlen_kv=packed.max_seqlen,
            )
        else:
            input_ids = micro_batch["input_ids"].to(self.device)
            batch, width = input_ids.shape
            positions = torch.arange(width, device=input_ids.device)[None, :].expand(batch, -1)
        # [B, T, V / tp]: parallel_output=True leaves the vocab dimension sharded.
        output = model(input_ids, positions, None, packed_seq_params=packed_seq_params)
        return output, input_ids

    def _token_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` logprobs of ``input_ids`` (position 0 is 0) from the last stage's
        vocab-sharded logits."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits[:, :-1].float() / self.logprob_temperature
        # Megatron's vocab-parallel cross entropy = -log_softmax(logits)[target] across the
        # tensor-parallel vocab shards, without gathering the full logits.
        token_lp = -vocab_parallel_cross_entropy(logits.contiguous(), input_ids[:, 1:].contiguous())
        return torch.nn.functional.pad(token_lp, (1, 0))

    def _check_tp_peers_agree(self, batch: Batch | PackedSequences) -> None:
        """Tensor-parallel peers must compute on the same samples (they share activations)."""
        if self.tp_size == 1:
            return
        ids = batch.input_ids if isinstance(batch, PackedSequences) else batch["input_ids"]
        # On the worker's device: Megatron's groups use the default backend, and NCCL has no
        # backend for CPU tensors ("No backend type associated with device type cpu").
        digest = torch.tensor(
            [
                ids.shape[0],
                ids.shape[1],
                int(ids.long().sum()),
                int((ids.long() * 31 % 1009).sum()),
            ],
            dtype=torch.long,
            device=self.device,
        )
        gathered = [torch.zeros_like(digest) for _ in range(self.tp_size)]
        dist.all_gather(gathered, digest, group=self.tp_group)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise MegatronSetupError(
                "tensor-parallel peers received different batches; the core must give each "
                "tensor-parallel group one data-parallel shard"
            )

    def compute_logprobs(
        self, micro_batch: Batch | PackedSequences, *, reference: bool = False
    ) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` of one micro batch (vocab-parallel cross entropy, no
        graph) under the current or the reference ``GPTModel``; ``[1, total]`` for packed
        sequences."""
        self._check_tp_peers_agree(micro_batch)
        model = self.reference.model() if reference else self.model
        model.eval()
        with torch.no_grad():
            if self.pp_size == 1:
                return self._logprobs(model, micro_batch)
            out = self._run_schedule(model, [(micro_batch, None)], forward_only=True)
        if self.last_stage:
            return out[0]
        # Not read (the core takes each shard's result from its last stage), but the same
        # shape as the last stage's, for the packed layout's unpacking.
        return torch.zeros(_input_ids(micro_batch).shape, dtype=torch.float32)

    def _run_schedule(
        self,
        model,
        items: Sequence[tuple[Batch | PackedSequences, Callable | None]],
        *,
        forward_only: bool,
    ) -> list[torch.Tensor]:
        """Run ``items`` (micro batch, loss closure) through Megatron-Core's pipeline schedule
        (one call: all micro batches, every stage). Training (``loss`` given): the last stage
        back-propagates each closure's loss; returns nothing. ``forward_only`` (no closures):
        returns the last stage's ``[B, T]`` logprobs per micro batch (other stages: [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nrl_megatron.pipeline import megatron_pipeline_on_cpu

        count = len(items)

        def forward_step(data_iterator, module):
            micro_batch, loss = next(data_iterator)
            output, input_ids = self._stage_forward(module, micro_batch)

            def loss_func(logits, non_loss_data: bool = False):
                logprobs = self._token_logprobs(logits, input_ids)
                if non_loss_data:
                    return logprobs
                # Megatron divides a (loss, metrics) pair's loss by the number of micro
                # batches (schedules.py:267); the core's loss is already globally normalised.
                return loss(logprobs) * count, {}

            return output, loss_func

        rows, widths = zip(*(_input_ids(mb).shape for mb, _ in items), strict=True)
        schedule = get_forward_backward_func()
        cpu = contextlib.nullcontext() if self.on_gpu else megatron_pipeline_on_cpu()
        with cpu:
            # seq_length / micro_batch_size only size the first receive buffer when shapes are
            # fixed; with variable_seq_lengths the stages send each activation's shape first.
            result = schedule(
                forward_step_func=forward_step,
                data_iterator=iter(items),
                model=[model],
                num_microbatches=count,
                seq_length=max(widths),
                micro_batch_size=max(rows),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        return list(result) if forward_only and self.last_stage else []

    # -- colocated generation ----------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Colocated generation from the policy's current weights (``generation.backend=torch``
        routes here); see :mod:`nrl_megatron.generation`. Call on all ranks together, each
        tensor-parallel group with its data-parallel shard of prompts."""
        if self.pp_size > 1:
            raise MegatronSetupError(
                "colocated generation runs the whole model on each rank, which pipeline "
                "parallelism splits; set generation.torch.colocated=false (separate engines, "
                "refit from every stage) or pipeline_model_parallel_size=1"
            )
        if self._generator is None:
            from nrl_megatron.generation import MegatronGenerator

            self._generator = MegatronGenerator(
                self.module,
                self.tokenizer,
                device=self.device,
                seed=self.context.seed,
                dp_rank=self.dp_rank,
                tp_group=self.tp_group,
                tp_size=self.tp_size,
                batch_size=self.policy.logprob_batch_size,
                lockstep_group=self.ep_group,
            )
        return self._generator.generate(prompts, params, stop_strings)

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self, micro_batch: Batch | PackedSequences, loss: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Training forward of one micro batch (padded or packed), ``loss`` on its logprobs,
        backward."""
        self._check_tp_peers_agree(micro_batch)
        self.model.train()
        with self._router_statistics(micro_batch):
            logprobs = self._logprobs(self.model, micro_batch)
        loss(logprobs).backward()

    def _router_statistics(self, micro_batch: Batch | PackedSequences):
        """Count the routing of this forward (MoE models; a no-op otherwise): real tokens only,
        padding excluded (a packed micro batch has none)."""
        if self.router_stats is None:
            return contextlib.nullcontext()
        return self.router_stats.collecting(micro_batch)

    def forward_backward_micro_batches(
        self,
        items: Sequence[tuple[Batch | PackedSequences, Callable[[torch.Tensor], torch.Tensor]]],
    ) -> bool:
        """All micro batches of one optimizer step (``(micro batch, loss closure)`` pairs, in
        order): through Megatron-Core's pipeline schedule when pipeline-parallel, else one
        :meth:`forward_backward` each. Returns whether this rank computed the loss (only the
        last pipeline stage does: its closures are called, the other stages' are not)."""
        if self.pp_size == 1:
            for micro_batch, loss in items:
                self.forward_backward(micro_batch, loss)
            return True
        for micro_batch, _ in items:
            self._check_tp_peers_agree(micro_batch)
        self.model.train()
        self._run_schedule(self.model, items, forward_only=False)
        return self.last_stage

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
            _, grad_norm, _ = self.megatron_optimizer.step()
        else:
            self._average_gradients_over_dp()
            grad_norm = self._clip_gradients()
            if not math.isfinite(grad_norm):
                # A NaN or infinite gradient is never applied (the norm is the same on every
                # rank, so all skip together); the driver sees grad_norm and stops the run
                # (issue 40), as with dtensor. On GPUs Megatron's own optimizer steps: not
                # covered here.
                self._zero_grad()
                return {"grad_norm": float(grad_norm), "lr": lr, **self._routing_metrics()}
            self.optimizer.step()
        self.step += 1
        self._zero_grad()
        return {"grad_norm": float(grad_norm), "lr": lr, **self._routing_metrics()}

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

    # -- checkpoints -----------------------------------------------------------------------------

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.on_gpu:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _parameter_state_file(self, path: str) -> str:
        """The distributed optimizer's parameter-state file this rank writes and reads.

        Megatron writes it on data-parallel rank 0 of each chained optimizer's group
        (``ChainedOptimizer.save_parameter_state``): dense DP rank 0 of every (stage, TP rank),
        and, for the experts' optimizer, expert-DP rank 0 of every (stage, TP rank, EP rank),
        each with its own shard's state. Named by all three, so no two writers share a file
        (with PP > 1 or EP > 1 a name by TP rank alone was written by several ranks and read
        back by the wrong ones); a rank that does not write reads its writer's file, which has
        the same key."""
        return str(Path(path) / f"distopt_pp{self.pp_rank}_tp{self.tp_rank}_ep{self.ep_rank}.pt")

    def _legacy_parameter_state_file(self, path: str) -> str:
        # Checkpoints written before the per-stage, per-expert-rank names: one file per TP rank,
        # which only a layout with one stage and no expert parallelism wrote unambiguously.
        return str(Path(path) / f"distopt_tp{self.tp_rank}.pt")

    def save_checkpoint(self, path: str) -> None:
        """Save this rank's model shard, optimizer, step and RNG states under ``path``.

        One file per rank (``rank{N}.pt``). On the CPU path the files also name the optimizer's
        parameters, so that :meth:`load_checkpoint` can reshard them to another layout (not
        Megatron's ``dist_checkpointing``: its loader unpickles metadata, and nrl loads nothing
        that can run code). With the GPU's distributed optimizer the layout must stay the same.

        GPU (Megatron's distributed optimizer): its ``state_dict()`` holds only the parameter
        groups and the grad scaler; Adam's ``exp_avg``/``exp_avg_sq`` and the float32 main
        weights are its *parameter state* (megatron-core 0.16.1
        ``optimizer/distrib_optimizer.py:628-634``), which ``save_parameter_state`` gathers over
        the data-parallel group and writes on its rank 0 (``distrib_optimizer.py:1126``,
        through ``ChainedOptimizer.save_parameter_state``, ``optimizer/optimizer.py:1340``) into
        ``distopt_pp{P}_tp{T}_ep{E}.pt`` (:meth:`_parameter_state_file`). Without it a resume
        would silently restart Adam from zero.

        Before the first optimizer step (a checkpoint at step 0) the optimizer has no state to
        save, and Megatron's ``state_dict()`` asserts on exactly that (its step count comes
        from Adam's per-parameter state, ``distrib_optimizer.py:638-640``; the parameter state
        has no ``exp_avg`` yet): the checkpoint then records ``"optimizer": None``, and loading
        it gives the optimizer the fresh state it had.
        """
        Path(path).mkdir(parents=True, exist_ok=True)
        stepped = self._optimizer_has_state()
        torch.save(
            {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if stepped else None,
                "step": self.step,
                "rng": self._rng_state(),
                "layout": self._layout(),
                # The CPU optimizer's parameters in its order (its state is keyed by position):
                # what lets another layout find each moment's parameter (_load_resharded).
                "param_names": (
                    self._optimizer_param_names() if self.megatron_optimizer is None else None
                ),
            },
            Path(path) / f"rank{self.rank}.pt",
        )
        if self.megatron_optimizer is not None and stepped:
            # A collective over the data-parallel group (gloo gather); all ranks call it.
            self.megatron_optimizer.save_parameter_state(self._parameter_state_file(path))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote. The CPU path (``torch.optim``) also
        loads a checkpoint of another tensor, pipeline or data-parallel layout
        (:meth:`_load_resharded`); Megatron's distributed optimizer (GPU) needs the same
        layout."""
        from nrl_core.safe_pickle import torch_load_data

        # weights_only (torch_load_data): a checkpoint is data; unpickling arbitrary objects
        # could run code. A refused file is one line naming it.
        own_file = Path(path) / f"rank{self.rank}.pt"
        # A rank the saving layout did not have reads rank 0's file (for its RNG state only).
        state = torch_load_data(
            own_file if own_file.is_file() else Path(path) / "rank0.pt", map_location="cpu"
        )
        layout = self._layout()
        saved = {"pp": 1, **state["layout"]}
        if saved != layout and self._can_reshard(state, layout):
            self._load_resharded(path, saved)
            self.step = state["step"]
            self._set_rng_state(state["rng"])
            dist.barrier()
            return
        if saved != layout:
            raise MegatronSetupError(
                f"checkpoint {path} was written with {state['layout']}, this run has {layout}; "
                "resume with the same policy.num_workers, tensor_model_parallel_size, "
                "pipeline_model_parallel_size and expert_model_parallel_size"
            )
        self.module.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self._reset_optimizer_state()  # saved before the first step: a fresh optimizer
        else:
            self._load_optimizer_state(path, state["optimizer"])
        self.step = state["step"]
        self._set_rng_state(state["rng"])
        dist.barrier()

    def _set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and self.on_gpu:
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def _optimizer_param_names(self) -> list[str]:
        """The local names of the optimizer's parameters, in its order (CPU path)."""
        names = {id(param): name for name, param in self.module.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def _can_reshard(self, saved: dict, layout: dict[str, int]) -> bool:
        """Whether a checkpoint of another layout can be loaded here: both sides use the CPU
        path's ``torch.optim`` optimizer (Megatron's distributed optimizer keeps its own
        parameter-state files), the files name the optimizer's parameters, and neither side
        splits experts (resharding expert-parallel files is not written)."""
        return (
            self.megatron_optimizer is None
            and saved.get("param_names") is not None
            and "ep" not in saved["layout"]
            and "ep" not in layout
        )

    def _load_resharded(self, path: str, saved: dict) -> None:
        """Load a checkpoint written with another tensor/pipeline/data-parallel layout
        (``saved``): the files of data-parallel rank 0 of every (stage, tensor rank) together
        hold the whole model and its optimizer moments; they are put together under
        whole-model names, unsharded over the saving tensor parallelism, and this rank takes
        its stage's layers and its tensor-parallel slice (the same functions that cut the Hugging
        Face checkpoint at start-up)."""
        from nrl_core.distributed.worker_group import ParallelLayout
        from nrl_core.safe_pickle import torch_load_data
        from nrl_megatron.pipeline import global_name, layers_per_stage, local_state

        old = ParallelLayout(tp=saved["tp"], pp=saved["pp"])
        world = saved["world_size"]
        per = layers_per_stage(self.shape.num_layers, old.pp)
        shards: dict[str, dict[int, torch.Tensor]] = {}  # name -> {tp rank: tensor}
        moments: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # key -> name -> ...
        steps: dict[str, torch.Tensor] = {}
        for rank in range(world):
            if old.dp_rank(rank, world) != 0:
                continue
            state = torch_load_data(Path(path) / f"rank{rank}.pt", map_location="cpu")
            offset, tp_rank = old.pp_rank(rank, world) * per, old.tp_rank(rank)
            for name, tensor in state["model"].items():
                if not name.endswith("_extra_state") and tensor is not None:
                    shards.setdefault(global_name(name, offset), {})[tp_rank] = tensor
            if state["optimizer"] is None:
                continue
            names = state["param_names"]
            for index, param_state in state["optimizer"]["state"].items():
                name = global_name(names[index], offset)
                for key, value in param_state.items():
                    if key == "step":
                        steps[name] = value
                    elif isinstance(value, torch.Tensor):
                        moments.setdefault(key, {}).setdefault(name, {})[tp_rank] = value

        def whole(parts: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
            out = {}
            for name, by_rank in parts.items():
                ordered = [by_rank[t] for t in sorted(by_rank)]
                split = old.tp > 1 and tp_split_dim(name) is not None
                out[name] = unshard_from_tp(name, ordered) if split else ordered[0]
            return out

        def mine(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            local = local_state(full, self.pp_rank, self.shape.num_layers, self.pp_size)
            return {n: shard_for_tp(n, t, self.tp_rank, self.tp_size) for n, t in local.items()}

        model_state = mine(whole(shards))
        missing, unexpected = self.module.load_state_dict(model_state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise MegatronSetupError(
                f"checkpoint {path} ({saved}) does not fit this model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        self._reset_optimizer_state()
        if not steps:
            return  # saved before the first step: a fresh optimizer
        local_moments = {key: mine(whole(parts)) for key, parts in moments.items()}
        per_here = layers_per_stage(self.shape.num_layers, self.pp_size)
        params = dict(self.module.named_parameters())
        for name in self._optimizer_param_names():
            whole_name = global_name(name, self.pp_rank * per_here)
            state = {key: values[name].to(self.device) for key, values in local_moments.items()}
            self.optimizer.state[params[name]] = {"step": steps[whole_name].clone(), **state}

    def _layout(self) -> dict[str, int]:
        """The parallel layout a checkpoint's per-rank files belong to; ``ep`` only when experts
        are split (files of dense or EP=1 runs keep the layout they always had)."""
        layout = {"tp": self.tp_size, "pp": self.pp_size, "world_size": self.world_size}
        if self.ep_size > 1:
            layout["ep"] = self.ep_size
        return layout

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The ``torch.optim`` optimizers that hold the per-parameter state: the CPU path's own,
        or the one each of Megatron's (chained) distributed optimizers wraps (``.optimizer``)."""
        if self.megatron_optimizer is None:
            return [self.optimizer]
        chained = getattr(self.megatron_optimizer, "chained_optimizers", None)
        return [o.optimizer for o in (chained or [self.megatron_optimizer])]

    def _optimizer_has_state(self) -> bool:
        """Whether an optimizer step has created per-parameter state (Adam's moments). The same
        on every rank: all ranks step together."""
        return any(len(optimizer.state) > 0 for optimizer in self._torch_optimizers())

    def _reset_optimizer_state(self) -> None:
        """The optimizer as it was before its first step, for the weights just loaded."""
        for optimizer in self._torch_optimizers():
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group.pop("step", None)  # Transformer Engine's FusedAdam counts steps here
        if self.megatron_optimizer is not None:
            # Its float32 main weights are copies of the model's: take the loaded ones.
            self.megatron_optimizer.reload_model_params()

    def _load_optimizer_state(self, path: str, state: dict) -> None:
        # Checked before anything is loaded: a refused checkpoint leaves the optimizer as it was.
        distributed = self.megatron_optimizer is not None
        state_file = self._parameter_state_to_load(path) if distributed else None
        self.optimizer.load_state_dict(state)
        if distributed:
            # load_state_dict() above allocated placeholder moments (distrib_optimizer.py:690);
            # the parameter state file fills them and the main weights, scattered from
            # data-parallel rank 0 (distrib_optimizer.py:2253, 1965).
            with _adam_step_set_aside(self._torch_optimizers()):
                self.megatron_optimizer.load_parameter_state(state_file)

    def _parameter_state_to_load(self, path: str) -> str:
        """The parameter-state file of checkpoint ``path`` for this rank, or a one-line
        :class:`MegatronSetupError` when it has none this rank can trust."""
        state_file = self._parameter_state_file(path)
        legacy = self._legacy_parameter_state_file(path)
        if not Path(state_file).is_file() and Path(legacy).is_file():
            if self.pp_size > 1 or self.ep_size > 1:
                raise MegatronSetupError(
                    f"checkpoint {path} names its optimizer state by tensor-parallel rank only "
                    f"({Path(legacy).name}), which the pipeline stages and expert-parallel "
                    "ranks overwrote in each other; resume from a checkpoint written since"
                )
            state_file = legacy  # one stage, no expert parallelism: one writer per TP rank
        if not Path(state_file).is_file():
            raise MegatronSetupError(
                f"checkpoint {path} has no {Path(state_file).name} (the distributed "
                "optimizer's moments and main weights); resume from a checkpoint written "
                "by a GPU run of the megatron policy"
            )
        return state_file

    # -- colocated engines: hand the GPU memory over -------------------------------------------

    def offload(self, what: list[str]) -> None:
        """Move ``"optimizer"`` and/or ``"weights"`` to CPU memory and empty the CUDA cache, for
        generation engines colocated on this GPU; :meth:`onload` brings them back. No-op on
        CPU (nothing to hand over), and for what is already offloaded.

        - ``"optimizer"``: the distributed optimizer's Adam moments and float32 main weights,
          with Megatron-Core's own RL hook ``offload_to_cpu`` (0.16.1
          ``optimizer/optimizer.py:344``, chained at ``:1414``).
        - ``"weights"``: the parameters and gradients, which Megatron's DDP keeps in flat
          buffers: their storage goes to pinned CPU memory and is freed on the GPU
          (``distributed/param_and_grad_buffer.py:964``; the parameter views stay valid
          objects), plus the frozen reference model if it was built.
        """
        unknown = sorted(set(what) - {"optimizer", "weights"})
        if unknown:
            raise MegatronSetupError(
                f"offload got {unknown}; the megatron policy offloads 'optimizer' and 'weights'"
            )
        if not self.on_gpu:
            return
        todo = [part for part in ("optimizer", "weights") if part in what]
        todo = [part for part in todo if part not in self._offloaded]
        if "optimizer" in todo and "weights" in self._offloaded:
            # With float32 weights the optimizer's shards are views of the parameter buffer,
            # which offloaded weights have emptied: bring it back to copy them out first.
            self._reload_weights()
            todo.append("weights")
        if "optimizer" in todo:
            self.megatron_optimizer.offload_to_cpu()
        if "weights" in todo:
            torch.cuda.synchronize(self.device)  # no kernel may still read the buffers
            for buffer in self._ddp_buffers():
                buffer.offload_to_cpu(move_params=True, move_grads=True)
            if self.reference.built is not None:  # never build it just to offload it
                self.reference.built.to("cpu")
        self._offloaded.update(todo)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back to the GPU what :meth:`offload` moved (nothing if nothing was).
        Gradients come back zeroed, as they are between optimizer steps."""
        if not self.on_gpu or not self._offloaded:
            return
        if "weights" in self._offloaded:
            self._reload_weights()
        if "optimizer" in self._offloaded:
            # For float32 weights the optimizer's shards were views of the parameter buffer;
            # after the round trip they are copies, which Megatron copies back into the buffer
            # after every step (distrib_optimizer.py:2429), so training stays exact.
            self.megatron_optimizer.restore_from_cpu()  # optimizer.py:364
        self._offloaded.clear()
        torch.cuda.synchronize(self.device)

    def _reload_weights(self) -> None:
        for buffer in self._ddp_buffers():
            buffer.reload_from_cpu(move_params=True, move_grads=True)  # param_and_grad_buffer:979
        if self.reference.built is not None:
            self.reference.built.to(self.device)

    def _ddp_buffers(self) -> list:
        """Megatron DDP's parameter-and-gradient buffers (distributed_data_parallel.py:591)."""
        return [*self.model.buffers, *self.model.expert_parallel_buffers]

    # -- export and refit ------------------------------------------------------------------------

    def hf_param_names(self) -> dict[str, list[str]]:
        """Megatron parameter name -> the Hugging Face names it exports to (for engines)."""
        return megatron_to_hf_names(self.shape, te=self.options.transformer_engine)

    def _full_megatron_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of every Megatron parameter of the whole model, gathered over
        tensor parallelism and pipeline stages (a collective: every rank gets every tensor,
        each exactly once, under its whole-model name). With expert parallelism each local
        expert tensor is gathered over the expert-parallel group and yielded once per expert,
        under its global name: every expert exactly once."""
        if self.pp_size == 1:
            yield from self._stage_tensors()
            return
        from nrl_megatron.pipeline import layers_per_stage

        per = layers_per_stage(self.shape.num_layers, self.pp_size)
        # Stage by stage: the stage's ranks know its tensors; every rank of the pipeline group
        # learns their names and shapes, then receives each tensor by broadcast. A stage sends
        # only its own parameters, so no name arrives twice (NeMo RL's issue #2471).
        for stage in range(self.pp_size):
            source = dist.get_global_rank(self.pp_group, stage)
            mine = list(self._stage_tensors(offset=stage * per)) if stage == self.pp_rank else []
            header = [[(n, tuple(t.shape), t.dtype) for n, t in mine]]
            dist.broadcast_object_list(header, src=source, group=self.pp_group)
            own = dict(mine)
            for name, shape, dtype in header[0]:
                tensor = (
                    own[name]
                    if stage == self.pp_rank
                    else torch.empty(shape, dtype=dtype, device=self.device)
                )
                dist.broadcast(tensor.contiguous(), src=source, group=self.pp_group)
                yield name, tensor

    def _stage_tensors(self, offset: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's parameters, gathered over tensor parallelism, named with their decoder
        layers shifted by ``offset`` (the stage's first layer in the whole model)."""
        from nrl_megatron.pipeline import global_name

        with torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                if name.endswith("_extra_state") or tensor is None:
                    continue
                if self.ep_size > 1 and expert_index(name) is not None:
                    shards = [torch.empty_like(tensor) for _ in range(self.ep_size)]
                    dist.all_gather(shards, tensor.contiguous(), group=self.ep_group)
                    local = self.shape.num_experts // self.ep_size
                    for ep_rank, shard in enumerate(shards):
                        yield global_expert_name(name, ep_rank, local), shard
                    continue
                if self.tp_size > 1 and tp_split_dim(name) is not None:
                    shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                    dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
                    tensor = unshard_from_tp(name, shards)
                yield global_name(name, offset), tensor.detach()

    def state_dict_buckets(
        self, bucket_bytes: int, layout: str = IN_MEMORY
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the full state dict in Hugging Face names, in the weight ``layout`` an engine
        loads (``in_memory``: transformers' ``state_dict()`` names, experts stacked;
        ``checkpoint``: the published files', one tensor per expert, see
        :mod:`nrl_core.weight_sync.layout`), in buckets of at most ``bucket_bytes`` (a larger
        tensor gets its own). A collective."""
        from nrl_core.weight_sync import iter_buckets

        te = self.options.transformer_engine
        named = iter_megatron_to_hf(self._full_megatron_tensors(), self.shape, te)
        if layout != IN_MEMORY:
            named = in_layout(named, layout, self._hf_skeleton)
        yield from iter_buckets(named, bucket_bytes)

    def push_weights(self, sender, bucket_bytes: int):
        """Send the full, tensor-parallel-gathered weights, in Hugging Face names (what vLLM and
        SGLang load), to generation engines through ``sender`` (a
        :class:`nrl_core.weight_sync.WeightSender`) in buckets of at most ``bucket_bytes``.

        A collective: call on all ranks (the gathers run on every rank; rank 0 talks to the
        engines). A Ray actor method cannot return :meth:`state_dict_buckets`' generator, so it
        is consumed here. Rank 0 returns the :class:`~nrl_core.weight_sync.RefitStats`, others
        None.
        """

        from nrl_core.weight_sync import push_from_rank

        buckets = self.state_dict_buckets(bucket_bytes, layout=sender.layout)
        return push_from_rank(sender, buckets, rank=self.rank)

    @cached_property
    def _hf_skeleton(self):
        """A weightless (meta) transformers model of this architecture: what
        :func:`~nrl_core.weight_sync.in_layout` needs to know its load-time conversions."""
        return hf_skeleton(self.hf_config)

    def init_weight_sync_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the NCCL refit group with the engines (the ``nccl`` transport). Only rank 0
        sends, so only rank 0 joins; the other ranks return at once."""
        from nrl_core.weight_sync import init_nccl_group

        if self.rank == 0:
            init_nccl_group(name, master_addr, master_port, rank_offset, world_size, self.device)

    def export_hf(self, path: str) -> None:
        """Write ``model.safetensors``, ``config.json`` and the tokenizer to ``path`` (rank 0
        writes; all ranks take part in gathering the weights)."""
        from nrl_core.hf_export import write_hf_folder

        te = self.options.transformer_engine
        state = dict(iter_megatron_to_hf(self._full_megatron_tensors(), self.shape, te))
        if self.rank == 0:
            # vLLM, SGLang and other converters read the published (per-expert) layout.
            state = dict(in_layout(state.items(), CHECKPOINT, self._hf_skeleton))
            write_hf_folder(path, state, self.hf_config, self.tokenizer, self.dtype)
        dist.barrier()
