"""The dtensor policy worker: FSDP2 (+ optional DTensor tensor parallel) training of a Hugging
Face causal LM, one instance per rank; or, with ``policy.dtensor.data_parallel`` resolving to
``replicate`` (the CPU default for models that fit), the whole model on every rank and one
gradient all-reduce per step.

The core runs the training step (:mod:`nrl_core.training`): it splits micro batches, calls
:meth:`DTensorPolicyWorker.forward_backward` once per micro batch with a loss closure that is
already normalised globally and scaled by the data-parallel size (FSDP2 *averages* gradients
over data-parallel ranks, and so does the replicated all-reduce), then
:meth:`DTensorPolicyWorker.optimizer_step`.

Temperature: logprobs computed here are ``log_softmax(logits / T)`` with ``T`` the generation
temperature of the run (``generation.temperature``, 1 when absent or greedy), the same
distribution whose logprobs :class:`~nrl_dtensor.generation.TorchGenerator` reports.

Without ``WORLD_SIZE`` in the environment the worker runs as a single process, without
``torch.distributed`` and without FSDP (bfloat16 then uses autocast over float32 weights).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from nrl_core.data import Batch
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.lr_schedule import lr_scale
from nrl_core.packing import PackedSequences
from nrl_core.policy_setup import (
    LazyReference,
    logprob_temperature,
    model_and_tokenizer,
    move_optimizer_state,
    policy_dtype,
)
from nrl_core.weight_sync.layout import CHECKPOINT, IN_MEMORY, in_layout
from nrl_dtensor.building import DTensorSetupError, ModelBuilding
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig

__all__ = ["DTensorPolicyWorker", "DTensorSetupError"]


class DTensorPolicyWorker(ModelBuilding):
    """One rank of the dtensor policy (see :class:`nrl_core.interfaces.PolicyWorker`).

    Built as ``DTensorPolicyWorker(options, context)`` with ``options`` the ``policy.dtensor``
    section and ``context.config`` the whole run config. Every public method is a collective:
    call it on all ranks together, each with its data-parallel shard.
    """

    def __init__(self, options: DTensorConfig | None, context: ComponentContext) -> None:
        self.options = options or DTensorConfig()
        self.context = context
        self.policy = context.config.policy
        self.dtype = policy_dtype(self.policy, DTensorSetupError)
        # A reward-model run (its config has an `rm` section) and a PPO critic (its section
        # declares `value_head`) train a scalar head.
        head = self.options.head
        self.value_head = bool(getattr(self.policy, "value_head", False))
        wants_scalar = hasattr(context.config, "rm") or self.value_head
        self.scalar_head = head == "scalar" or (head == "auto" and wants_scalar)
        self._init_distributed()
        self._init_meshes()
        self.sharded: bool | None = None
        """Whether the weights are FSDP2-sharded (``data_parallel``, resolved on the first
        model built); ``False`` without torch.distributed."""
        # Tensor-parallel peers share a stream: they run the same replicated computation, and
        # a dropout (LoRA's) must drop the same entries of the input they share.
        torch.manual_seed(context.seed + self.dp_rank)

        self.model_path, self.tokenizer = model_and_tokenizer(self.policy)
        self.model = self._build_model(self.model_path, trainable=True)
        self.hf_config = self.model.config
        from nrl_dtensor.moe import METRIC_REDUCTIONS, RouterStatistics, is_moe_model

        # A mixture of experts: router statistics of the training forwards, logged per step.
        moe = is_moe_model(self.model)
        self.router_stats = RouterStatistics(self.model) if moe else None
        self.metric_reductions = dict(METRIC_REDUCTIONS) if moe else {}
        """How the extra metrics of :meth:`optimizer_step` combine over ranks (read by the
        core's training step)."""
        self.router_replay = self._router_replay(moe)
        """The engine's routing handed to the routers (a MoE model whose run records routing:
        replayed with ``policy.moe.router_replay``, else only compared), or None."""
        # The frozen reference (KL penalties, DPO), built on first use.
        self.reference = LazyReference(
            lambda path: self._build_model(path, trainable=False), self.model_path
        )

        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._build_optimizer(params)
        schedule = self.policy.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_scale(step, schedule)
        )

        self.logprob_temperature = logprob_temperature(context.config)
        self._generator = None
        self._gradient_all_reduce = None  # replicated weights: built on the first step

    def _router_replay(self, moe: bool):
        """:func:`nrl_dtensor.moe.replay_routers` when the run records routing; refuses replay
        for a model without experts (the CLI refuses it before starting for models it can
        read)."""
        settings = getattr(self.policy, "moe", None)
        if settings is None or not settings.records_routing:
            return None
        if not moe:
            if settings.router_replay:
                raise DTensorSetupError(
                    f"policy.moe.router_replay=true needs a mixture-of-experts model, and "
                    f"{self.policy.model_name} has no experts; set policy.moe.router_replay=false"
                )
            return None
        from nrl_dtensor.moe import replay_routers

        return replay_routers(self.model, replay=settings.router_replay)

    def _engine_routing(self, micro_batch: Batch | PackedSequences, *, count: bool):
        """Route this forward as the engine did (replay) and measure the agreement (``count``:
        the training forward of a real micro batch); a no-op without the engine's routing."""
        if self.router_replay is None:
            return contextlib.nullcontext()
        from nrl_core.moe import ROUTED_EXPERTS, ROUTING_WEIGHTS
        from nrl_core.training import is_filler

        if isinstance(micro_batch, PackedSequences):
            routed, weights = micro_batch.routed_experts, micro_batch.routing_weights
        else:
            routed, weights = micro_batch.get(ROUTED_EXPERTS), micro_batch.get(ROUTING_WEIGHTS)
        return self.router_replay.using(routed, weights, count=count and not is_filler(micro_batch))

    @property
    def supports_sequence_packing(self) -> bool:
        """Whether micro batches may come packed (:mod:`nrl_core.packing`): causal LMs take
        them (see :mod:`nrl_dtensor.packing`) unless a layer cannot keep the samples of a row
        apart (:func:`nrl_dtensor.packing.packing_refusal`); a scalar head pools by row and
        does not."""
        from nrl_dtensor.packing import packing_refusal

        if self.scalar_head:
            return False
        return packing_refusal(self.model, self.device_type, self.dtype) is None

    # -- setup ----------------------------------------------------------------------------------

    def _init_distributed(self) -> None:
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.distributed = "WORLD_SIZE" in os.environ or (
            dist.is_available() and dist.is_initialized()
        )
        if self.device_type == "cuda":
            from nrl_core.distributed.devices import select_cuda_device

            # Ray shows each rank only its own GPU(s): its local rank is no device index.
            self.device = select_cuda_device()
        else:
            self.device = torch.device("cpu")
        if self.distributed and not dist.is_initialized():
            dist.init_process_group(self._backend())
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1

    def _backend(self) -> str:
        """The process group's backend: NCCL on GPUs, gloo on CPU; with ``cpu_offload`` on GPUs
        both, by device. FSDP2 keeps offloaded shards as pinned CPU tensors, and gradient
        clipping (``full_tensor()`` of the norm) and ``state_dict_buckets`` (``full_tensor()``
        of each shard) run collectives on them, which NCCL refuses ("No backend type
        associated with device type cpu")."""
        if self.device_type != "cuda":
            return "gloo"
        return "cpu:gloo,cuda:nccl" if self.options.cpu_offload else "nccl"

    @property
    def fsdp_units(self) -> str:
        """``policy.dtensor.fsdp_units`` with ``auto`` resolved for this device."""
        if self.options.fsdp_units == "auto":
            # A CPU has no separate stream to overlap a block's collective with compute.
            return "model" if self.device_type == "cpu" else "blocks"
        return self.options.fsdp_units

    def _init_meshes(self) -> None:
        tp = self.options.tensor_parallel_size
        if tp < 1 or self.world_size % tp:
            raise DTensorSetupError(
                f"policy.dtensor.tensor_parallel_size={tp} must divide the {self.world_size} "
                "policy ranks; set it to a divisor of policy.num_workers"
            )
        self.tp_size = tp
        self.dp_size = self.world_size // tp
        self.dp_mesh = self.tp_mesh = None
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                self.device_type, (self.dp_size, tp), mesh_dim_names=("dp", "tp")
            )
            self.dp_mesh, self.tp_mesh = mesh["dp"], mesh["tp"]
            self.dp_rank = self.dp_mesh.get_local_rank()
        else:
            self.dp_rank = 0

    def _build_optimizer(self, params):
        opt = self.policy.optimizer
        if opt.name == "adamw":
            return torch.optim.AdamW(
                params,
                lr=opt.lr,
                betas=tuple(opt.betas),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                # One fused kernel over all parameters instead of a loop of small ops per
                # parameter (torch's default on CPU, and for DTensor parameters).
                fused=self.device_type in ("cpu", "cuda"),
            )
        if opt.name == "sgd":
            return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
        raise DTensorSetupError(
            f"policy.optimizer.name={opt.name!r} is not supported; use `adamw` or `sgd`"
        )

    # -- helpers -------------------------------------------------------------------------------

    def _autocast(self):
        # FSDP casts through its MixedPrecisionPolicy; unsharded float32 weights need autocast.
        if self.sharded or self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    # -- logprobs --------------------------------------------------------------------------------

    def _inputs(self, micro_batch: Batch | PackedSequences) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for a padded micro batch or a packed one."""
        if isinstance(micro_batch, PackedSequences):
            from nrl_dtensor.packing import model_inputs

            return model_inputs(micro_batch.to(self.device))
        return {"input_ids": micro_batch["input_ids"].to(self.device)}

    def _next_token_logits(
        self, model, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, int | None]:
        """``[B, T - 1, V]`` float32 next-token logits divided by the logprob temperature (packed
        inputs: ``[1, total - 1, V]``, position ``p`` predicting token ``p + 1`` of the row),
        and None; under a vocabulary-parallel ``lm_head`` (tensor parallelism, review m10) this
        rank's ``[.., V / tp]`` slice and the slice's first vocabulary id instead."""
        from nrl_dtensor.packing import packed_forward

        packed = "cu_seq_lens_q" in inputs
        with self._autocast(), packed_forward() if packed else contextlib.nullcontext():
            logits = model(**inputs, use_cache=False).logits
        vocab_start = None
        if hasattr(logits, "to_local"):
            from nrl_dtensor.vocab_parallel import vocab_slice

            vocab_start, stop = vocab_slice(
                logits.shape[-1], self.tp_mesh.get_local_rank(), self.tp_size
            )
            logits = logits.to_local()
            assert logits.shape[-1] == stop - vocab_start, "unexpected vocabulary shard"
        logits = logits[:, :-1].float()
        if self.logprob_temperature != 1.0:
            logits = logits / self.logprob_temperature
        return logits, vocab_start

    def _logprobs(
        self, model, inputs: dict[str, torch.Tensor], at: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` logprobs of ``inputs["input_ids"]`` (position 0 is 0), with the graph if
        enabled; with ``at`` (``[B, T, K]`` ids), also ``[B, T, K]`` logprobs of those ids.
        Packed inputs give ``[1, total]`` (``[1, total, K]``) in the packed layout.

        With a scalar head: the per-token values ``[B, T]`` instead (value ``t`` scores the
        prefix ending at token ``t``; see :mod:`nrl_core.reward_model`)."""
        input_ids = inputs["input_ids"]
        if self.scalar_head:
            from nrl_core.reward_model import token_values

            with self._autocast():
                return token_values(model, input_ids)
        logits, vocab_start = self._next_token_logits(model, inputs)
        if vocab_start is None:
            log_probs = torch.log_softmax(logits, dim=-1)

            def logprobs_at(ids: torch.Tensor) -> torch.Tensor:
                return log_probs.gather(-1, ids)
        else:
            from nrl_dtensor.vocab_parallel import logprobs_of

            group = self.tp_mesh.get_group()

            def logprobs_at(ids: torch.Tensor) -> torch.Tensor:
                return logprobs_of(logits, ids, vocab_start, group)

        token_lp = torch.nn.functional.pad(logprobs_at(input_ids[:, 1:, None]).squeeze(-1), (1, 0))
        if at is None:
            return token_lp
        at_lp = logprobs_at(at[:, 1:].to(self.device))
        return token_lp, torch.nn.functional.pad(at_lp, (0, 0, 1, 0))

    def compute_logprobs(
        self, micro_batch: Batch | PackedSequences, *, reference: bool = False
    ) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` of one micro batch without a graph, under the current
        weights or the frozen reference (see :class:`nrl_core.interfaces.PolicyWorker`);
        ``[1, total]`` for packed sequences."""
        model = self.reference.model() if reference else self.model
        model.eval()
        # The reference has hooks of its own: it routes with its own choice.
        replay = (
            contextlib.nullcontext()
            if reference
            else self._engine_routing(micro_batch, count=False)
        )
        with torch.no_grad(), replay:
            return self._logprobs(model, self._inputs(micro_batch))

    def compute_topk_logprobs(
        self, micro_batch: Batch | PackedSequences, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A distillation teacher's scores of one micro batch under the current weights: the
        tokens' logprobs ``[B, T]`` and the logprobs and ids ``[B, T, k']`` of the
        ``k' = min(k, vocabulary)`` most likely tokens at each position (position 0 holds 0);
        ``[1, total]`` and ``[1, total, k']`` for packed sequences."""
        self.model.eval()
        inputs = self._inputs(micro_batch)
        input_ids = inputs["input_ids"]
        with torch.no_grad():
            logits, vocab_start = self._next_token_logits(self.model, inputs)
            if vocab_start is None:
                log_probs = torch.log_softmax(logits, dim=-1)
                token_lp = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
                values, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
            else:
                from nrl_dtensor.vocab_parallel import vocab_parallel_topk

                token_lp, values, ids = vocab_parallel_topk(
                    logits, input_ids[:, 1:], k, vocab_start, self.tp_mesh.get_group()
                )
        return (
            torch.nn.functional.pad(token_lp, (1, 0)),
            torch.nn.functional.pad(values, (0, 0, 1, 0)),
            torch.nn.functional.pad(ids, (0, 0, 1, 0)),
        )

    def set_reference(self, model_path: str) -> None:
        """Use the Hugging Face folder ``model_path`` as the frozen reference."""
        self.reference.set_path(model_path)

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self, micro_batch: Batch | PackedSequences, loss: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Training forward of one micro batch (padded or packed), ``loss`` on its logprobs,
        backward (with the logprobs at the closure's ``logprobs_at_ids`` too when the loss asks
        for them)."""
        self.model.train()
        inputs = self._inputs(micro_batch)
        at = getattr(loss, "logprobs_at_ids", None)
        with self._router_statistics(micro_batch), self._engine_routing(micro_batch, count=True):
            out = self._logprobs(self.model, inputs, at)
        (loss(out) if at is None else loss(*out)).backward()

    def _router_statistics(self, micro_batch: Batch | PackedSequences):
        """Count the routing of this forward (MoE models; a no-op otherwise): real tokens only,
        padding excluded (a packed micro batch has none)."""
        if self.router_stats is None:
            return contextlib.nullcontext()
        return self.router_stats.collecting(micro_batch)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, zero the gradients; returns
        ``grad_norm`` (before clipping) and ``lr`` (the rate this step used), and for a mixture
        of experts this rank's router statistics of the step (``moe/*``, see
        :data:`nrl_dtensor.moe.METRIC_REDUCTIONS`)."""
        if not any(
            p.grad is not None for group in self.optimizer.param_groups for p in group["params"]
        ):
            # A backward whose gradients never reached the (sharded) parameters the optimizer
            # holds: stepping would train nothing and say nothing. FSDP2 reduces a unit's
            # gradients from hooks on its forward's output, so a loss computed from anything
            # else (a captured intermediate) never reaches them.
            raise NrlError(
                "the training step produced no gradient for the optimizer's parameters; the "
                "loss must be computed from the model's forward output"
            )
        if self.distributed and not self.sharded:
            self._average_replica_gradients()
        grad_norm = self._clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        # else: a NaN or infinite gradient is never applied (the norm is global, so every rank
        # skips together); the driver sees grad_norm and stops the run (issue 40).
        self.optimizer.zero_grad(set_to_none=True)
        routing = self.router_stats.metrics() if self.router_stats is not None else {}
        if self.router_replay is not None:
            routing.update(self.router_replay.metrics())
        return {"grad_norm": grad_norm, "lr": lr, **routing}

    def _average_replica_gradients(self) -> None:
        """Replicated weights: average every gradient over the data-parallel ranks in one
        all-reduce of all of them, flattened (what FSDP2 does for sharded ones: the sum over
        ranks divided by their number).

        A parameter without a gradient here counts as zeros, so that every rank sends the same
        layout, and keeps no gradient when no rank had one (one presence flag per parameter
        travels in the same buffer)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        pieces = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params
        ]
        # Beside the gradients (on the GPU with NCCL): one buffer, one device.
        presence = torch.tensor(
            [p.grad is not None for p in params], dtype=pieces[0].dtype, device=pieces[0].device
        )
        if self._gradient_all_reduce is None:
            from nrl_core.distributed.host_all_reduce import HostAllReduce

            # Through shared memory between CPU ranks on one host (gloo's TCP loopback takes
            # twice as long or more: benchmarks/host_all_reduce.py); dist.all_reduce otherwise.
            self._gradient_all_reduce = HostAllReduce(self.dp_mesh.get_group())
        # The average; a presence flag averages to a fraction, which is nonzero when any rank
        # had the gradient.
        flat = self._gradient_all_reduce.sum_coalesced([*pieces, presence], divide_by=self.dp_size)
        grads, has_grad = flat[: -len(params)], flat[-len(params) :].tolist()
        pieces = grads.split([p.numel() for p in params])
        for param, grad, present in zip(params, pieces, has_grad, strict=True):
            param.grad = grad.view_as(param) if present else None

    def _clip_gradients(self) -> float:
        """Clip to ``policy.max_grad_norm`` (0 disables); return the norm before clipping."""
        # With tensor parallelism, gradients live on two meshes (dp for replicated weights,
        # dp x tp for sharded ones); DTensor ops cannot mix meshes, so norms and clipping are
        # taken per mesh, each mesh's norm made a plain tensor before combining.
        by_mesh: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
        for param in self.model.parameters():
            if param.grad is not None:
                by_mesh[getattr(param.grad, "device_mesh", None)].append(param)
        squares = 0.0
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            squares += float(norm) ** 2
        total = torch.tensor(squares**0.5)
        if self.policy.max_grad_norm > 0:
            for params in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(params, self.policy.max_grad_norm, total)
        return float(total)

    # -- checkpoints and export ------------------------------------------------------------------

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device_type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        if self._generator is not None:
            state["generation"] = self._generator._default_rng.get_state()
        return state

    def _set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and self.device_type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if "generation" in state:
            self._get_generator()._default_rng.set_state(state["generation"])

    def save_checkpoint(self, path: str) -> None:
        """Save model and optimizer (``torch.distributed.checkpoint``, sharded) plus this rank's
        scheduler and RNG states under ``path``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        Path(path).mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        torch.save(
            {"scheduler": self.scheduler.state_dict(), "rng": self._rng_state()},
            Path(path) / f"extra_rank{self.rank}.pt",
        )
        self._barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same world size for the RNG states).

        Nothing in the folder can run code: DCP's own ``.metadata`` read is a plain
        ``pickle.load``, so the load goes through :func:`nrl_core.safe_pickle.dcp_load`."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from nrl_core.safe_pickle import dcp_load

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp_load(state, path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        extra_file = Path(path) / f"extra_rank{self.rank}.pt"
        if not extra_file.exists():
            extra_file = Path(path) / "extra_rank0.pt"
        # weights_only: a checkpoint is data; unpickling arbitrary objects from it could run
        # code (the scheduler and RNG states are tensors, numbers, tuples and dicts). A refused
        # file is one line naming it (torch_load_data), not torch's multi-line message.
        from nrl_core.safe_pickle import torch_load_data

        extra = torch_load_data(extra_file)
        self.scheduler.load_state_dict(extra["scheduler"])
        self._set_rng_state(extra["rng"])
        self._barrier()

    # -- colocated engines: hand the GPU memory over -------------------------------------------

    def offload(self, what: list[str]) -> None:
        """Move ``"optimizer"`` state and/or ``"weights"`` (the policy and, if built, the
        reference model) to CPU memory and empty the CUDA cache, for generation engines
        colocated on this GPU; :meth:`onload` brings them back. No-op on CPU, and for the
        weights when ``cpu_offload`` already keeps them in host memory."""
        if self.device_type != "cuda":
            return
        if "optimizer" in what:
            move_optimizer_state(self.optimizer, "cpu")
        if "weights" in what and not self.options.cpu_offload:
            from nrl_dtensor.fsdp import fsdp_modules

            for model in self._models():
                # Weights a forward left gathered (the root unit keeps them) go first.
                for module in fsdp_modules(model):
                    module.reshard()
                model.to("cpu")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back to the GPU what :meth:`offload` moved (moving what is already there is a
        no-op). The optimizer state goes where its parameters are: the GPU, or the host with
        ``cpu_offload`` (fused AdamW refuses state on another device than its parameter)."""
        if self.device_type != "cuda":
            return
        if not self.options.cpu_offload:
            for model in self._models():
                model.to(self.device)
        move_optimizer_state(self.optimizer)
        torch.cuda.synchronize(self.device)

    def _models(self) -> list:
        built = self.reference.built  # never built here: offloading must not load a model
        return [self.model] if built is None else [self.model, built]

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def export_hf(self, path: str) -> None:
        """Write ``model.safetensors``, ``config.json`` and the tokenizer to ``path`` (rank 0
        writes; all ranks take part in gathering the weights)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from nrl_core.hf_export import write_hf_folder

        if self.sharded:
            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if self.rank == 0:
            if self.options.lora_rank > 0:
                state = self._merged_lora_state(state)
            # Other readers of the folder (vLLM, SGLang, Megatron converters) expect the
            # published layout, not transformers' in-memory one (nrl_core.weight_sync.layout).
            state = dict(in_layout(state.items(), CHECKPOINT, self._architecture()))
            write_hf_folder(path, state, self.hf_config, self.tokenizer, self.dtype)
        self._barrier()

    def _architecture(self):
        """The transformers model whose load-time weight conversions the state dict went
        through (the base model under LoRA)."""
        return self.model.get_base_model() if self.options.lora_rank > 0 else self.model

    def _merged_lora_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The plain model's state dict with the LoRA updates merged into the base weights."""
        model = self._apply_lora(self._load_hf_model(self.model_path))
        model.load_state_dict(state)
        merged = model.merge_and_unload()
        return {k: v.detach().cpu() for k, v in merged.state_dict().items()}

    def state_dict_buckets(
        self, bucket_bytes: int, layout: str = IN_MEMORY, lora_weights: str = "merged"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the full, unsharded state dict (Hugging Face names, on this rank's device) in
        buckets of at most ``bucket_bytes`` (a single larger tensor gets a bucket of its own),
        in the weight ``layout`` an engine loads (``in_memory``: transformers' ``state_dict()``;
        ``checkpoint``: the published files' tensors, see :mod:`nrl_core.weight_sync.layout`).
        Under LoRA the names are the plain model's, and ``lora_weights`` says whether the
        adapters are merged into the base weights (``merged``) or left out (``base``).

        A collective: iterate it to the end on all ranks together; every rank gets every tensor.
        """
        from nrl_core.weight_sync import iter_buckets

        def full_tensors():
            with torch.no_grad():
                for name, tensor in self.model.state_dict().items():
                    yield name, _full(tensor).detach()

        named = full_tensors()
        if self.options.lora_rank > 0:
            named = self._lora_free(named, merge=lora_weights == "merged")
        named = in_layout(named, layout, self._architecture())
        yield from iter_buckets(named, bucket_bytes)

    def _lora_free(self, named, *, merge: bool):
        """The peft model's ``(name, tensor)`` stream as the plain model's: PEFT's prefix and
        ``base_layer`` dropped, the adapter tensors left out, and with ``merge`` each adapted
        weight plus its update ``B @ A * alpha / r`` (computed from the full adapter tensors,
        gathered in the same order on every rank)."""
        layers = {
            name: module
            for name, module in self.model.get_base_model().named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")
        }
        for name, tensor in named:
            if ".lora_" in name:
                continue
            name = name.removeprefix("base_model.model.")
            if ".base_layer." in name:
                module_name, _, leaf = name.partition(".base_layer.")
                name = f"{module_name}.{leaf}"
                layer = layers.get(module_name)
                if merge and leaf == "weight" and layer is not None:
                    tensor = tensor + _lora_delta(layer).to(tensor.dtype)
            yield name, tensor

    def lora_adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter tensors, full and in PEFT's saved names
        (``base_model.model.<module>.lora_A.weight``), with the modules trained whole beside
        them (a scalar head's ``score``: PEFT's ``modules_to_save``). A collective under
        sharding."""
        from peft import get_peft_model_state_dict

        with torch.no_grad():
            full = {
                name: _full(tensor).detach()
                for name, tensor in self.model.state_dict().items()
                if ".lora_" in name or ".modules_to_save." in name
            }
        return get_peft_model_state_dict(self.model, state_dict=full)

    def lora_adapter(self, version: int):
        """This policy's :class:`~nrl_core.weight_sync.adapters.LoraAdapter` at ``version``."""
        from nrl_core.weight_sync.adapters import LoraAdapter

        peft_config = self.model.peft_config["default"]
        targets = peft_config.target_modules
        targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
        task_type = peft_config.task_type
        return LoraAdapter(
            rank=int(peft_config.r),
            alpha=float(peft_config.lora_alpha),
            target_modules=targets,
            version=version,
            task_type=str(getattr(task_type, "value", task_type)),
            modules_to_save=tuple(sorted(peft_config.modules_to_save or ())),
        )

    def push_weights(self, sender, bucket_bytes: int):
        """Send the full state dict to generation engines through ``sender`` (a
        :class:`nrl_core.weight_sync.WeightSender`). A collective: call on all ranks (a Ray
        actor method cannot return :meth:`state_dict_buckets`' generator, so it is consumed
        here). Rank 0 returns the :class:`~nrl_core.weight_sync.RefitStats`, others None."""

        from nrl_core.weight_sync import push_from_rank

        buckets = self.state_dict_buckets(
            bucket_bytes, layout=sender.layout, lora_weights=sender.lora_weights
        )
        return push_from_rank(sender, buckets, rank=self.rank)

    def push_adapters(self, sender, version: int):
        """Send only the LoRA adapter (tensors and settings, at ``version``) to generation
        engines through ``sender`` (adapter refits, ``generation.lora_refit=adapters``). A
        collective: call on all ranks. Rank 0 returns the
        :class:`~nrl_core.weight_sync.RefitStats`, others None."""
        if self.options.lora_rank <= 0:
            raise DTensorSetupError(
                "an adapter refit needs a LoRA policy (policy.dtensor.lora_rank > 0)"
            )
        tensors = self.lora_adapter_tensors()
        if self.rank != 0:
            return None
        return sender.send_adapter(tensors, self.lora_adapter(version))

    def init_weight_sync_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the NCCL refit group with the engines (rank 0 only sends; other ranks skip)."""
        from nrl_core.weight_sync import init_nccl_group

        if self.rank == 0:
            init_nccl_group(name, master_addr, master_port, rank_offset, world_size, self.device)

    # -- generation ------------------------------------------------------------------------------

    def _get_generator(self):
        if self._generator is None:
            from nrl_dtensor.generation import TorchGenerator

            generation = getattr(self.context.config, "generation", None)
            options = generation.options_for("torch") if generation is not None else None
            self._generator = TorchGenerator(
                options or TorchGenerationConfig(),
                self.context,
                model=self.model,
                tokenizer=self.tokenizer,
                device=self.device,
                # Replicas generate alone; sharded ranks gather weights together.
                synchronize=bool(self.sharded),
                seed_offset=self.dp_rank,
                # Block units are freed after each forward; the root keeps its weights.
                fsdp_reshard_after_forward=self.fsdp_units == "blocks",
            )
        return self._generator

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Colocated generation from the policy's own (sharded) weights; see
        :class:`nrl_dtensor.generation.TorchGenerator`. Call on all ranks together, each with
        its shard of prompts (shards may differ in size; tensor-parallel peers need equal ones)."""
        with self._autocast():
            return self._get_generator().generate(prompts, params, stop_strings)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a (possibly) sharded one (a collective for a DTensor)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _lora_delta(layer) -> torch.Tensor:
    """A peft LoRA linear layer's update ``B @ A * scaling`` of its base weight (adapter
    ``default``), from the full adapter tensors."""
    a = _full(layer.lora_A["default"].weight)
    b = _full(layer.lora_B["default"].weight)
    return (b @ a) * layer.scaling["default"]
