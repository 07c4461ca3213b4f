"""The SGLang worker against SGLang 0.5.23's own rules, without SGLang or a GPU.

SGLang cannot be installed here, so ``sglang.Engine`` is a stand-in (:class:`StandInEngine`)
that keeps the state SGLang's scheduler keeps and fails where SGLang fails, each rule cited
from the 0.5.23 source; the REAL :class:`SglangGenerationWorker` drives it (its ``__init__``
imports ``sglang`` and finds the stand-in). The stand-in loads weights into a real tiny model,
and payloads SGLang would unpickle are unpickled under SGLang's ``SafeUnpickler`` rule. The one
thing replaced is the CUDA driver: opening a CUDA IPC handle returns the buffer the test
registered for it.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import socket
import sys
import types
from multiprocessing import shared_memory

import pytest
import torch
from nrl_sglang import translate
from nrl_sglang.config import SglangConfig
from nrl_sglang.worker import SglangGenerationWorker

from nrl_core.config.schema import RunConfig
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, SamplingParams
from nrl_core.weight_sync import (
    CudaIpcHandle,
    SharedMemoryHandle,
    WeightSyncError,
    iter_buckets,
    pack_bucket,
)

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
"""``GPU_MEMORY_ALL_TYPES`` (sglang/srt/constants.py:6-10): what tags None or [] mean."""

SGLANG_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "Size"),
    ("types", "SimpleNamespace"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch", "float16"),
    ("torch", "uint8"),
    ("torch", "int64"),
}
"""The entries of SGLang's ``SafeUnpickler.ALLOWED_GLOBALS`` that refit payloads may name
(sglang/srt/utils/common.py:3175, 3176, 3181, 3220, 3224, 3240, 3241, 3259, 3279, 3294, 3296,
3327, 3329, 3330, 3336, 3339). SGLang refuses any global not in its list (common.py:3361-3370);
a payload that passes this subset passes SGLang's list."""

GPU_UUIDS = ["GPU-5c1e0000-0000-0000-0000-000000000000", "GPU-5c1e0000-0000-0000-0000-000000000001"]
"""The engine's GPUs (tensor-parallel rank r on the r-th)."""

IPC_MEMORY: dict[bytes, torch.Tensor] = {}
"""The stand-in for the CUDA driver: IPC memory handle -> the buffer it maps."""


class SafeUnpicklerRule(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` rule (common.py:3361-3370) for rank ``gpu``; a CUDA rebuild
    resolves the device as SGLang's patched ``rebuild_cuda_tensor`` does (a GPU UUID, or an
    index in the scheduler's own numbering: utils/patch_torch.py:80-99) and maps the handle
    through :data:`IPC_MEMORY`."""

    def __init__(self, data: bytes, gpu: str, opened: list) -> None:
        super().__init__(io.BytesIO(data))
        self.gpu, self.opened = gpu, opened

    def find_class(self, module, name):
        if (module, name) not in SGLANG_ALLOWED_GLOBALS:
            raise RuntimeError(
                f"Blocked unsafe global ({module}.{name}) during pickle deserialization"
            )
        if name in ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"):
            return self._open_ipc
        return super().find_class(module, name)

    def _open_ipc(self, *args):
        assert len(args) == 15, "torch.multiprocessing.reductions.rebuild_cuda_tensor arity"
        device, handle = args[6], args[7]
        if isinstance(device, str) and device not in GPU_UUIDS:
            raise Exception("Invalid device_uuid=" + device)  # patch_torch.py:97
        self.opened.append((self.gpu, device, handle))
        return IPC_MEMORY[handle]


class StandInEngine:
    """``sglang.Engine`` as far as the worker uses it, with SGLang 0.5.23's rules."""

    def __init__(self, **kwargs) -> None:
        from transformers import AutoModelForCausalLM

        self.tp_size = kwargs["tp_size"]
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=torch.float32)
        # Scheduler state: released tags and the weight-update session
        # (scheduler_components/weight_updater.py:96-99).
        self.offload_tags: set[str] = set()
        self.session = False
        self.opened: list = []

    # memory (scheduler_components/weight_updater.py:337-422)
    def release_memory_occupation(self, tags=None):
        for tag in tags or ALL_TAGS:  # :345-349
            self.offload_tags.add(tag)

    def resume_memory_occupation(self, tags=None):
        for tag in tags or ALL_TAGS:  # :386-390: resuming a tag not released raises KeyError
            self.offload_tags.remove(tag)

    # weight-update session (:309-335); answers are (success, message) (io_struct outputs)
    def begin_weight_update(self, selector="all"):
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:  # :232-239
            return False, (
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if "weights" in self.offload_tags:
            # The memory saver unmapped the weights (torch_memory_saver_adapter.py:128-129).
            raise RuntimeError("CUDA error: an illegal memory access (weights are released)")
        if load_format == "flattened_bucket":
            # Engine._serialize_tensors_per_rank passes the payloads on (engine.py:1751-1754);
            # rank r unpickles entry r (tp_worker.py:194-201) and rebuilds the tensors
            # (model_runner_components/weight_updater.py:383-413, tensor_bucket.py:118-135).
            for rank in range(self.tp_size):
                data = bytes(named_tensors[rank])
                assert data[:1] == b"\x80", "not a pickle payload (common.py:3105-3106)"
                obj = SafeUnpicklerRule(data, GPU_UUIDS[rank], self.opened).load()
                flat = obj["flattened_tensor"]
                self._load(
                    (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
                    for m in obj["metadata"]
                )
        elif load_format is None:
            self._load(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"

    def _load(self, named) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)

    def flush_cache(self):
        return True

    def generate(self, input_ids, sampling_params, return_logprob=False):
        if self.offload_tags:
            raise RuntimeError(
                f"CUDA error: an illegal memory access ({self.offload_tags} released)"
            )
        return [
            {
                "output_ids": [7] * p["max_new_tokens"],
                "meta_info": {
                    "id": str(i),
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [(-0.5, 7, None)] * p["max_new_tokens"],
                },
            }
            for i, p in enumerate(sampling_params)
        ]

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        # The rendezvous fails without a store to join; SGLang returns it as a result
        # (model_runner_components/weight_updater.py:131-144).
        try:
            socket.create_connection((master_address, master_port), timeout=2).close()
        except OSError as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def shutdown(self):
        pass


class Worker(SglangGenerationWorker):
    """The real worker; only the GPU query it makes for CUDA IPC is answered here."""

    def _tp_gpu_uuids(self) -> list[str]:
        return GPU_UUIDS[: self.options.tensor_parallel_size]


@pytest.fixture
def sglang(monkeypatch):
    """``import sglang`` gives the stand-in for this test."""
    module = types.ModuleType("sglang")
    module.Engine = StandInEngine
    module.__version__ = "0.5.23"  # the release the stand-in's rules were read from
    monkeypatch.setitem(sys.modules, "sglang", module)
    IPC_MEMORY.clear()
    return module


def _worker(tiny_model_path, **options) -> Worker:
    config = RunConfig()
    config.policy.model_name = str(tiny_model_path)
    return Worker(SglangConfig(dtype="float32", **options), ComponentContext(config=config))


def _policy_state(tiny_model_path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for k, v in state.items()
    }


def _refit_shm(worker, state) -> None:
    """One refit over shared memory, in the calls WeightSender.send makes."""
    worker.begin_weight_update()
    for bucket in iter_buckets(state.items(), 1 << 17):
        flat, meta = pack_bucket(bucket)
        shm = shared_memory.SharedMemory(create=True, size=meta.nbytes)
        try:
            torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes).copy_(flat)
            worker.receive_bucket(meta, SharedMemoryHandle(shm.name))
        finally:
            shm.close()
            shm.unlink()
    worker.finish_weight_update()


@pytest.mark.gpu_sim
def test_colocated_refit_and_generate_cycles(sglang, tiny_model_path):
    """Colocated start, refit, generate, sleep, twice: every refit runs inside SGLang's
    weight-update session with the weights resumed, and each step leaves the tags as SGLang
    expects them (all released when asleep, none when generating)."""
    worker = _worker(tiny_model_path, colocated=True)
    engine = worker.engine
    assert engine.offload_tags == set(ALL_TAGS)
    for seed in (1, 2):
        state = _policy_state(tiny_model_path, seed)
        _refit_shm(worker, state)
        assert _digest(engine.model.state_dict()) == _digest(state)
        assert engine.offload_tags == {"kv_cache", "cuda_graph"} and not engine.session
        out = worker.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        assert out.token_ids == [[7, 7]] and engine.offload_tags == set()
        worker.sleep()
        assert engine.offload_tags == set(ALL_TAGS)


@pytest.mark.gpu_sim
def test_partial_wake_up_resumes_only_what_is_released(sglang, tiny_model_path):
    """After a refit resumed the weights only, generate resumes the rest (SGLang raises
    KeyError('weights') on a second resume) and sleep releases the weights again."""
    worker = _worker(tiny_model_path, colocated=True)
    engine = worker.engine
    for _ in range(2):
        worker.begin_weight_update()
        worker.finish_weight_update()
        worker.generate([[1, 2]], SamplingParams(max_new_tokens=1))
        assert engine.offload_tags == set()
        worker.wake_up(["weights"])  # nothing released: no call SGLang would refuse
        worker.sleep()
        assert engine.offload_tags == set(ALL_TAGS)
    worker.begin_weight_update()
    worker.finish_weight_update()
    worker.sleep()  # training right after a refit: the weights must go too
    worker.sleep()
    assert engine.offload_tags == set(ALL_TAGS)


@pytest.mark.gpu_sim
def test_cuda_ipc_refit_passes_the_policy_handles_on_unopened(sglang, tiny_model_path):
    """cuda_ipc: each tensor-parallel rank gets a flattened_bucket payload naming the policy's
    copy on its own GPU (by UUID), and the weights arrive. The worker never opens a handle
    itself: a CUDA tensor it received could not be pickled on to the schedulers."""
    worker = _worker(tiny_model_path, colocated=False, tensor_parallel_size=2)
    engine = worker.engine
    state = _policy_state(tiny_model_path, 3)
    worker.begin_weight_update()
    for i, bucket in enumerate(iter_buckets(state.items(), 1 << 17)):
        flat, meta = pack_bucket(bucket)
        by_gpu = {}
        for gpu in [*GPU_UUIDS, "GPU-of-another-policy-rank"]:
            handle = f"ipc-{i}-{gpu}".encode()
            IPC_MEMORY[handle] = flat.clone()  # the policy's copy on that GPU
            # reduce_tensor's rebuild arguments for the flat uint8 buffer, in the order of
            # torch/multiprocessing/reductions.py (rebuild_cuda_tensor, reduce_tensor):
            # device 0 is the index in the POLICY's numbering, meaningless to the engine.
            by_gpu[gpu] = (
                torch.Tensor, flat.shape, flat.stride(), 0, torch.storage.TypedStorage,
                torch.uint8, 0, handle, meta.nbytes, 0, False, b"refcount", 0, b"event", True,
            )  # fmt: skip
        assert worker.receive_bucket(meta, CudaIpcHandle(by_gpu)) == meta.payload_bytes
    worker.finish_weight_update()
    assert _digest(engine.model.state_dict()) == _digest(state)
    assert engine.opened and all(gpu == device for gpu, device, _ in engine.opened)
    assert {gpu for gpu, _, _ in engine.opened} == set(GPU_UUIDS)

    worker.begin_weight_update()
    lone = CudaIpcHandle({"GPU-elsewhere": by_gpu[GPU_UUIDS[0]]})
    with pytest.raises(WeightSyncError, match="refit_transport=nccl"):
        worker.receive_bucket(meta, lone)


@pytest.mark.gpu_sim
def test_flattened_bucket_payload_is_what_sglang_unpickles(tiny_model_path):
    """A real bucket (mixed dtypes, odd sizes) serialised for load_format="flattened_bucket"
    passes SGLang's unpickling rule and rebuilds bit-exact the way SGLang rebuilds it."""
    state = {k: v.to(torch.bfloat16) for k, v in _policy_state(tiny_model_path, 4).items()}
    state["odd.ids"] = torch.arange(7, dtype=torch.int64)
    state["odd.half"] = torch.ones(3, 5, dtype=torch.float16)
    flat, meta = pack_bucket(state)
    obj = SafeUnpicklerRule(
        translate.serialize_flattened_bucket(flat, meta), GPU_UUIDS[0], []
    ).load()
    assert set(obj) == {"flattened_tensor", "metadata"}
    fields = {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}  # tensor_bucket.py:8-16
    assert all(set(vars(m)) == fields for m in obj["metadata"])
    assert all(isinstance(m.shape, torch.Size) for m in obj["metadata"])
    rebuilt = {
        m.name: obj["flattened_tensor"][m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)
        for m in obj["metadata"]
    }
    assert list(rebuilt) == list(state) and _digest(rebuilt) == _digest(state)
    assert [m.numel for m in translate.flattened_bucket_metadata(meta)] == [
        t.nbytes for t in meta.tensors
    ]

    # The CUDA form names torch's rebuild with the GPU by UUID, which SGLang's rule admits.
    args = (torch.Tensor, flat.shape, flat.stride(), 0, torch.storage.TypedStorage, torch.uint8,
            3, b"h", meta.nbytes, 0, False, b"r", 0, b"e", True)  # fmt: skip
    IPC_MEMORY[b"h"] = flat
    opened: list = []
    ipc = translate.CudaIpcTensor(args, device=GPU_UUIDS[1])
    payload = translate.serialize_flattened_bucket(ipc, meta)
    assert SafeUnpicklerRule(payload, GPU_UUIDS[1], opened).load()["flattened_tensor"] is flat
    assert opened == [(GPU_UUIDS[1], GPU_UUIDS[1], b"h")]
    IPC_MEMORY.clear()


@pytest.mark.gpu_sim
def test_failed_refit_group_join_is_one_error(sglang, tiny_model_path):
    """SGLang reports a failed init_weights_update_group as (False, message); the worker
    raises it instead of leaving every later refit to hang."""
    worker = _worker(tiny_model_path, colocated=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once closed
    with pytest.raises(NrlError, match=f"could not join the refit group 'g' at 127.0.0.1:{port}"):
        worker.init_weight_sync_group("g", "127.0.0.1", port, 1, 2)


def test_memory_tags_match_sglang():
    assert tuple(ALL_TAGS) == translate.MEMORY_TAGS


@pytest.mark.gpu_sim
def test_refit_streams_the_checkpoint_layout_sglangs_loader_takes():
    """SGLang's Qwen3-MoE ``load_weights`` maps per-expert checkpoint names
    (``experts.{e}.gate_proj.``, its ``make_expert_params_mapping``) onto its fused experts;
    transformers' stacked ``mlp.experts.gate_up_proj`` is none of them. The engine declares the
    checkpoint layout, and the sender the driver builds for it asks the policy ranks for it."""
    from types import SimpleNamespace

    from nrl_core.generation import GenerationEngines
    from nrl_core.weight_sync import CHECKPOINT

    assert SglangConfig.weight_layout == CHECKPOINT
    group = SimpleNamespace(num_workers=1, actors=[], timeout_s=5.0)
    engines = GenerationEngines(group, layout=SglangConfig().weight_layout)
    assert engines.sender().layout == CHECKPOINT
