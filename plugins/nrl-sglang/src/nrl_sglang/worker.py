"""One SGLang engine, driven from a Ray actor in the nrl-sglang venv (``engine`` extra).

Written against SGLang 0.5.23's ``sglang.Engine``: ``generate(input_ids=..., sampling_params=...,
return_logprob=True)``, ``release_memory_occupation``/``resume_memory_occupation`` (colocated),
``begin_weight_update``/``end_weight_update`` around every refit, ``update_weights_from_tensor``
(refit on the same node: CUDA IPC or shared memory), and ``init_weights_update_group`` +
``update_weights_from_distributed`` (refit over NCCL, one broadcast per tensor). Nothing here
has run on a GPU (see docs/generation-engines.md); plugins/nrl-sglang/tests/test_engine_contract.py
replays these calls against a stand-in that enforces SGLang's own rules.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.weight_sync import (
    BucketHandle,
    BucketMeta,
    CudaIpcHandle,
    NcclBroadcastHandle,
    WeightSyncError,
    unpack_bucket,
)
from nrl_sglang.compat import check_sglang_version
from nrl_sglang.config import SglangConfig
from nrl_sglang.translate import (
    FLATTENED_BUCKET,
    MEMORY_TAGS,
    CudaIpcTensor,
    engine_kwargs,
    per_request_dicts,
    serialize_flattened_bucket,
    to_generation_output,
)

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
        # One line for a release whose Engine calls were not checked (nrl_sglang.compat).
        check_sglang_version(getattr(sglang, "__version__", "unknown"))
        from nrl_core.testing.tiny import resolve_model_name

        model = resolve_model_name(context.config.policy.model_name)
        self.rank = context.rank
        self.released: set[str] = set()
        """The memory tags (:data:`MEMORY_TAGS`) released now. SGLang's scheduler keeps the
        same set and fails on resuming a tag it does not hold (``offload_tags.remove``,
        sglang/srt/managers/scheduler_components/weight_updater.py:389-390), so every resume
        names exactly the tags still released."""
        self._session_open = False
        self._gpu_uuids: list[str] | None = None
        self.engine = sglang.Engine(
            **engine_kwargs(self.options, model, seed=context.seed + 1000 * context.rank)
        )
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
        self.wake_up()
        results = self.engine.generate(
            input_ids=[list(map(int, p)) for p in prompts],
            sampling_params=per_request_dicts(params, len(prompts), stop_strings, 1000 * self.rank),
            return_logprob=True,
        )
        return to_generation_output(results)

    def sleep(self) -> bool:
        """Release every memory region still held (weights, KV cache, CUDA graphs) for
        training. Only held tags are named: after a refit the weights are back while the KV
        cache is still released. Returns False: the weights do not survive (nrl does not set
        ``enable_weights_cpu_backup``, off by default in 0.5.23), so the core refits before
        the next generate."""
        held = [t for t in MEMORY_TAGS if t not in self.released]
        if held:
            # Never an empty list: SGLang reads [] as "all tags" (weight_updater.py:345-346).
            self.engine.release_memory_occupation(tags=held)
            self.released.update(held)
        return False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume memory (``tags`` as SGLang: ``weights``, ``kv_cache``, ``cuda_graph``; None:
        all). Tags not released are skipped: SGLang would raise on them."""
        unknown = set(tags or ()) - set(MEMORY_TAGS)
        if unknown:
            raise NrlError(f"unknown SGLang memory tag(s) {sorted(unknown)}; use {MEMORY_TAGS}")
        wanted = MEMORY_TAGS if tags is None else tags
        todo = [t for t in MEMORY_TAGS if t in wanted and t in self.released]
        if todo:
            # Never an empty list: SGLang reads [] as "all tags" (weight_updater.py:386-387).
            self.engine.resume_memory_occupation(tags=todo)
            self.released.difference_update(todo)

    # -- weight sync (nrl_core.interfaces.WeightSync) --------------------------------------

    def begin_weight_update(self) -> None:
        """Bring back the weights only (the KV cache returns on the next ``generate``) and open
        SGLang's weight-update session: 0.5.23 refuses ``update_weights_from_tensor`` and
        ``update_weights_from_distributed`` outside one (weight_updater.py:192-197, 234-239)."""
        self.wake_up(tags=["weights"])
        if self._session_open:
            # A refit that failed half-way left it open; SGLang refuses a second begin
            # (weight_updater.py:311-316).
            self._end_session()
        self._check("open a weight-update session", self.engine.begin_weight_update())
        self._session_open = True

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Load one bucket. NCCL: SGLang receives one broadcast per tensor itself; CUDA IPC:
        the policy's IPC handles are passed on, never opened here (see :meth:`_ipc_payloads`);
        shared memory: the bucket is copied to this actor's GPU and handed to SGLang."""
        if isinstance(handle, NcclBroadcastHandle):
            result = self.engine.update_weights_from_distributed(
                names=meta.names,
                dtypes=[t.dtype for t in meta.tensors],
                shapes=[list(t.shape) for t in meta.tensors],
                group_name=handle.group,
                flush_cache=False,
            )
        elif isinstance(handle, CudaIpcHandle):
            result = self.engine.update_weights_from_tensor(
                self._ipc_payloads(meta, handle), load_format=FLATTENED_BUCKET, flush_cache=False
            )
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else None
            # A fresh tensor of this process (copied out of shared memory): SGLang may pickle
            # it for its schedulers.
            flat = handle.open(meta, device)
            try:
                named = list(unpack_bucket(flat, meta).items())
                result = self.engine.update_weights_from_tensor(named, flush_cache=False)
            finally:
                del flat
                handle.close()
        self._check("load a weight bucket", result)
        return meta.payload_bytes

    def _ipc_payloads(self, meta: BucketMeta, handle: CudaIpcHandle) -> list[bytes]:
        """One ``flattened_bucket`` payload per tensor-parallel rank, each naming the policy's
        copy of the bucket on that rank's GPU.

        Serialised here from the policy's rebuild arguments, without opening them: opening
        would make the bucket a CUDA tensor *received* by this actor, which torch refuses to
        share again when ``Engine.update_weights_from_tensor`` pickles its tensors for the
        schedulers. The scheduler process opens the policy's handle itself (one CUDA IPC hop,
        as if the policy had pickled the tensor). The policy only sends rebuild arguments, so
        the sender stays engine-independent; the bytes are what SGLang's own serializer makes
        of a tensor (``MultiprocessingSerializer``), with the GPU named by UUID.
        """
        payloads = []
        for gpu in self._tp_gpu_uuids():
            args = handle.by_gpu.get(gpu)
            if args is None:
                raise WeightSyncError(
                    f"no CUDA IPC handle for GPU {gpu}: the cuda_ipc transport needs every "
                    "engine rank on a GPU of a policy rank (colocated); set "
                    "generation.sglang.refit_transport=nccl otherwise"
                )
            payloads.append(serialize_flattened_bucket(CudaIpcTensor(args, device=gpu), meta))
        return payloads

    def _tp_gpu_uuids(self) -> list[str]:
        """The UUID of each tensor-parallel rank's GPU: rank ``r`` runs on visible GPU ``r``
        (``base_gpu_id + r * gpu_id_step`` with the defaults 0 and 1,
        sglang/srt/entrypoints/engine.py:935-938). Read through NVML, not torch: a CUDA context
        in this actor would hold ~0.5 GB of each GPU that SGLang's ``mem_fraction_static``
        never counted (see :func:`visible_gpu_uuids`)."""
        if self._gpu_uuids is None:
            visible = visible_gpu_uuids()
            size = self.options.tensor_parallel_size
            if len(visible) < size:
                raise WeightSyncError(
                    f"the SGLang engine sees {len(visible)} GPU(s) for tensor_parallel_size="
                    f"{size}; give its actor {size} GPUs"
                )
            self._gpu_uuids = visible[:size]
        return self._gpu_uuids

    def finish_weight_update(self) -> None:
        """Close SGLang's session (it post-processes the loaded weights) and flush the radix
        cache computed with the old weights."""
        self._end_session()
        self.engine.flush_cache()

    def _end_session(self) -> None:
        self._session_open = False
        self._check("close the weight-update session", self.engine.end_weight_update())

    def update_weights(self, buckets: Iterator[dict[str, Any]]) -> int:
        """:class:`nrl_core.interfaces.WeightSync` for in-process callers."""
        total = 0
        self.begin_weight_update()
        for bucket in buckets:
            result = self.engine.update_weights_from_tensor(list(bucket.items()), flush_cache=False)
            self._check("load a weight bucket", result)
            total += sum(t.numel() * t.element_size() for t in bucket.values())
        self.finish_weight_update()
        return total

    def init_weight_sync_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's NCCL refit group through SGLang's own API (its ranks meet the
        trainer's :func:`nrl_core.weight_sync.init_nccl_group` in the same store layout)."""
        result = self.engine.init_weights_update_group(
            master_address=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=name,
        )
        self._check(
            f"join the refit group {name!r} at {master_addr}:{master_port} as rank {rank_offset}",
            result,
        )

    @staticmethod
    def _check(what: str, result: Any) -> None:
        """SGLang answers these calls with ``(success, message)`` instead of raising
        (tokenizer_control_mixin.py: ``FanOutCommunicator.merge_results``)."""
        ok, message = result[:2]
        if not ok:
            raise NrlError(f"SGLang could not {what}: {message}")

    def shutdown(self) -> None:
        """Stop the engine's processes."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of this process's visible GPUs in CUDA's numbering, as torch writes them
    (``str(torch.cuda.get_device_properties(i).uuid)``: hex without NVML's ``GPU-`` prefix),
    without creating a CUDA context: NVML through ``pynvml`` (nvidia-ml-py, an SGLang
    dependency) lists every GPU of the machine, and ``CUDA_VISIBLE_DEVICES`` (indices or
    ``GPU-`` UUIDs, as Ray and users set it) picks and orders the visible ones.

    NVML numbers GPUs by PCI bus, CUDA fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
    the two agree on machines of one GPU model, the machines colocated refit runs on."""
    try:
        import pynvml
    except ImportError:
        raise WeightSyncError(
            "the cuda_ipc transport reads GPU UUIDs through NVML (`pynvml`, from "
            "nvidia-ml-py, an SGLang dependency), which this engine's interpreter lacks; "
            "rebuild its venv (nrl venvs build sglang --force)"
        ) from None
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        machine = []
        for index in range(count):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            machine.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    finally:
        pynvml.nvmlShutdown()
    setting = os.environ.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        chosen = machine
    else:
        chosen = []
        for entry in (e.strip() for e in setting.split(",")):
            if not entry:
                continue
            if entry.isdigit() and int(entry) < count:
                chosen.append(machine[int(entry)])
                continue
            # CUDA accepts any unique prefix of a GPU's UUID.
            matches = [u for u in machine if entry.startswith("GPU-") and u.startswith(entry)]
            if len(matches) != 1:
                raise WeightSyncError(
                    f"CUDA_VISIBLE_DEVICES={setting!r}: {entry!r} names no single GPU of this "
                    "machine (MIG instances are not supported by the cuda_ipc transport); use "
                    "generation.sglang.refit_transport=nccl"
                )
            chosen.append(matches[0])
    return [u.removeprefix("GPU-") for u in chosen]
