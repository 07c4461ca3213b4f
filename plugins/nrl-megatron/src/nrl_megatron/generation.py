"""Colocated generation on the megatron policy's own ``GPTModel`` (``MegatronPolicyWorker.generate``).

Why a generator here rather than reusing ``nrl_dtensor``'s ``TorchGenerator``: the actor venv
built for this plugin (nrl-core + nrl-megatron[engine]) has no nrl-dtensor, and exporting to a
Hugging Face model in-process at every GRPO step would gather the whole model on every rank.
Sampling straight from the Megatron forward also keeps generation logprobs consistent with
``get_logprobs`` by construction (same module, same forward, same temperature scaling).

The loop is KV-cache free: each step runs the full forward over the right-padded
``prompt + generated`` rows that are still going and samples from the logits at each row's last
valid position. Causal attention means right padding never influences a valid position, so no
attention mask is needed (as in training). This costs ``O(T^2)`` per sample, which is fine for
the CPU tests and small runs it exists for; production runs use a separate engine (vLLM/SGLang)
refitted from ``state_dict_buckets``.

Tensor parallelism: the logits are vocab-sharded; the last-position logits are gathered over the
tensor-parallel group, tensor-parallel rank 0 samples and broadcasts the tokens, so peers always
feed identical inputs to the next (collective) forward. Peers hold the same prompts (the core
gives each tensor-parallel group one data-parallel shard), hence finish together. Forwards only
communicate inside a tensor-parallel group, so data-parallel groups need no lockstep, except
under expert parallelism: an MoE layer's token dispatcher is collective over the
expert-parallel group, whose ranks hold different prompts. There the ranks run in lockstep
(``lockstep_group``): as many chunks and forwards as the busiest rank, a rank with nothing left
running a one-token forward whose output it discards.

Sampling: :func:`nrl_core.sampling.sample`, the same function as the torch generator's, with the
same per-data-parallel-rank seed streams (:func:`nrl_core.sampling.seeded_generator`). Logprobs:
``log_softmax(logits / T)`` at the sampled id (``T = 1`` when greedy), before top-k / top-p
truncation, i.e. not renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nrl_core.interfaces import GenerationOutput, SamplingParams
from nrl_core.sampling import sample, seeded_generator


class MegatronGenerator:
    """Samples continuations from a Megatron ``GPTModel`` (see the module docstring).

    Args:
        model: the bare ``GPTModel`` (``parallel_output=True``: vocab-sharded logits).
        tokenizer: decodes generated ids for stop strings; its EOS always stops a sample.
        device: where the forward runs.
        seed: the default stream's seed (used when ``SamplingParams.seed`` is None).
        dp_rank: this rank's data-parallel index (offsets every seed).
        tp_group, tp_size: the tensor-parallel group the forward is collective over.
        batch_size: prompts generated together (bounds the activations of one forward).
        lockstep_group: ranks whose forwards are collective across data-parallel shards (the
            expert-parallel group), None when there are none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        device: torch.device,
        seed: int,
        dp_rank: int = 0,
        tp_group: Any = None,
        tp_size: int = 1,
        batch_size: int = 64,
        lockstep_group: Any = None,
    ) -> None:
        self.lockstep_group = lockstep_group
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dp_rank = dp_rank
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.batch_size = max(1, batch_size)
        self._default_rng = seeded_generator(seed, dp_rank, device)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else 0
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt (call on every tensor-parallel peer with the same prompts)."""
        stops = [
            tuple(params.stop_strings) + tuple((stop_strings[i] if stop_strings else None) or ())
            for i in range(len(prompts))
        ]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt; give at least one token")
        rng = self._default_rng
        if params.seed is not None:
            rng = seeded_generator(params.seed, self.dp_rank, self.device)
        out = GenerationOutput(token_ids=[], logprobs=[], finish_reasons=[])
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                chunks = self._most(-(-len(prompts) // self.batch_size))
                for start in range(0, chunks * self.batch_size, self.batch_size):
                    sl = slice(start, start + self.batch_size)
                    ids, lps, why = self._generate_chunk(prompts[sl], stops[sl], params, rng)
                    out.token_ids.extend(ids)
                    out.logprobs.extend(lps)
                    out.finish_reasons.extend(why)
        finally:
            self.model.train(was_training)
        return out

    def _last_logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Full-vocabulary logits ``[B, V]`` at the last token of each row."""
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        width = int(lengths.max())
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device)[None, :].expand(len(rows), -1)
        logits = self.model(ids, positions, None)  # [B, W, V / tp]
        last = logits[torch.arange(len(rows), device=self.device), lengths - 1].float()
        if self.tp_size > 1:
            # A plain all-gather: Megatron's gather_from_tensor_model_parallel_region allocates
            # its output on torch.cuda.current_device() (0.16.1), which fails on CPU.
            shards = [torch.empty_like(last) for _ in range(self.tp_size)]
            dist.all_gather(shards, last.contiguous(), group=self.tp_group)
            last = torch.cat(shards, dim=-1)
        return last

    def _most(self, count: int) -> int:
        """The largest ``count`` over the lockstep group (``count`` itself without one)."""
        if self.lockstep_group is None:
            return count
        value = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return int(value)

    def _idle_forward(self) -> None:
        """A forward of one one-token row, output discarded: this rank's share of a lockstep
        group's collectives while its own rows are done."""
        self._last_logits([[self.pad_token_id]])

    def _agree(self, token: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel rank 0's tokens on every peer (the next forward is collective)."""
        if self.tp_size == 1:
            return token
        dist.broadcast(token, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return token

    def _generate_chunk(self, prompts, stops, params: SamplingParams, rng: torch.Generator):
        batch = len(prompts)
        rows = [list(p) for p in prompts]
        prompt_lens = [len(r) for r in rows]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        reasons = ["length"] * batch
        stop_ids = set(params.stop_token_ids) | set(self.eos_token_ids)
        # Decode only a tail window: a stop string completing at this step lies within it.
        window = max((len(s) for row in stops for s in row), default=0) + 2
        active = list(range(batch))
        for _ in range(int(params.max_new_tokens)):
            if not self._most(len(active)):
                break
            if not active:
                self._idle_forward()
                continue
            logits = self._last_logits([rows[i] for i in active])
            token, logprob = sample(logits, params, rng)
            token = self._agree(token.contiguous())
            still = []
            for i, tok, lp in zip(active, token.tolist(), logprob.tolist(), strict=True):
                rows[i].append(tok)
                logprobs[i].append(lp)
                generated = rows[i][prompt_lens[i] :]
                hit = tok in stop_ids
                if not hit and stops[i]:
                    tail = self.tokenizer.decode(generated[-window:], skip_special_tokens=True)
                    hit = any(s in tail for s in stops[i])
                if hit:
                    reasons[i] = "stop"
                else:
                    still.append(i)
            active = still
        return (
            [rows[i][prompt_lens[i] :] for i in range(batch)],
            logprobs,
            reasons,
        )
