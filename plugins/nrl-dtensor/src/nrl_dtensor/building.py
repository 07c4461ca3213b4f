"""How the dtensor policy worker builds its models (the policy and the frozen reference): one
read of the Hugging Face checkpoint per group, LoRA, tensor parallelism and FSDP2 sharding.

Loading (GPU review 3, M1): with ``torch.distributed``, the reading rank
(:data:`READER`, rank 0) loads the checkpoint in its own dtype (``dtype="auto"``); every rank,
the reader included, builds the model without weights (on the ``meta`` device), shards it
(tensor parallel, FSDP2) or keeps it whole (replicas), allocates only its own shards, and fills
them from the reader's tensors streamed one by one (:mod:`nrl_core.distributed.read_once`),
each cast to float32 shard by shard. Non-persistent buffers (rotary ``inv_freq``) travel in the
same stream, so they are real on every rank; a fresh reward head is drawn on the reader once.
Peak host memory: the reader holds the checkpoint in its dtype plus its shards; every other
rank its shards plus one tensor. LoRA adapters wrap whole weights, so with ``lora_rank > 0``
each rank fills a whole float32 model (still one disk read) before LoRA and sharding; under
tensor parallelism the adapters are split like the weights they adapt
(:mod:`nrl_dtensor.lora`).

Without ``torch.distributed`` the single process loads the checkpoint in float32 directly.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from nrl_core.errors import NrlError

READER = 0
"""The rank that reads the checkpoint from disk: rank 0 of the policy's group (one read per
group: on one node, one per host; see :mod:`nrl_core.distributed.read_once`)."""


class DTensorSetupError(NrlError):
    """The dtensor policy's options do not fit the model or the cluster."""


def _streamed_tensors(model) -> dict[str, torch.Tensor]:
    """What the reader sends: the state dict plus the non-persistent buffers (rotary
    frequencies), which a model built on ``meta`` would otherwise lack."""
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, buffer)
    return tensors


class ModelBuilding:
    """Mixin of :class:`nrl_dtensor.worker.DTensorPolicyWorker`: building and loading models.
    Uses the worker's ``options``, ``scalar_head``, ``value_head``, ``tokenizer``, ``context``, ``device``,
    ``device_type``, ``distributed``, ``rank``, ``world_size``, ``tp_size``, meshes and
    ``sharded``."""

    def _resolve_sharding(self, model) -> bool:
        """``policy.dtensor.data_parallel`` for this model: whether to shard it with FSDP2."""
        mode = self.options.data_parallel
        if mode != "auto":
            return mode == "shard"
        if self.device_type != "cpu" or self.tp_size > 1 or self.options.cpu_offload:
            return True
        # AdamW: float32 weights, gradients and two moments, one copy per rank on this host.
        need = 16 * sum(p.numel() for p in model.parameters()) * self.world_size
        from nrl_core.distributed.host_all_reduce import all_ranks_agree

        # Every rank must take the same decision, whatever its host's memory.
        return not all_ranks_agree(need <= self._host_memory_bytes() // 2)

    @staticmethod
    def _host_memory_bytes() -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _load_hf_model(self, path: str, dtype: torch.dtype | str = torch.float32):
        """Read the checkpoint at ``path`` from disk (``dtype="auto"``: in its own dtype)."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        if not self.scalar_head:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, output_loading_info=True
        )
        self._set_pad_token(model.config)
        if any(key.startswith("score.") for key in info["missing_keys"]):
            # A fresh head, identical on every rank (ranks seed torch differently), scaled so
            # initial scores are O(1); drawn in float32 whatever the checkpoint's dtype.
            generator = torch.Generator().manual_seed(self.context.seed)
            weight = model.score.weight
            hidden = weight.shape[1]
            fresh = torch.empty(weight.shape).normal_(
                0.0, 1.0 / (hidden + 1) ** 0.5, generator=generator
            )
            if getattr(self, "value_head", False):
                # A PPO critic starts at V = 0: no opinion rather than O(1) noise, which the
                # first advantages would otherwise carry.
                fresh.zero_()
            with torch.no_grad():
                weight.copy_(fresh)
        return model

    def _set_pad_token(self, config) -> None:
        if config.pad_token_id is None:
            # The head's own pooling refuses batches without a pad id; we pool by length anyway.
            config.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id

    def _empty_model(self, path: str):
        """The checkpoint's model in float32 on the ``meta`` device: no memory, no disk read
        beyond ``config.json``."""
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
        )

        if not self.scalar_head:
            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        config = AutoConfig.from_pretrained(path, num_labels=1)
        self._set_pad_token(config)
        with torch.device("meta"):
            return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)

    def _fill(self, model, source, device, whole: bool) -> None:
        """Allocate ``model``'s (local shards of) parameters and buffers on ``device`` and fill
        them from the reader's ``source`` model (None on other ranks). ``whole``: no DTensor
        sharding, so tied weights must be tied again (``to_empty`` unties them; FSDP2 keeps
        them)."""
        from nrl_core.distributed.read_once import broadcast_named_tensors, load_stream_into

        model.to_empty(device=device)
        if whole and getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        # NCCL broadcasts device tensors; gloo host ones.
        wire = self.device if self.device_type == "cuda" else torch.device("cpu")
        stream = broadcast_named_tensors(
            _streamed_tensors(source) if source is not None else None, src=READER, device=wire
        )
        report = load_stream_into(targets, stream)
        if report.missing:
            raise DTensorSetupError(
                f"the checkpoint read on rank {READER} has no tensor for "
                f"{sorted(report.missing)[:5]} of the model built from its config.json; check "
                "that policy.model_name is a complete Hugging Face checkpoint"
            )

    def _apply_lora(self, model):
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            # Normally found by the driver's preflight before any worker starts; this is for
            # an interpreter that lost it since. The fix is where this actor runs, not here.
            raise DTensorSetupError(
                f"policy.dtensor.lora_rank={self.options.lora_rank} needs `peft`, which this "
                f"policy actor's interpreter ({sys.executable}) lacks; install "
                "'nrl-dtensor[lora]' into it, or set policy.actor_env=system to run the policy "
                "in the driver's environment"
            ) from None
        targets = self.options.lora_target_modules
        config = LoraConfig(
            r=self.options.lora_rank,
            lora_alpha=self.options.lora_alpha,
            lora_dropout=self.options.lora_dropout,
            target_modules="all-linear" if targets == ["all-linear"] else list(targets),
            task_type="SEQ_CLS" if self.scalar_head else "CAUSAL_LM",
        )
        # The new adapters are drawn from the run's seed, not from this rank's stream: every
        # rank, and every layout (replicas, FSDP2 shards, tensor-parallel peers, one process),
        # starts from the same adapters.
        devices = [self.device] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.context.seed)
            return get_peft_model(model, config)

    def _build_model(self, path: str, trainable: bool):
        if self.distributed:
            # One read per group; everyone builds the model empty (see the module docstring).
            source = self._load_hf_model(path, dtype="auto") if self.rank == READER else None
            model, filled = self._empty_model(path), False
        else:
            source, model, filled = None, self._load_hf_model(path), True
        model.config.use_cache = False
        # Exported folders name the class they were trained as (a reward model's config
        # inherits `LlamaForCausalLM` from its base otherwise).
        model.config.architectures = [type(model).__name__]
        if not self.scalar_head:
            from nrl_dtensor.packing import install, packing_refusal

            # Packed micro batches attend within each sample; other calls are unchanged. A
            # model that cannot pack (a Gated DeltaNet, sinks, chunks) keeps its attention.
            if packing_refusal(model, self.device_type, self.dtype) is None:
                install(model)
        if trainable and self.options.lora_rank > 0:
            if not filled:
                self._fill(model, source, self.device, whole=True)
                filled = True
            model = self._apply_lora(model)
        if trainable and self.options.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if not trainable:
            model.requires_grad_(False)
        if not self.distributed:
            self.sharded = False
            return model.to(self.device).train(trainable)
        if self.sharded is None:
            self.sharded = self._resolve_sharding(model)
        if not self.sharded:
            if not filled:
                self._fill(model, source, self.device, whole=True)
            model.to(self.device)
            if trainable:
                self._broadcast_from_rank0(model)
            return model.train(trainable)
        if self.tp_size > 1:
            self._apply_tensor_parallel(model)
        self._apply_fsdp(model)
        if not filled:
            # FSDP2 keeps offloaded shards in host memory.
            offload = self.options.cpu_offload and self.device_type == "cuda"
            self._fill(model, source, "cpu" if offload else self.device, whole=False)
        return model.train(trainable)

    def _broadcast_from_rank0(self, model) -> None:
        """Give every replica rank 0's weights: freshly initialised ones (a new score head, LoRA
        adapters) come from each rank's own random stream."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def _apply_tensor_parallel(self, model) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if self.options.lora_rank > 0:
            # The plan names the transformers model's modules; peft's wrapper holds it.
            model = model.get_base_model()
        config = model.config
        layers = getattr(getattr(model, "model", None), "layers", None)
        from nrl_dtensor.moe import is_moe_model

        if is_moe_model(model):
            # The plan below names dense MLP projections; experts would stay unsharded.
            raise DTensorSetupError(
                "tensor_parallel_size > 1 has no plan for mixture-of-experts layers yet; set "
                "policy.dtensor.tensor_parallel_size=1 (FSDP2 shards the experts)"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if layers is None or heads % self.tp_size or kv_heads % self.tp_size:
            raise DTensorSetupError(
                f"tensor_parallel_size={self.tp_size} needs a Llama/Qwen2-style model whose "
                f"{heads} attention and {kv_heads} key/value heads it divides; lower "
                "policy.dtensor.tensor_parallel_size"
            )
        # Column-parallel in, row-parallel out: one all-reduce per attention and per MLP; the
        # attention reshapes use -1 for the head count, so each rank runs on its local heads.
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        from nrl_dtensor.lora import lora_tensor_parallel_plan

        for layer in layers:
            # LoRA: each adapted projection's base weight and adapter, split to match.
            parallelize_module(layer, self.tp_mesh, lora_tensor_parallel_plan(layer, plan))
        lm_head = getattr(model, "lm_head", None)
        if isinstance(lm_head, torch.nn.Linear) and not getattr(
            config, "tie_word_embeddings", False
        ):
            from torch.distributed.tensor import Shard

            # Vocabulary-parallel logits (review m10): each rank computes [.., V / tp], a
            # DTensor sharded on the vocabulary; the worker's logprobs reduce over the TP group
            # (nrl_dtensor.vocab_parallel), whatever else reads the logits sees whole ones.
            # Tied embeddings keep lm_head whole: the weight is also the (unsharded) embedding.
            parallelize_module(
                model,
                self.tp_mesh,
                {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)},
            )

    def _apply_fsdp(self, model) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": self.dp_mesh}
        if self.dtype != torch.float32:
            # float32 master weights and gradient reduction; compute in the low precision.
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.dtype, reduce_dtype=torch.float32
            )
        if self.options.cpu_offload and self.device_type == "cuda":
            # On CPU-only machines parameters already live in host memory: nothing to offload.
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if self.fsdp_units == "blocks":
            block_names = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in block_names:
                    fully_shard(module, **kwargs)
        # The root unit (the whole model with `model`) keeps its weights gathered from its
        # forward to the end of the backward.
        fully_shard(model, **kwargs)
        if dist.get_backend(self.dp_mesh.get_group()) == "gloo":
            from nrl_dtensor.fsdp import AllReduceScatter, fsdp_modules

            for module in fsdp_modules(model):
                module.set_custom_reduce_scatter(AllReduceScatter())
