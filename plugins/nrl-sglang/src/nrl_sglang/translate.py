"""Pure translations between nrl's types and SGLang 0.5.23's, as plain dicts.

Nothing here imports SGLang. The worker passes :func:`sampling_dict` as ``sampling_params`` of
``sglang.Engine.generate(input_ids=..., return_logprob=True)`` and hands the returned dicts to
:func:`to_generation_output`.

Logprobs (SGLang 0.5.23, ``sglang/srt/layers/sampler.py``): by default the returned logprob is
``log_softmax(logits / T)`` (``log(probs)`` before top-k/top-p filtering in the standard path),
what the trainer computes; ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would return them at T = 1.
We leave that variable unset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nrl_core.interfaces import GenerationOutput, SamplingParams

TOP_K_ALL = 1 << 30
"""SGLang's "no top-k" value (``sglang.srt.sampling.sampling_params.TOP_K_ALL``)."""


def sampling_dict(
    params: SamplingParams, extra_stop_strings: Sequence[str] | None = None, seed: int | None = None
) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for one request (field names of SGLang's
    ``SamplingParams``: ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``sampling_seed``)."""
    stops = list(params.stop_strings) + [s for s in (extra_stop_strings or ()) if s]
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else TOP_K_ALL,
        "n": 1,
        "skip_special_tokens": False,
        # Keep the matched stop string/token in the output, as the other backends do.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if stops:
        out["stop"] = list(dict.fromkeys(stops))
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def per_request_dicts(
    params: SamplingParams,
    n: int,
    stop_strings: Sequence[Sequence[str] | None] | None = None,
    seed_offset: int = 0,
) -> list[dict[str, Any]]:
    """One :func:`sampling_dict` per prompt, with distinct seeds when ``params.seed`` is set."""
    return [
        sampling_dict(
            params,
            stop_strings[i] if stop_strings else None,
            None if params.seed is None else params.seed + seed_offset + i,
        )
        for i in range(n)
    ]


def engine_kwargs(options: Any, model: str, *, seed: int) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` (``ServerArgs`` fields) for ``generation.sglang``."""
    kwargs: dict[str, Any] = {
        "model_path": model,
        "tp_size": options.tensor_parallel_size,
        "mem_fraction_static": options.mem_fraction_static,
        "dtype": options.dtype,
        "random_seed": seed,
        # release/resume_memory_occupation needs the memory saver when colocated.
        "enable_memory_saver": bool(options.colocated),
        "skip_tokenizer_init": False,
        "log_level": "error",
    }
    if options.context_length is not None:
        kwargs["context_length"] = options.context_length
    return kwargs


def to_generation_output(results: Sequence[dict[str, Any]]) -> GenerationOutput:
    """Convert ``Engine.generate`` results (one dict per prompt, in order) to nrl's type.

    Reads ``output_ids`` and ``meta_info["output_token_logprobs"]`` (a list of ``(logprob,
    token_id, text_or_None)``) and ``meta_info["finish_reason"]["type"]`` (``stop`` for a
    matched token or string, ``length``), as produced by SGLang 0.5.23's TokenizerManager.
    """
    token_ids, logprobs, reasons = [], [], []
    for res in results:
        meta = res["meta_info"]
        ids = [int(t) for t in res["output_ids"]]
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise RuntimeError("SGLang returned no logprobs; pass return_logprob=True")
        lps = [float(t[0]) for t in triples]
        if [int(t[1]) for t in triples] != ids:
            raise RuntimeError("SGLang's logprob token ids do not match its output ids")
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in ("stop", "length"):
            raise RuntimeError(f"SGLang request {meta.get('id')} finished with {reason!r}")
        token_ids.append(ids)
        logprobs.append(lps)
        reasons.append(kind)
    return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reasons=reasons)
