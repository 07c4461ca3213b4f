"""Weights out of the megatron policy worker: the whole model gathered over tensor, pipeline
and expert parallelism (export to a Hugging Face folder, refit of generation engines), and the
hand-over of GPU memory to colocated engines (offload/onload). A mixin of
:class:`nrl_megatron.worker.MegatronPolicyWorker`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import torch
import torch.distributed as dist

from nrl_core.weight_sync.layout import CHECKPOINT, IN_MEMORY, hf_skeleton, in_layout
from nrl_megatron.convert import (
    expert_index,
    global_expert_name,
    iter_megatron_to_hf,
    megatron_to_hf_names,
    tp_split_dim,
    unshard_from_tp,
)
from nrl_megatron.errors import MegatronSetupError


class WeightsMixin:
    """Export, refit and offload of :class:`~nrl_megatron.worker.MegatronPolicyWorker`."""

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

    def _full_megatron_tensors(self, lora: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of every Megatron parameter of the whole model, gathered over
        tensor parallelism and pipeline stages (a collective: every rank gets every tensor,
        each exactly once, under its whole-model name). With expert parallelism each local
        expert tensor is gathered over the expert-parallel group and yielded once per expert,
        under its global name: every expert exactly once.

        A stream: each tensor is gathered when the consumer asks for it, and this generator
        keeps no reference to what it yielded, so a consumer that drops each tensor holds one
        at a time (not the whole model, nor, on a pipeline's sending stage, the whole stage).

        ``lora``: the LoRA adapter tensors only (:mod:`nrl_megatron.lora`) instead of the
        model's own (which never include them)."""
        if self.pp_size == 1:
            yield from self._stage_tensors(lora=lora)
            return
        from nrl_megatron.pipeline import layers_per_stage

        per = layers_per_stage(self.shape.num_layers, self.pp_size)
        # Stage by stage: every rank of the pipeline group learns the stage's names, shapes and
        # dtypes (known without gathering anything), then receives each tensor by broadcast as
        # the stage's ranks gather it. A stage sends only its own parameters, so no name
        # arrives twice (NeMo RL's issue #2471).
        for stage in range(self.pp_size):
            source = dist.get_global_rank(self.pp_group, stage)
            sending = stage == self.pp_rank
            header = [self._stage_header(offset=stage * per, lora=lora) if sending else None]
            dist.broadcast_object_list(header, src=source, group=self.pp_group)
            mine = self._stage_tensors(offset=stage * per, lora=lora) if sending else None
            for name, shape, dtype in header[0]:
                if mine is not None:
                    gathered, tensor = next(mine)
                    if gathered != name:  # _stage_header and _stage_tensors disagree: a bug
                        raise RuntimeError(f"stage {stage} gathered {gathered}, announced {name}")
                    dist.broadcast(tensor.contiguous(), src=source, group=self.pp_group)
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.broadcast(tensor, src=source, group=self.pp_group)
                yield name, tensor
                del tensor  # the consumer decides how long it lives
            if mine is not None and next(mine, None) is not None:
                raise RuntimeError(f"stage {stage} gathered more tensors than it announced")

    def _stage_header(
        self, offset: int = 0, lora: bool = False
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of each tensor :meth:`_stage_tensors` yields, in the same
        order, from this rank's shards alone (no collective, nothing gathered)."""
        from nrl_megatron.pipeline import global_name

        header = []
        for name, tensor in self._stage_state(lora):
            shape = tuple(tensor.shape)
            if self.ep_size > 1 and expert_index(name) is not None:
                local = self.shape.num_experts // self.ep_size
                header += [
                    (global_expert_name(name, ep_rank, local), shape, tensor.dtype)
                    for ep_rank in range(self.ep_size)
                ]
                continue
            dim = tp_split_dim(name) if self.tp_size > 1 else None
            if dim is not None:  # unshard_from_tp concatenates the shards along dim
                shape = (*shape[:dim], shape[dim] * self.tp_size, *shape[dim + 1 :])
            header.append((global_name(name, offset), shape, tensor.dtype))
        return header

    def _stage_state(self, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's state-dict tensors: the model's own, or (``lora``) its LoRA adapters."""
        from nrl_megatron.lora import is_lora_name

        for name, tensor in self.module.state_dict().items():
            if name.endswith("_extra_state") or tensor is None or is_lora_name(name) != lora:
                continue
            yield name, tensor

    def _stage_tensors(
        self, offset: int = 0, lora: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's parameters, gathered over tensor parallelism, named with their decoder
        layers shifted by ``offset`` (the stage's first layer in the whole model); one tensor
        gathered per step of the iteration."""
        from nrl_megatron.pipeline import global_name

        with torch.no_grad():
            for name, tensor in self._stage_state(lora):
                if self.ep_size > 1 and expert_index(name) is not None:
                    shards = [torch.empty_like(tensor) for _ in range(self.ep_size)]
                    dist.all_gather(shards, tensor.contiguous(), group=self.ep_group)
                    local = self.shape.num_experts // self.ep_size
                    for ep_rank, shard in enumerate(shards):
                        yield global_expert_name(name, ep_rank, local), shard
                    del shards, shard
                    continue
                if self.tp_size > 1 and tp_split_dim(name) is not None:
                    shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                    dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
                    tensor = unshard_from_tp(name, shards)
                    del shards  # the full tensor is a new one: the shards are not needed
                yield global_name(name, offset), tensor.detach()
                del tensor

    # -- LoRA ------------------------------------------------------------------------------------

    def lora_adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter tensors, full (gathered over tensor and pipeline parallelism) and
        in PEFT's saved names of the Hugging Face model
        (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``): what peft's
        ``set_peft_model_state_dict`` loads into the HF model (:mod:`nrl_megatron.lora` says
        why they are exactly peft's adapters). A collective."""
        from nrl_megatron.lora import peft_name

        self._require_lora("the adapter tensors")
        return {peft_name(name): tensor for name, tensor in self._full_megatron_tensors(lora=True)}

    def lora_adapter(self, version: int):
        """This policy's :class:`~nrl_core.weight_sync.adapters.LoraAdapter` at ``version``."""
        from nrl_core.weight_sync.adapters import LoraAdapter

        self._require_lora("an adapter")
        return LoraAdapter(
            rank=self.options.lora_rank,
            alpha=float(self.options.lora_alpha),
            target_modules=tuple(sorted(self.options.lora_targets())),
            version=version,
        )

    def push_adapters(self, sender, version: int):
        """Send only the LoRA adapter (tensors and settings, at ``version``) to generation
        engines through ``sender`` (adapter refits, ``generation.lora_refit=adapters``). A
        collective: call on all ranks. Rank 0 returns the
        :class:`~nrl_core.weight_sync.RefitStats`, others None."""
        self._require_lora("an adapter refit")
        tensors = self.lora_adapter_tensors()
        if self.rank != 0:
            return None
        return sender.send_adapter(tensors, self.lora_adapter(version))

    def _require_lora(self, what: str) -> None:
        if self.options.lora_rank <= 0:
            raise MegatronSetupError(f"{what} needs a LoRA policy (policy.megatron.lora_rank > 0)")

    def _lora_updates(self) -> dict[str, torch.Tensor]:
        """Hugging Face weight name -> its LoRA update ``B @ A * alpha / r`` (the full
        adapters; empty without LoRA). A collective."""
        if self.options.lora_rank <= 0:
            return {}
        tensors = self.lora_adapter_tensors()
        scaling = self.options.lora_alpha / self.options.lora_rank
        updates = {}
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            # peft's merge (merge_and_unload): W + (B @ A) * scaling.
            updates[f"{module}.weight"] = (b @ a) * scaling
        return updates

    @staticmethod
    def _merged(named, updates: dict[str, torch.Tensor]):
        """``(HF name, tensor)`` pairs with each adapted weight plus its LoRA update."""
        for name, tensor in named:
            update = updates.get(name)
            yield name, tensor if update is None else tensor + update.to(tensor)

    def state_dict_buckets(
        self, bucket_bytes: int, layout: str = IN_MEMORY, lora_weights: str = "merged"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the full state dict in Hugging Face names, in the weight ``layout`` an engine
        loads (``in_memory``: transformers' ``state_dict()`` names, experts stacked;
        ``checkpoint``: the published files', one tensor per expert, see
        :mod:`nrl_core.weight_sync.layout`), in buckets of at most ``bucket_bytes`` (a larger
        tensor gets its own). Under LoRA the names are the plain model's, and ``lora_weights``
        says whether the adapters are merged into the base weights (``merged``) or left out
        (``base``). A collective."""
        from nrl_core.weight_sync import iter_buckets

        self._refuse_value_head_export()
        te = self.options.transformer_engine
        updates = self._lora_updates() if lora_weights == "merged" else {}
        named = iter_megatron_to_hf(self._full_megatron_tensors(), self.shape, te)
        if updates:
            named = self._merged(named, updates)
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

        buckets = self.state_dict_buckets(
            bucket_bytes, layout=sender.layout, lora_weights=sender.lora_weights
        )
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

    def _refuse_value_head_export(self) -> None:
        """A critic's value head has no Hugging Face causal-LM name: exporting it would write
        a model without its LM head (or with none that means anything), so it is refused."""
        if self.value_head:
            raise MegatronSetupError(
                "this megatron model is a PPO critic (a value head, no LM head): Hugging Face "
                "export and weight refit are for the policy; convert the run's policy "
                "checkpoint instead"
            )

    def export_hf(self, path: str) -> None:
        """Write ``model.safetensors``, ``config.json`` and the tokenizer to ``path`` (rank 0
        writes; all ranks take part in gathering the weights).

        Streamed: rank 0 moves each gathered tensor to CPU memory as it arrives (converting and
        writing from there: it holds the model once, in CPU memory, as ``write_hf_folder``
        takes a dict); the other ranks drop each tensor once it is sent, so no rank holds the
        gathered model on its GPU (it is about 61 GB of bfloat16 for Qwen3-30B-A3B)."""
        from nrl_core.hf_export import write_hf_folder

        self._refuse_value_head_export()
        updates = self._lora_updates()  # a collective: before rank 0 goes its own way
        gathered = self._full_megatron_tensors()
        if self.rank != 0:
            for _name, tensor in gathered:  # the gathers and sends are the collective part
                del tensor
            dist.barrier()
            return
        te = self.options.transformer_engine
        on_cpu = ((name, tensor.cpu()) for name, tensor in gathered)
        # vLLM, SGLang and other converters read the published (per-expert) layout.
        named = iter_megatron_to_hf(on_cpu, self.shape, te)
        # Under LoRA the exported model is the merged one (what the policy computes).
        named = self._merged(named, {k: v.cpu() for k, v in updates.items()})
        named = in_layout(named, CHECKPOINT, self._hf_skeleton)
        write_hf_folder(path, dict(named), self.hf_config, self.tokenizer, self.dtype)
        dist.barrier()
