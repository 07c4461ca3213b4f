"""Colocated torch generation: batched sampling with a KV cache from a Hugging Face causal LM.

:class:`TorchGenerator` drives the model's own forward with a KV cache in a tight loop (no logits
processors, stopping criteria or per-step Python over samples), so it runs on a plain model in a
single process (tests, benchmarks) and on the policy's FSDP-sharded model inside the policy
workers (``DTensorPolicyWorker.generate`` delegates here).

Sampling (temperature, top-k, top-p, greedy) and the per-rank seed streams come from
:mod:`nrl_core.sampling`, shared with the Megatron generator. Logprobs: each generated token's
logprob is ``log_softmax(logits / T)`` at the sampled id, where ``T`` is the sampling temperature
(``T = 1`` for greedy). It is taken *before* top-k/top-p truncation, so it is not renormalised.
The dtensor trainer divides its logits by the same generation temperature (see
``DTensorPolicyWorker``), so in float32 the train/generation logprob mismatch is ~0 whatever the
temperature.

Sharded models: each ``generate`` call all-gathers the FSDP-sharded weights once and keeps them
gathered until it returns (``gather_weights_once``, the default; colocated rollouts in real
systems do the same), instead of FSDP's all-gather of every layer at every decode step. Without
tensor parallelism the gathered model then runs no collective at all, so each rank decodes its own
prompts at its own pace. When forwards are collectives (tensor parallelism, or
``gather_weights_once=false``) and ``synchronize`` is on, every rank keeps stepping (feeding
padding for finished rows, or a dummy one-token prompt when it has no prompts left) until all
ranks are done; ranks agree through an all-reduce of a "done" flag.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.sampling import sample, seeded_generator
from nrl_dtensor.config import TorchGenerationConfig


class TorchGenerator:
    """Generate continuations of token-id prompts with a KV cache (see the module docstring).

    Built by the registry as ``TorchGenerator(options, context)`` (it then loads
    ``policy.model_name`` itself, single process), or with ``model=``/``tokenizer=`` to wrap a
    model that already exists (the policy's sharded model, or a plain model in a benchmark).
    """

    def __init__(
        self,
        options: TorchGenerationConfig | None = None,
        context: ComponentContext | None = None,
        *,
        model=None,
        tokenizer=None,
        device: torch.device | str | None = None,
        synchronize: bool | None = None,
        seed_offset: int = 0,
        fsdp_reshard_after_forward: bool = True,
    ) -> None:
        self.options = options or TorchGenerationConfig()
        self.context = context or ComponentContext(config=None)
        if model is None:
            model, tokenizer = self._load(self.context)
        self.model = model
        self.tokenizer = tokenizer
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        self.synchronize = (
            dist.is_available() and dist.is_initialized() if synchronize is None else synchronize
        )
        self.seed_offset = seed_offset
        self.preallocate_cache = True
        """Decode into a KV cache preallocated for prompt + new tokens
        (:func:`preallocated_cache`); False: the model's own ``DynamicCache``, which
        concatenates the whole cache at every step (same tokens; the benchmark and the tests
        compare the two)."""
        self.fsdp_reshard_after_forward = fsdp_reshard_after_forward
        """How the FSDP-sharded model's layers were set up (restored after a generation)."""
        self._recorder = self._routing_recorder(model)
        """Records each token's experts (a MoE model with ``policy.moe.record_routing`` or
        ``router_replay``), else None."""
        # The stream used when SamplingParams carries no seed: seeded once, then it advances.
        self._default_rng = seeded_generator(self.context.seed, seed_offset, self.device)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else (model.config.eos_token_id or 0)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if eos is None:
            eos = model.config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )

    @staticmethod
    def _load(context: ComponentContext):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nrl_core.testing.tiny import resolve_model_name

        policy = context.config.policy
        name = resolve_model_name(policy.model_name)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if policy.precision == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(policy.tokenizer_name or name))
        return model, tokenizer

    # -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt; ``stop_strings`` adds per-sample stop strings to
        ``params.stop_strings``. On a sharded model, call on all ranks together."""
        stops = [
            tuple(params.stop_strings) + tuple((stop_strings[i] if stop_strings else None) or ())
            for i in range(len(prompts))
        ]
        if any(stops) and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        rng = self._default_rng
        if params.seed is not None:
            rng = seeded_generator(params.seed, self.seed_offset, self.device)
        chunk = max(1, self.options.generation_batch_size)
        starts = list(range(0, len(prompts), chunk))
        token_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        routed: list[torch.Tensor] | None = [] if self._recorder is not None else None
        weights: list[torch.Tensor] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with self._weights_for_generation() as (forward, lockstep):
                num_chunks = self._global_max(len(starts)) if lockstep else len(starts)
                for c in range(num_chunks):
                    if c < len(starts):
                        sl = slice(starts[c], starts[c] + chunk)
                        if routed is not None:
                            self._recorder.start()
                        ids, lps, why = self._generate_chunk(
                            forward, prompts[sl], stops[sl], params, rng, lockstep
                        )
                        if routed is not None:
                            steps = self._recorder.stop()
                            routed += chunk_routing([i for i, _ in steps], prompts[sl], ids)
                            weights += chunk_routing([w for _, w in steps], prompts[sl], ids)
                        token_ids += ids
                        logprobs += lps
                        reasons += why
                    else:
                        # Nothing left here, but the other ranks' forwards need this rank's
                        # shards.
                        self._generate_chunk(
                            forward, [[self.pad_token_id]], [()], params, rng, lockstep
                        )
        finally:
            self.model.train(was_training)
        return GenerationOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reasons=reasons,
            routed_experts=routed,
            routing_weights=weights if routed is not None else None,
        )

    def _routing_recorder(self, model):
        """A :class:`~nrl_dtensor.moe.RoutingRecorder` when the run records routing and the
        model has experts."""
        from nrl_dtensor.moe import RoutingRecorder, is_moe_model

        policy = getattr(self.context.config, "policy", None)
        moe = getattr(policy, "moe", None)
        if moe is None or not moe.records_routing or not is_moe_model(model):
            return None
        return RoutingRecorder(model)

    @contextlib.contextmanager
    def _weights_for_generation(self) -> Iterator[tuple[Callable, bool]]:
        """Gather the FSDP-sharded weights for the whole call (``gather_weights_once``); yields
        the forward to call and whether this rank's forwards are still collectives, i.e.
        whether ranks must step in lockstep."""
        if not (self.synchronize and self.options.gather_weights_once):
            yield self.model, self.synchronize
            return
        from nrl_dtensor.fsdp import fsdp_modules, gathered_fsdp_weights

        with gathered_fsdp_weights(self.model, self.fsdp_reshard_after_forward):
            # Gathered, a model without tensor parallelism holds plain tensors and its forward
            # talks to no other rank; tensor-parallel weights stay DTensors whose forward does.
            from torch.distributed.tensor import DTensor

            lockstep = any(isinstance(p, DTensor) for p in self.model.parameters())
            # With the weights gathered for the whole call, the FSDP unit's per-forward hooks
            # (input casts, unshard waits, reshard and backward-hook bookkeeping) have nothing
            # to do, but cost about 1 ms per decode step on a CPU: when the whole model is one
            # unit (the CPU default), call its forward itself. With inner units the hooks
            # stay: they run FSDP's lazy initialisation from the root's.
            single_unit = fsdp_modules(self.model) == [self.model]
            forward = self.model.forward if single_unit and not lockstep else self.model
            yield forward, lockstep

    def _global_max(self, value: int) -> int:
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _all_done(self, done: torch.Tensor, lockstep: bool) -> bool:
        flag = done.all()
        if lockstep:
            flag = flag.to(torch.int32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _grad_context(self):
        # FSDP2's all-gathered parameters must not be inference tensors; plain models can use
        # the cheaper inference mode.
        from torch.distributed.fsdp import FSDPModule

        return torch.no_grad() if isinstance(self.model, FSDPModule) else torch.inference_mode()

    def _generate_chunk(self, forward, prompts, stops, params, rng, lockstep: bool):
        with self._grad_context():
            return self._generate_chunk_impl(forward, prompts, stops, params, rng, lockstep)

    def _generate_chunk_impl(self, forward, prompts, stops, params, rng, lockstep: bool):
        device, batch = self.device, len(prompts)
        max_new = int(params.max_new_tokens)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        if width == 0:
            raise ValueError("cannot generate from an empty prompt; give at least one token")
        # Left padding lines up every row's next token in the last column.
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        ids = ids.to(device)
        # One preallocated mask for prompt + generation; each step only uncovers a column.
        mask = torch.zeros((batch, width + max_new), dtype=torch.long, device=device)
        mask[:, :width] = torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]
        padded = bool((lengths != width).any())
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        next_position = lengths.clone()[:, None]

        out_tokens = torch.full(
            (batch, max_new), self.pad_token_id, dtype=torch.long, device=device
        )
        out_logprobs = torch.zeros((batch, max_new), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        stop_ids = tuple(params.stop_token_ids) + (
            self.eos_token_ids if self.options.stop_at_eos else ()
        )
        stop_ids_t = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        # Finished length per row; max_new means "ran out of tokens" unless it hit a stop.
        final_len = torch.full((batch,), max_new, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        check_strings = any(stops)
        history: list[list[int]] = [[] for _ in range(batch)] if check_strings else []
        # Decode only a tail window: a stop string that completes at this step lies within it
        # (each token decodes to at least one character with the tokenizers we support).
        window = max((len(s) for row in stops for s in row), default=0) + 2

        cache = (
            preallocated_cache(self.model.config, width + max_new)
            if self.preallocate_cache
            else None
        )
        cache_kw = cache_keyword(self.model)
        out = forward(
            input_ids=ids,
            attention_mask=mask[:, :width] if padded else None,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
        cache = out[cache_kw]
        steps = 0
        for step in range(max_new):
            logits = out.logits[:, -1, :]
            if hasattr(logits, "full_tensor"):
                # Vocabulary-parallel lm_head (tensor parallelism): gather the last position's
                # [B, V] to sample from the whole vocabulary.
                logits = logits.full_tensor()
            token, logprob = sample(logits, params, rng)
            token = torch.where(done, self.pad_token_id, token)
            out_tokens[:, step] = token
            out_logprobs[:, step] = logprob
            steps = step + 1
            newly = ~done
            if stop_ids_t.numel():
                newly = newly & torch.isin(token, stop_ids_t)
            else:
                newly = torch.zeros_like(done)
            if check_strings:
                newly = newly | self._stop_string_hits(token, done, history, stops, window)
            final_len = torch.where(newly, step + 1, final_len)
            stopped |= newly
            done |= newly
            if step + 1 == max_new or self._all_done(done, lockstep):
                break
            mask[:, width + step] = 1
            out = forward(
                input_ids=token[:, None],
                attention_mask=mask[:, : width + step + 1] if padded else None,
                position_ids=next_position,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kw: cache},
            )
            cache = out[cache_kw]
            next_position = next_position + 1

        final_len = final_len.clamp(max=steps).tolist()
        tokens = out_tokens.tolist()
        lps = out_logprobs.tolist()
        stopped = stopped.tolist()
        return (
            [tokens[i][: final_len[i]] for i in range(batch)],
            [lps[i][: final_len[i]] for i in range(batch)],
            ["stop" if stopped[i] else "length" for i in range(batch)],
        )

    def _stop_string_hits(self, token, done, history, stops, window) -> torch.Tensor:
        hits = [False] * len(history)
        token_list = token.tolist()
        done_list = done.tolist()
        for i, row_stops in enumerate(stops):
            if done_list[i]:
                continue
            history[i].append(token_list[i])
            if row_stops:
                tail = self.tokenizer.decode(history[i][-window:], skip_special_tokens=True)
                hits[i] = any(s in tail for s in row_stops)
        return torch.tensor(hits, dtype=torch.bool, device=token.device)


def chunk_routing(
    steps: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]], generated: list[list[int]]
) -> list[torch.Tensor]:
    """Each sample's routing ``[prompt + generated - 1, layers, k]`` (expert ids, or their
    gate weights) from the recorded forwards of one chunk (:meth:`RoutingRecorder.stop`): the prefill (``[rows * width, ...]``,
    prompts left-padded to ``width``), then one decode forward per step, whose input is the
    previous step's token. The last generated token is never an input: it has no routing
    (:func:`nrl_core.moe.routing_array` fills it as not recorded)."""
    rows = len(prompts)
    prefill = steps[0].view(rows, -1, *steps[0].shape[1:])
    width = prefill.shape[1]
    decode = torch.stack(list(steps[1:]), dim=1) if len(steps) > 1 else None
    out = []
    for i, (prompt, ids) in enumerate(zip(prompts, generated, strict=True)):
        parts = [prefill[i, width - len(prompt) :]]
        if decode is not None and len(ids) > 1:
            parts.append(decode[i, : len(ids) - 1])
        out.append(torch.cat(parts).cpu())
    return out


def preallocated_cache(config, capacity: int):
    """A Hugging Face ``DynamicCache`` whose layers write into buffers of ``capacity`` positions
    allocated once, instead of concatenating (and copying the whole cache) at every step.

    Returns ``None`` (the model then builds its default cache) for models whose layers are not
    plain full-attention ``DynamicLayer``s (sliding windows, hybrid caches).
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, heads, _, dim = key_states.shape
            self._key_buf = key_states.new_empty((batch, heads, capacity, dim))
            self._value_buf = value_states.new_empty(
                (batch, heads, capacity, value_states.shape[-1])
            )
            self.length = 0
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self._key_buf[:, :, self.length : end] = key_states
            self._value_buf[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

    try:
        cache = DynamicCache(config=config)
    except Exception:  # configs the cache does not understand: let the model decide
        return None
    if len(cache.layers) != config.num_hidden_layers or any(
        type(layer) is not DynamicLayer for layer in cache.layers
    ):
        return None
    cache.layers = [PreallocatedLayer() for _ in cache.layers]
    return cache


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of the KV cache in ``model.forward`` and its output: ``cache`` since
    transformers 5.24, ``past_key_values`` before. The old name still works in 5.24 but prints
    a deprecation line on each process's first call (on the console of an in-process run) and
    goes in 5.40."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
