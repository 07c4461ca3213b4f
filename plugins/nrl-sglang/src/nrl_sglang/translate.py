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
from typing import TYPE_CHECKING, Any

from nrl_core.interfaces import GenerationOutput, SamplingParams

if TYPE_CHECKING:
    import torch

    from nrl_core.weight_sync import BucketMeta

TOP_K_ALL = 1 << 30
"""SGLang's "no top-k" value (``sglang.srt.sampling.sampling_params.TOP_K_ALL``)."""

MEMORY_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")
"""The memory regions ``release_memory_occupation``/``resume_memory_occupation`` know
(``GPU_MEMORY_ALL_TYPES``, sglang/srt/constants.py:2-10): what ``tags=None`` means."""

FLATTENED_BUCKET = "flattened_bucket"
"""The ``load_format`` of ``update_weights_from_tensor`` whose payload is one flat ``uint8``
tensor plus metadata per bucket (sglang/srt/entrypoints/engine.py:1751-1754)."""


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
        "mem_fraction_static": options.gpu_memory_fraction(),
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


# ---------------------------------------------------------------------------------------------
# Refit payloads for ``update_weights_from_tensor(load_format="flattened_bucket")``
#
# SGLang 0.5.23 takes them as one serialized payload per tensor-parallel rank
# (``Engine._serialize_tensors_per_rank``, engine.py:1745-1758, passes them through as they
# are); scheduler rank ``r`` unpickles entry ``r`` with ``MultiprocessingSerializer.deserialize``
# (``TpModelWorker.deserialize_own_rank``, managers/tp_worker.py:194-201), i.e. with
# ``SafeUnpickler`` (utils/common.py:3144-3370), which resolves only the globals it lists. The
# result must be ``{"flattened_tensor": uint8 tensor, "metadata": [...]}`` whose entries have
# ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx`` and ``numel``
# (``_update_weights_from_flattened_bucket``, model_executor/model_runner_components/
# weight_updater.py:383-413); each tensor is ``flattened_tensor[start_idx:end_idx]`` viewed as
# ``dtype`` and reshaped (``FlattenedTensorBucket.reconstruct_tensors``,
# weight_sync/tensor_bucket.py:118-135), so our packed bucket (16-byte aligned offsets,
# nrl_core.weight_sync.pack_bucket) is such a flat tensor as it is.


def flattened_bucket_metadata(meta: BucketMeta) -> list[Any]:
    """SGLang's per-tensor metadata for a packed bucket, as ``types.SimpleNamespace`` objects:
    the one attribute-bearing type SGLang's ``SafeUnpickler`` admits that needs no SGLang
    import here (utils/common.py:3176); ``FlattenedTensorMetadata`` would need SGLang on the
    sending side. ``numel`` counts bytes, as SGLang's own buckets do (tensor_bucket.py:53-66)."""
    from types import SimpleNamespace

    import torch

    return [
        SimpleNamespace(
            name=t.name,
            shape=torch.Size(t.shape),
            dtype=getattr(torch, t.dtype),
            start_idx=t.offset,
            end_idx=t.offset + t.nbytes,
            numel=t.nbytes,
        )
        for t in meta.tensors
    ]


class CudaIpcTensor:
    """A CUDA tensor of another process, as the rebuild arguments of its CUDA IPC handle
    (``torch.multiprocessing.reductions.reduce_tensor``'s output, carried by
    :class:`nrl_core.weight_sync.CudaIpcHandle`). It pickles as ``rebuild_cuda_tensor(*args)``,
    exactly what pickling the tensor in its owner would give, without ever opening the handle
    here: a CUDA tensor that this process *received* cannot be pickled again (torch refuses to
    share a received CUDA storage).

    ``device`` replaces the device argument (index 6) with the GPU's UUID: the index is the
    owner's CUDA numbering, which an SGLang scheduler need not share; SGLang's patched
    ``rebuild_cuda_tensor`` maps a UUID to its own index (utils/patch_torch.py:80-99), and
    ``deserialize_own_rank`` applies that patch before unpickling (tp_worker.py:198-199).
    """

    __slots__ = ("args",)

    def __init__(self, args: Sequence[Any], device: str | int | None = None) -> None:
        from nrl_core.weight_sync import WeightSyncError

        args = tuple(args)
        if len(args) != 15:
            raise WeightSyncError(
                f"CUDA IPC rebuild arguments have {len(args)} fields; rebuild_cuda_tensor takes 15"
            )
        if device is not None:
            args = (*args[:6], device, *args[7:])
        self.args = args

    def __reduce__(self) -> tuple:
        # Whatever the module attribute is now (torch's function, or SGLang's patched one if
        # SGLang patched this process): pickle stores it by its own module and name, both of
        # which SGLang's SafeUnpickler admits (utils/common.py:3329-3330).
        from torch.multiprocessing import reductions

        return reductions.rebuild_cuda_tensor, self.args


def serialize_flattened_bucket(flattened: torch.Tensor | CudaIpcTensor, meta: BucketMeta) -> bytes:
    """One rank's ``flattened_bucket`` payload: ``flattened`` (the packed bucket, or a
    :class:`CudaIpcTensor` of it) and :func:`flattened_bucket_metadata`, pickled as
    ``MultiprocessingSerializer.serialize`` does (``ForkingPickler``, utils/common.py:
    3062-3080), so that tensors in this process travel as shared memory or CUDA IPC handles."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's ForkingPickler reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(
        {"flattened_tensor": flattened, "metadata": flattened_bucket_metadata(meta)}
    )
    return buf.getvalue()
