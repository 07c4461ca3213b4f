"""Forward passes of the megatron policy worker: logprobs (one micro batch, or all of them
through Megatron-Core's pipeline schedule), the training forward/backward, colocated
generation, and the tensor-parallel batch check. A mixin of
:class:`nrl_megatron.worker.MegatronPolicyWorker`, which sets the attributes it reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nrl_core.data import Batch
from nrl_core.interfaces import GenerationOutput, SamplingParams
from nrl_core.packing import PackedSequences
from nrl_megatron.errors import MegatronSetupError


def _input_ids(micro_batch: Batch | PackedSequences) -> torch.Tensor:
    """``[B, T]`` token ids of a padded micro batch, ``[1, total]`` of a packed one."""
    if isinstance(micro_batch, PackedSequences):
        return micro_batch.input_ids
    return micro_batch["input_ids"]


class ForwardMixin:
    """Logprobs, training forward/backward and colocated generation of
    :class:`~nrl_megatron.worker.MegatronPolicyWorker`."""

    @property
    def supports_sequence_packing(self) -> bool:
        """Micro batches may come packed (:mod:`nrl_core.packing`): they run in Megatron's THD
        layout (``PackedSeqParams``), through Transformer Engine's varlen attention or, on the
        local spec, :class:`nrl_megatron.model.SDPAttention`'s per-sample path."""
        return True

    def _logprobs(self, model, micro_batch: Batch | PackedSequences) -> torch.Tensor:
        """``[B, T]`` logprobs of the micro batch's ``input_ids`` (position 0 is 0), with the
        graph if enabled; ``[1, total]`` in the packed layout for packed sequences. A critic's
        (value head): its per-token values instead (:meth:`_token_outputs`)."""
        output, input_ids = self._stage_forward(model, micro_batch)
        return self._token_outputs(output, input_ids)

    def _token_outputs(self, output: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """What the last stage's output gives the core per token: logprobs of ``input_ids``,
        or, with a value head, the float32 values ``[B, T]`` (value ``t`` scores the prefix
        ending at token ``t``, the convention of :func:`nrl_core.reward_model.token_values`;
        nothing is shifted and no temperature applies)."""
        if self.value_head:
            return output[..., 0].float()
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

    def _check_tp_peers_agree(self, *batches: Batch | PackedSequences) -> None:
        """Tensor-parallel peers must compute on the same samples (they share activations).
        Checks all ``batches`` of one call (a step's or a logprob pass's micro batches) with
        one all-gather and one device-to-host read, not one of each per micro batch."""
        if self.tp_size == 1 or not batches:
            return
        values = []
        for batch in batches:
            ids = batch.input_ids if isinstance(batch, PackedSequences) else batch["input_ids"]
            ids = ids.long()  # on the host as the core hands them over: no device sync here
            values += [ids.shape[0], ids.shape[1], int(ids.sum()), int((ids * 31 % 1009).sum())]
        # On the worker's device: Megatron's groups use the default backend, and NCCL has no
        # backend for CPU tensors ("No backend type associated with device type cpu").
        digest = torch.tensor(values, dtype=torch.long, device=self.device)
        gathered = [torch.zeros_like(digest) for _ in range(self.tp_size)]
        dist.all_gather(gathered, digest, group=self.tp_group)
        if bool((torch.stack(gathered) != digest).any()):
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
        return self._compute_logprobs([micro_batch], reference)[0]

    def compute_logprobs_micro_batches(
        self, micro_batches: Sequence[Batch | PackedSequences], *, reference: bool = False
    ) -> list[torch.Tensor]:
        """:meth:`compute_logprobs` of each micro batch, in order (the core's optional
        all-at-once method, :class:`nrl_core.interfaces.PolicyWorker`). Pipeline-parallel: ONE
        forward-only schedule call over all of them, so the stages overlap (with one micro
        batch per call, stage s+1 idles while stage s computes: ``(pp-1)/pp`` of the time)."""
        return self._compute_logprobs(micro_batches, reference)

    def _compute_logprobs(
        self, micro_batches: Sequence[Batch | PackedSequences], reference: bool
    ) -> list[torch.Tensor]:
        self._check_tp_peers_agree(*micro_batches)
        model = self.reference.model() if reference else self.model
        model.eval()
        with torch.no_grad():
            if self.pp_size == 1:
                return [self._logprobs(model, micro_batch) for micro_batch in micro_batches]
            items = [(micro_batch, None) for micro_batch in micro_batches]
            out = self._run_schedule(model, items, forward_only=True)
        if self.last_stage:
            return out
        # Not read (the core takes each shard's result from its last stage), but the same
        # shape as the last stage's, for the packed layout's unpacking.
        return [
            torch.zeros(_input_ids(micro_batch).shape, dtype=torch.float32)
            for micro_batch in micro_batches
        ]

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
                logprobs = self._token_outputs(logits, input_ids)
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
        if self.value_head:
            raise MegatronSetupError(
                "a critic (value head) does not generate; generation.backend=torch generates "
                "with the policy's workers, not the critic's"
            )
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
        self._forward_backward(micro_batch, loss)

    def _forward_backward(
        self, micro_batch: Batch | PackedSequences, loss: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
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
        self._check_tp_peers_agree(*(micro_batch for micro_batch, _ in items))
        if self.pp_size == 1:
            for micro_batch, loss in items:
                self._forward_backward(micro_batch, loss)
            return True
        self.model.train()
        self._run_schedule(self.model, items, forward_only=False)
        return self.last_stage
