"""The megatron policy worker: a Megatron-Core ``GPTModel`` built from a Hugging Face
Llama/Qwen2 checkpoint, one instance per rank.

Parallelism: ranks are laid out by ``megatron.core.parallel_state`` (tensor-parallel peers are
adjacent ranks). The core shards batches over all ranks, so tensor-parallel peers must receive
the SAME shard: the worker checks this and raises otherwise. Pipeline, context and expert
parallel sizes above 1 are refused for now (see docs/megatron.md).

Optimizer, two paths:

- GPU: Megatron-Core's ``DistributedDataParallel`` plus ``get_megatron_optimizer`` with the
  distributed optimizer (optimizer state sharded over data-parallel ranks, float32 main weights).
- CPU: Megatron-Core's DDP buffers and distributed optimizer allocate on
  ``torch.cuda.current_device()`` and reject non-CUDA tensors, so on CPU the worker uses
  ``torch.optim`` over the Megatron module and averages gradients over the data-parallel group
  itself (gloo all-reduce). The model, its forward and its tensor parallelism are Megatron's.

Loss scaling (the same contract as the dtensor policy): loss functions return micro-batch
losses already divided by the GLOBAL normaliser; micro batch losses are summed, and because
gradients are *averaged* over data-parallel ranks (Megatron DDP's default, and our CPU
all-reduce) each loss is multiplied by the data-parallel size before ``backward``.

Temperature: logprobs are ``log_softmax(logits / T)`` with ``T`` the run's generation
temperature (1 when absent or greedy), computed with Megatron's vocab-parallel cross entropy.

Generation: ``generate`` (colocated, what ``generation.backend=torch`` calls on the policy
workers) samples from this Megatron model itself; see :mod:`nrl_megatron.generation`.

Without ``WORLD_SIZE`` in the environment and no process group, the worker starts a one-rank
gloo (or NCCL) group on a free local port: Megatron-Core always needs ``parallel_state``.
"""

from __future__ import annotations

import os
import random
import socket
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from nrl_core.data import Batch
from nrl_core.errors import NrlError
from nrl_core.interfaces import (
    ComponentContext,
    GenerationOutput,
    GlobalBatchStats,
    LossFunction,
    SamplingParams,
)
from nrl_megatron.config import MegatronConfig
from nrl_megatron.convert import (
    ModelShape,
    hf_to_megatron,
    iter_megatron_to_hf,
    megatron_to_hf_names,
    shard_for_tp,
    tp_split_dim,
    unshard_from_tp,
)


class MegatronSetupError(NrlError):
    """The megatron policy's options do not fit the model, the cluster or this machine."""


_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
        if self.policy.precision not in _PRECISIONS:
            raise MegatronSetupError(
                f"policy.precision={self.policy.precision!r} is not supported; use "
                "`float32` or `bfloat16`"
            )
        self.dtype = _PRECISIONS[self.policy.precision]
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

        from transformers import AutoConfig, AutoTokenizer

        from nrl_core.testing.tiny import resolve_model_name

        self.model_path = resolve_model_name(self.policy.model_name)
        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_name(self.policy.tokenizer_name or self.policy.model_name)
        )
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        for what, count in (
            ("attention", self.shape.num_heads),
            ("key/value", self.shape.num_kv_heads),
        ):
            if count % self.tp_size:
                raise MegatronSetupError(
                    f"tensor_model_parallel_size={self.tp_size} does not divide the {count} "
                    f"{what} heads; lower policy.megatron.tensor_model_parallel_size"
                )
        self.model = self._build_model(trainable=True)
        self.reference_model = None  # built on first use
        self._build_optimizer()
        self.step = 0

        generation = getattr(context.config, "generation", None)
        temperature = getattr(generation, "temperature", 1.0) if generation is not None else 1.0
        self.logprob_temperature = float(temperature) if temperature and temperature > 0 else 1.0
        self._generator = None  # built on the first colocated generate call

    # -- setup ----------------------------------------------------------------------------------

    def _init_distributed(self) -> None:
        if self.on_gpu:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
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
            "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp,
            "expert_model_parallel_size": ep,
        }
        for key, value in unsupported.items():
            if value != 1:
                raise MegatronSetupError(
                    f"policy.megatron.{key}={value} is not implemented yet by the megatron "
                    "policy (see docs/megatron.md); set it to 1"
                )
        if tp < 1 or self.world_size % tp:
            raise MegatronSetupError(
                f"policy.megatron.tensor_model_parallel_size={tp} must divide the "
                f"{self.world_size} policy ranks"
            )
        # A later worker in the same process (tests) reuses matching groups, rebuilds others.
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != tp:
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

    def _build_model(self, trainable: bool):
        from transformers import AutoModelForCausalLM

        from nrl_megatron.model import build_gpt_model, transformer_config

        config = transformer_config(
            self.hf_config,
            tp=self.tp_size,
            dtype=self.dtype,
            on_gpu=self.on_gpu,
        )
        model = build_gpt_model(
            self.hf_config, config, transformer_engine=self.options.transformer_engine
        )
        # Every rank reads the HF checkpoint and keeps its own slice: simple, and the host copy
        # is freed right after (a rank-0-reads-and-scatters load is a later optimisation).
        hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        full = hf_to_megatron(hf.state_dict(), self.shape, te=self.options.transformer_engine)
        del hf
        own = model.state_dict()
        state = {
            name: shard_for_tp(name, tensor, self.tp_rank, self.tp_size).to(own[name].dtype)
            for name, tensor in full.items()
        }
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
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
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
        )
        self.megatron_optimizer = get_megatron_optimizer(optim_config, [self.model])
        self.optimizer = self.megatron_optimizer

    def _lr(self, step: int) -> float:
        warmup = self.policy.optimizer.warmup_steps
        scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return self.policy.optimizer.lr * scale

    # -- logprobs --------------------------------------------------------------------------------

    def _logprobs(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` logprobs of ``input_ids`` (position 0 is 0), with the graph if enabled."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        batch, width = input_ids.shape
        positions = torch.arange(width, device=input_ids.device)[None, :].expand(batch, -1)
        # [B, T, V / tp]: parallel_output=True leaves the vocab dimension sharded.
        logits = model(input_ids, positions, None)
        logits = logits[:, :-1].float() / self.logprob_temperature
        # Megatron's vocab-parallel cross entropy = -log_softmax(logits)[target] across the
        # tensor-parallel vocab shards, without gathering the full logits.
        token_lp = -vocab_parallel_cross_entropy(logits.contiguous(), input_ids[:, 1:].contiguous())
        return torch.nn.functional.pad(token_lp, (1, 0))

    @staticmethod
    def _valid_mask(batch: Batch, width: int) -> torch.Tensor:
        lengths = batch["lengths"] if "lengths" in batch else torch.full((len(batch),), width)
        return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]

    def _check_tp_peers_agree(self, batch: Batch) -> None:
        """Tensor-parallel peers must compute on the same samples (they share activations)."""
        if self.tp_size == 1:
            return
        ids = batch["input_ids"]
        digest = torch.tensor(
            [
                ids.shape[0],
                ids.shape[1],
                int(ids.long().sum()),
                int((ids.long() * 31 % 1009).sum()),
            ],
            dtype=torch.long,
        )
        gathered = [torch.zeros_like(digest) for _ in range(self.tp_size)]
        dist.all_gather(gathered, digest, group=self.tp_group)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise MegatronSetupError(
                "tensor-parallel peers received different batches; the core must give each "
                "tensor-parallel group one data-parallel shard"
            )

    def _global_max(self, value: int) -> int:
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _batched_logprobs(self, model, batch: Batch) -> torch.Tensor:
        self._check_tp_peers_agree(batch)
        width = batch["input_ids"].shape[1]
        chunks = list(batch.micro_batches(max(1, self.policy.logprob_batch_size)))
        steps = self._global_max(len(chunks))
        out = []
        model.eval()
        with torch.no_grad():
            for i in range(steps):
                if i >= len(chunks):
                    # Keep collectives aligned with ranks that have more chunks.
                    self._logprobs(model, torch.zeros((1, 2), dtype=torch.long, device=self.device))
                    continue
                chunk = chunks[i].trimmed()
                lp = self._logprobs(model, chunk["input_ids"].to(self.device)).cpu()
                lp = lp * self._valid_mask(chunk, lp.shape[1])
                out.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
        return torch.cat(out) if out else torch.zeros((0, width))

    def get_logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` under the current weights (position 0 and padding 0)."""
        return self._batched_logprobs(self.model, batch)

    def get_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """The same under the frozen initial weights (converted again from the HF checkpoint on
        first use, sharded like the policy)."""
        if self.reference_model is None:
            self.reference_model = self._build_model(trainable=False)
        return self._batched_logprobs(self.reference_model, batch)

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
            )
        return self._generator.generate(prompts, params, stop_strings)

    # -- training --------------------------------------------------------------------------------

    def train(
        self, batch: Batch, loss_fn: LossFunction, stats: GlobalBatchStats
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns the global (summed) metrics,
        ``loss``, ``grad_norm`` (before clipping) and ``lr`` (the rate this step used)."""
        self._check_tp_peers_agree(batch)
        self.model.train()
        micro_batches = list(batch.micro_batches(max(1, self.policy.train_micro_batch_size)))
        steps = self._global_max(len(micro_batches))
        self._zero_grad()
        metrics: dict[str, float] = defaultdict(float)
        for i in range(steps):
            real = i < len(micro_batches)
            mb = (micro_batches[i] if real else batch.slice(0, 1)).trimmed().to(self.device)
            logprobs = self._logprobs(self.model, mb["input_ids"])
            logprobs = logprobs * self._valid_mask(mb, logprobs.shape[1])
            loss, mb_metrics = loss_fn(logprobs, mb, stats)
            if not real:
                loss = loss * 0.0
            # Gradients are averaged over data-parallel ranks; the loss is already global.
            (loss * self.dp_size).backward()
            if real:
                metrics["loss"] += float(loss.detach())
                for key, value in mb_metrics.items():
                    metrics[key] += float(value)
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.megatron_optimizer is not None:
            self.model.finish_grad_sync()
            _, grad_norm, _ = self.megatron_optimizer.step()
        else:
            self._average_gradients_over_dp()
            grad_norm = self._clip_gradients()
            self.optimizer.step()
        self.step += 1
        self._zero_grad()
        result = self._sum_over_dp(dict(metrics))
        result.update(grad_norm=float(grad_norm), lr=lr)
        return result

    def _zero_grad(self) -> None:
        if self.megatron_optimizer is not None:
            self.model.zero_grad_buffer()
            self.megatron_optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _average_gradients_over_dp(self) -> None:
        if self.dp_size == 1:
            return
        for param in self.model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.dp_group)
                param.grad.div_(self.dp_size)

    def _clip_gradients(self) -> float:
        """Clip to ``policy.max_grad_norm`` (0 disables); return the norm before clipping.

        Tensor-parallel-sharded parameters (Megatron marks them ``tensor_model_parallel``)
        contribute their local squares summed over the TP group; replicated ones count once.
        """
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for param in self.model.parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            square = param.grad.double().pow(2).sum()
            if getattr(param, "tensor_model_parallel", False):
                sharded += square
            else:
                replicated += square
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        total = float(sharded + replicated) ** 0.5
        max_norm = self.policy.max_grad_norm
        if max_norm > 0 and total > max_norm:
            coef = max_norm / (total + 1e-6)
            for grad in grads:
                grad.mul_(coef)
        return total

    def _sum_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return metrics
        gathered: list[dict[str, float]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, metrics)
        total: dict[str, float] = defaultdict(float)
        for rank, rank_metrics in enumerate(gathered):
            # Tensor-parallel peers (adjacent ranks) hold the same shard: count it once.
            if rank % self.tp_size == 0:
                for key, value in rank_metrics.items():
                    total[key] += value
        return dict(total)

    # -- checkpoints -----------------------------------------------------------------------------

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.on_gpu:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def save_checkpoint(self, path: str) -> None:
        """Save this rank's model shard, optimizer, step and RNG states under ``path``.

        One file per rank (``rank{N}.pt``): restoring needs the same parallel layout. (Megatron's
        ``dist_checkpointing`` would allow resharding; not wired yet, see docs/megatron.md.)
        """
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "rng": self._rng_state(),
                "layout": {"tp": self.tp_size, "world_size": self.world_size},
            },
            Path(path) / f"rank{self.rank}.pt",
        )
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same world and tensor-parallel sizes)."""
        state = torch.load(
            Path(path) / f"rank{self.rank}.pt", weights_only=False, map_location="cpu"
        )
        layout = {"tp": self.tp_size, "world_size": self.world_size}
        if state["layout"] != layout:
            raise MegatronSetupError(
                f"checkpoint {path} was written with {state['layout']}, this run has {layout}; "
                "resume with the same policy.num_workers and tensor_model_parallel_size"
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and self.on_gpu:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        dist.barrier()

    # -- export and refit ------------------------------------------------------------------------

    def hf_param_names(self) -> dict[str, list[str]]:
        """Megatron parameter name -> the Hugging Face names it exports to (for engines)."""
        return megatron_to_hf_names(self.shape, te=self.options.transformer_engine)

    def _full_megatron_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of every Megatron parameter, gathered over tensor parallelism
        (a collective: every rank gets every tensor)."""
        with torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                if name.endswith("_extra_state") or tensor is None:
                    continue
                if self.tp_size > 1 and tp_split_dim(name) is not None:
                    shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                    dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
                    tensor = unshard_from_tp(name, shards)
                yield name, tensor.detach()

    def state_dict_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the full state dict in Hugging Face names (the layout engines load), in buckets
        of at most ``bucket_bytes`` (a larger tensor gets its own). A collective."""
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        te = self.options.transformer_engine
        for name, tensor in iter_megatron_to_hf(self._full_megatron_tensors(), self.shape, te):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[name] = tensor
            size += nbytes
        if bucket:
            yield bucket

    def export_hf(self, path: str) -> None:
        """Write ``model.safetensors``, ``config.json`` and the tokenizer to ``path`` (rank 0
        writes; all ranks take part in gathering the weights)."""
        from safetensors.torch import save_file

        te = self.options.transformer_engine
        state = {
            name: tensor.to("cpu", self.dtype).contiguous()
            for name, tensor in iter_megatron_to_hf(self._full_megatron_tensors(), self.shape, te)
        }
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
            config = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
            config.use_cache = True
            config.dtype = self.dtype
            config.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        dist.barrier()
