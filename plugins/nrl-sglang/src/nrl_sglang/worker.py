"""One SGLang engine, driven from a Ray actor in the nrl-sglang venv (``engine`` extra).

Written against SGLang 0.5.23's ``sglang.Engine``: ``generate(input_ids=..., sampling_params=...,
return_logprob=True)``, ``release_memory_occupation``/``resume_memory_occupation`` (colocated),
``update_weights_from_tensor`` (refit on the same node: CUDA IPC or shared memory), and
``init_weights_update_group`` + ``update_weights_from_distributed`` (refit over NCCL, one
broadcast per tensor). Nothing here has run on a GPU (see docs/generation-engines.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.weight_sync import BucketHandle, BucketMeta, NcclBroadcastHandle, unpack_bucket
from nrl_sglang.config import SglangConfig
from nrl_sglang.translate import engine_kwargs, per_request_dicts, to_generation_output

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class SglangGenerationWorker:
    """An SGLang engine (``tensor_parallel_size`` GPUs) behind nrl's generation interface."""

    def __init__(self, options: SglangConfig | None, context: ComponentContext) -> None:
        self.options = options or SglangConfig()
        self.context = context
        # The engine actor is not a torch.distributed member; SGLang's schedulers would read
        # the core's rendezvous variables.
        for var in _DIST_VARS:
            os.environ.pop(var, None)
        try:
            import sglang
        except ImportError as exc:
            raise NrlError(
                "SGLang is not installed in this actor's environment; build it with `nrl venvs "
                f"build sglang` (or install nrl-sglang[engine]): {exc}"
            ) from None
        from nrl_core.testing.tiny import resolve_model_name

        model = resolve_model_name(context.config.policy.model_name)
        self.rank = context.rank
        self.engine = sglang.Engine(
            **engine_kwargs(self.options, model, seed=context.seed + 1000 * context.rank)
        )
        self.released = False
        if self.options.colocated:
            self.sleep()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt (token ids in, token ids and logprobs out)."""
        if not prompts:
            return GenerationOutput(token_ids=[], logprobs=[], finish_reasons=[])
        if self.released:
            self.wake_up()
        results = self.engine.generate(
            input_ids=[list(map(int, p)) for p in prompts],
            sampling_params=per_request_dicts(params, len(prompts), stop_strings, 1000 * self.rank),
            return_logprob=True,
        )
        return to_generation_output(results)

    def sleep(self) -> None:
        """Release weights and KV cache (``release_memory_occupation``) for training."""
        if not self.released:
            self.engine.release_memory_occupation()
            self.released = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume memory (``tags`` as SGLang: ``weights``, ``kv_cache``; None: all)."""
        self.engine.resume_memory_occupation(tags=tags)
        if tags is None or set(tags) >= {"weights", "kv_cache"}:
            self.released = False

    # -- weight sync (nrl_core.interfaces.WeightSync) --------------------------------------

    def begin_weight_update(self) -> None:
        """Bring back the weights only; the KV cache returns on the next ``generate``."""
        if self.released:
            self.wake_up(tags=["weights"])

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Load one bucket. NCCL: SGLang receives one broadcast per tensor itself; otherwise the
        bucket is opened here and handed to ``update_weights_from_tensor``."""
        if isinstance(handle, NcclBroadcastHandle):
            ok, message = self.engine.update_weights_from_distributed(
                names=meta.names,
                dtypes=[t.dtype for t in meta.tensors],
                shapes=[list(t.shape) for t in meta.tensors],
                group_name=handle.group,
                flush_cache=False,
            )[:2]
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else None
            flat = handle.open(meta, device)
            try:
                named = list(unpack_bucket(flat, meta).items())
                ok, message = self.engine.update_weights_from_tensor(named, flush_cache=False)[:2]
            finally:
                del flat
                handle.close()
        if not ok:
            raise NrlError(f"SGLang rejected a weight bucket: {message}")
        return meta.payload_bytes

    def finish_weight_update(self) -> None:
        """Flush the radix cache computed with the old weights."""
        self.engine.flush_cache()

    def update_weights(self, buckets: Iterator[dict[str, Any]]) -> int:
        """:class:`nrl_core.interfaces.WeightSync` for in-process callers."""
        total = 0
        self.begin_weight_update()
        for bucket in buckets:
            ok, message = self.engine.update_weights_from_tensor(
                list(bucket.items()), flush_cache=False
            )[:2]
            if not ok:
                raise NrlError(f"SGLang rejected a weight bucket: {message}")
            total += sum(t.numel() * t.element_size() for t in bucket.values())
        self.finish_weight_update()
        return total

    def init_weight_sync_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's NCCL refit group through SGLang's own API."""
        self.engine.init_weights_update_group(
            master_address=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=name,
        )

    def shutdown(self) -> None:
        """Stop the engine's processes."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
