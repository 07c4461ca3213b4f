"""Refit messages through vLLM 0.32's real RPC serialisation, without vLLM installed.

With the default ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``LLM.collective_rpc`` does not call the
workers directly: the engine-core client msgpack-encodes the call for the engine-core process
(``vllm/v1/engine/core_client.py:1010-1014``, ``:1091-1098``), which decodes it untyped and
hands the arguments to its executor. :class:`VllmRpcWire` below is that trip with vLLM's own
msgspec settings (read from vLLM 0.32.0's ``vllm/v1/serial_utils.py``); msgspec is the library
vLLM uses. The refit bytes travel through real shared-memory segments, into a real (tiny)
Hugging Face model.
"""

from __future__ import annotations

import contextlib
import pickle
import uuid
from multiprocessing import shared_memory
from typing import Any

import msgspec
import pytest
import torch
from nrl_vllm.config import VllmConfig
from nrl_vllm.extension import NrlWeightReceiver
from nrl_vllm.worker import VllmGenerationWorker

from nrl_core.interfaces import SamplingParams
from nrl_core.weight_sync import (
    BucketMeta,
    CudaIpcHandle,
    NcclBroadcastHandle,
    SharedMemoryHandle,
    WeightSyncError,
    bucket_layout,
    handle_from_wire,
    handle_to_wire,
    iter_buckets,
    pack_bucket,
    receive_into,
    unpack_bucket,
)

pytestmark = pytest.mark.gpu_sim


# -- vLLM 0.32's utility-call serialisation ----------------------------------------------------


def _vllm_enc_hook(obj: Any) -> Any:
    """``MsgpackEncoder.enc_hook`` (serial_utils.py:190-234) for what a refit message could hold:
    vLLM encodes tensors, ndarrays, slices and its multimodal types itself (none is in a refit
    message), and without VLLM_ALLOW_INSECURE_SERIALIZATION refuses everything else with this
    TypeError (serial_utils.py:220-225); nrl never turns pickling on."""
    raise TypeError(
        f"Object of type {type(obj)} is not serializable"
        "Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization."
    )


def _vllm_ext_hook(code: int, data: memoryview) -> Any:
    """``MsgpackDecoder.ext_hook``: only vLLM's own tensor/pickle extension codes exist, and a
    refit message must produce none."""
    raise AssertionError(f"unexpected msgpack extension type {code} in a refit message")


class VllmRpcWire:
    """One ``collective_rpc`` round trip between vLLM 0.32's engine-core client and engine core.

    Encoder: ``msgspec.msgpack.Encoder(enc_hook=...)`` as ``MsgpackEncoder.__init__`` builds it
    (serial_utils.py:155). Decoder: the engine core's ``generic_decoder`` is a
    ``MsgpackDecoder`` without a type (core.py:1843), i.e. an untyped
    ``msgspec.msgpack.Decoder(ext_hook=..., dec_hook=...)`` (serial_utils.py:330-333; the
    dec_hook is never called by an untyped decoder). The frame is the one
    ``SyncMPClient.call_utility`` sends: ``(client_index, call_id, method, args)`` with
    ``args = (method, timeout, args, kwargs)`` of ``collective_rpc`` (core_client.py:1014,
    :1098), unpacked as ``EngineCore._handle_client_request`` does (core.py:1687-1695). The
    result goes back as ``UtilityResult`` = ``(None, result)`` (serial_utils.py:211-214).
    """

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_vllm_enc_hook)
        self.decoder = msgspec.msgpack.Decoder(ext_hook=_vllm_ext_hook)

    def request(
        self, method: str, timeout: float | None, args: tuple, kwargs: dict | None
    ) -> tuple[str, float | None, Any, Any]:
        """What the engine core's ``collective_rpc`` receives for one client call."""
        frame = (0, uuid.uuid1().int >> 64, "collective_rpc", (method, timeout, args, kwargs))
        _client, _call_id, utility, utility_args = self.decoder.decode(self.encoder.encode(frame))
        assert utility == "collective_rpc"
        return tuple(utility_args)  # type: ignore[return-value]

    def result(self, value: Any) -> Any:
        """What the client gets back for a utility result."""
        _type_info, decoded = self.decoder.decode(self.encoder.encode((None, value)))
        return decoded


class StandInLLM:
    """The two calls of ``vllm.LLM`` 0.32 that a refit makes, over :class:`VllmRpcWire`:
    ``collective_rpc(method, timeout, args, kwargs)`` (entrypoints/llm.py:574-580) reaches each
    tensor-parallel worker as the ``mp`` executor sends it (pickled through its shared-memory
    queue, v1/executor/multiproc_executor.py:427) and calls it as ``run_method`` does
    (serial_utils.py:485-508); ``reset_prefix_cache`` (entrypoints/llm.py:829) is counted."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.wire = VllmRpcWire()
        self.prefix_cache_resets = 0

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        method, timeout, args, kwargs = self.wire.request(method, timeout, args, kwargs)
        results = []
        for worker in self.workers:
            w_args, w_kwargs = pickle.loads(pickle.dumps((args, kwargs or {})))
            results.append(getattr(worker, method)(*w_args, **w_kwargs))
        return self.wire.result(results)

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        self.prefix_cache_resets += 1
        return True


# -- a vLLM worker's model, on CPU ---------------------------------------------------------------


class HfWithLoadWeights:
    """A Hugging Face model with the ``load_weights(weights)`` method of vLLM's model classes
    (e.g. vllm/model_executor/models/llama.py:559: an iterable of ``(name, tensor)``, returning the
    loaded names), which HF models lack; here names are the HF ones, with no fusing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.hf = model

    def named_parameters(self):
        return self.hf.named_parameters()

    def load_weights(self, weights) -> set[str]:
        state = self.hf.state_dict()
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)
                loaded.add(name)
        return loaded


class TinyVllmWorker(NrlWeightReceiver):
    """What the extension reads from vLLM's GPU worker (``model_runner.model``, ``device``,
    ``rank``: vllm/v1/worker/gpu_worker.py), with a CPU model and ``device=None``."""

    def __init__(self, model: torch.nn.Module, rank: int = 0) -> None:
        self.model_runner = type("ModelRunner", (), {})()
        self.model_runner.model = HfWithLoadWeights(model)
        self.device = None
        self.rank = rank
        self.reloads = 0

    # vLLM's layerwise reload needs vLLM's model classes; the real one runs in
    # test_vllm_cpu.py (vLLM's CPU build). Here: counted, so the RPC order is checked.
    def nrl_start_reload(self) -> None:
        self.reloads += 1

    def nrl_finish_reload(self) -> None:
        self.reloads += 1


def _hf_model(path, seed: int | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


@contextlib.contextmanager
def shm_bucket(tensors: dict[str, torch.Tensor]):
    """A bucket packed into a fresh shared-memory segment, as ``nrl_core.weight_sync.shm.send_shm`` does;
    yields its meta and handle and unlinks the segment afterwards."""
    meta = bucket_layout(tensors)
    shm = shared_memory.SharedMemory(create=True, size=max(1, meta.nbytes))
    try:
        view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes)
        pack_bucket(tensors, out=view)
        del view
        yield meta, SharedMemoryHandle(shm.name)
    finally:
        shm.close()
        shm.unlink()


def cuda_ipc_args(flat: torch.Tensor, device: int = 0) -> tuple:
    """``reduce_tensor(flat)[1]`` as torch returns it for a CUDA tensor
    (torch/multiprocessing/reductions.py:339-375: ``type(tensor)``, size, stride, storage offset,
    ``type(tensor._typed_storage())``, dtype, then the 8 values of ``storage._share_cuda_()``
    with ``requires_grad`` after the first 4). Built from a CPU tensor, since ``_share_cuda_``
    needs a GPU: the ``_share_cuda_`` values stand in for a real GPU's."""
    storage = flat._typed_storage()
    return (
        type(flat),
        flat.size(),
        flat.stride(),
        flat.storage_offset(),
        type(storage),
        flat.dtype,
        device,  # storage_device
        bytes(range(64)),  # storage_handle: the allocation's cudaIpcMemHandle
        1 << 20,  # storage_size_bytes
        4096,  # storage_offset_bytes: the storage's offset in that allocation
        flat.requires_grad,
        b"/torch_4242_1234567_0",  # ref_counter_handle: the ref-counter file
        7,  # ref_counter_offset
        b"\xee" * 64,  # event_handle: a cudaIpcEventHandle
        True,  # event_sync_required
    )


# -- the messages, through vLLM's wire -------------------------------------------------------


def _through_vllm(*args: Any) -> list:
    """``args`` as the worker's extension method receives them from ``collective_rpc``."""
    _method, _timeout, received, _kwargs = VllmRpcWire().request("nrl_x", None, args, None)
    return received


def test_attrs_messages_do_not_survive_vllm_rpc():
    """Why the wire form exists: sent as they are, the bucket meta and shm/nccl handles arrive
    as plain dicts (no ``open``, no ``nbytes``), and a CUDA IPC handle cannot be sent at all."""
    meta = bucket_layout({"w": torch.zeros(3)})
    got_meta, got_shm, got_nccl = _through_vllm(
        meta, SharedMemoryHandle("nrl-x"), NcclBroadcastHandle("g")
    )
    assert isinstance(got_meta, dict) and isinstance(got_shm, dict) and isinstance(got_nccl, dict)
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'open'"):
        receive_into(got_meta, got_shm, lambda named: None)
    ipc = CudaIpcHandle({"GPU-0": cuda_ipc_args(torch.empty(16, dtype=torch.uint8))})
    with pytest.raises(TypeError, match="is not serializable"):
        _through_vllm(meta, ipc)


def test_meta_and_shm_handle_survive_vllm_rpc_and_open_the_same_bytes(tiny_model_path):
    state = {
        k: v.detach().clone() for k, v in _hf_model(tiny_model_path, seed=3).state_dict().items()
    }
    some = dict(list(state.items())[:5])
    some["int_buffer"] = torch.arange(7, dtype=torch.int64)
    some["bf16"] = state["model.norm.weight"].to(torch.bfloat16)
    with shm_bucket(some) as (meta, handle):
        wire_meta, wire_handle = _through_vllm(meta.to_wire(), handle_to_wire(handle))
        got_meta, got_handle = BucketMeta.from_wire(wire_meta), handle_from_wire(wire_handle)
        assert got_meta == meta and isinstance(got_handle, SharedMemoryHandle)
        original = bytes(handle.open(meta).numpy())
        handle.close()
        flat = got_handle.open(got_meta)
        try:
            assert bytes(flat.numpy()) == original
            views = unpack_bucket(flat, got_meta)
            assert list(views) == list(some)
            assert all(
                views[k].dtype == v.dtype and torch.equal(views[k], v) for k, v in some.items()
            )
        finally:
            views = flat = None  # unmap before the segment goes
            got_handle.close()


def test_cuda_ipc_handle_survives_vllm_rpc_with_torch_rebuild_arguments():
    """Every argument of torch's ``rebuild_cuda_tensor`` comes back as ``reduce_tensor`` made
    it, classes and dtype included; ``open`` swaps only the device index (on CPU it cannot run:
    it maps GPU memory)."""
    flat = torch.empty(1 << 10, dtype=torch.uint8)
    handle = CudaIpcHandle({"GPU-aaaa": cuda_ipc_args(flat), "GPU-bbbb": cuda_ipc_args(flat, 1)})
    (wire,) = _through_vllm(handle_to_wire(handle))
    got = handle_from_wire(wire)
    assert isinstance(got, CudaIpcHandle) and set(got.by_gpu) == {"GPU-aaaa", "GPU-bbbb"}
    for gpu, sent in handle.by_gpu.items():
        rebuilt = got.by_gpu[gpu]
        assert rebuilt == sent  # torch.Size([1024]) == (1024,)
        assert rebuilt[0] is torch.Tensor and rebuilt[4] is torch.storage.TypedStorage
        assert rebuilt[5] is torch.uint8 and type(rebuilt[1]) is tuple
        assert [type(v) for v in rebuilt[6:]] == [type(v) for v in sent[6:]]


def test_nccl_handle_survives_vllm_rpc():
    (wire,) = _through_vllm(handle_to_wire(NcclBroadcastHandle("nrl-refit")))
    got = handle_from_wire(wire)
    assert got == NcclBroadcastHandle("nrl-refit")
    with pytest.raises(WeightSyncError, match="nrl-refit"):
        got.open(bucket_layout({"w": torch.zeros(2)}))


def test_extension_loads_a_wire_form_bucket_and_refuses_attrs_objects(tiny_model_path):
    source = _hf_model(tiny_model_path, seed=1)
    worker = TinyVllmWorker(_hf_model(tiny_model_path, seed=2))
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    assert not torch.equal(
        worker.model_runner.model.hf.state_dict()["lm_head.weight"], state["lm_head.weight"]
    )
    with shm_bucket(state) as (meta, handle):
        wire_meta, wire_handle = _through_vllm(meta.to_wire(), handle_to_wire(handle))
        assert worker.nrl_receive_bucket(wire_meta, wire_handle) == meta.payload_bytes
        # The old message, after vLLM's trip: one line naming what to send instead.
        old_meta, old_handle = _through_vllm(meta, handle)
        with pytest.raises(WeightSyncError, match=r"malformed bucket handle.*handle_to_wire"):
            worker.nrl_receive_bucket(old_meta, old_handle)
    loaded = worker.model_runner.model.hf.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    checksum = worker.nrl_weights_checksum()
    assert checksum == {n: float(p.detach().double().sum()) for n, p in source.named_parameters()}


def _engine_actor(llm: StandInLLM) -> VllmGenerationWorker:
    """The engine actor around ``llm``: ``__init__`` builds a real ``vllm.LLM`` (not installed
    here), so the fields it sets for a separate-GPU engine are set here."""
    worker = object.__new__(VllmGenerationWorker)
    worker.options = VllmConfig(colocated=False)
    worker.engine, worker._loop, worker.rank = llm, None, 0
    worker.sleeping_tags, worker.on_cpu, worker.emulating = set(), False, False
    worker.engine_died = None  # the engine-core watcher's verdict: alive
    return worker


def test_engine_actor_refit_reaches_every_tp_worker_through_vllm_rpc(tiny_model_path):
    """The engine actor's refit (``update_weights`` -> ``receive_bucket`` -> ``collective_rpc``)
    loads bit-identical weights on both tensor-parallel workers of an engine; on 6afd7ff the
    workers got dicts and failed in ``handle.open``."""
    source = _hf_model(tiny_model_path, seed=1)
    workers = [TinyVllmWorker(_hf_model(tiny_model_path, seed=2), rank=r) for r in range(2)]
    llm = StandInLLM(workers)
    engine = _engine_actor(llm)
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    before = workers[1].model_runner.model.hf.state_dict()
    assert not any(torch.equal(before[k], v) for k, v in state.items())
    received = engine.update_weights(iter_buckets(state.items(), 256 << 10))
    assert received == sum(t.numel() * t.element_size() for t in state.values())
    for worker in workers:
        loaded = worker.model_runner.model.hf.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert llm.prefix_cache_resets == 1
    assert [w.reloads for w in workers] == [2, 2]  # begin and finish on every TP worker
    sums = engine.weights_checksum()
    assert sums == {n: float(p.detach().double().sum()) for n, p in source.named_parameters()}


@pytest.mark.gpu_sim
def test_refit_streams_the_checkpoint_layout_vllms_loader_takes():
    """vLLM's ``load_weights`` (Qwen3-MoE: ``FusedMoE.make_expert_params_mapping`` with
    ``ckpt_gate_proj_name="gate_proj"``...) places per-expert checkpoint names
    ``mlp.experts.{e}.gate_proj.weight`` only; transformers' stacked
    ``mlp.experts.gate_up_proj`` matches none of its parameters. The engine declares the
    checkpoint layout, and the sender the driver builds for it asks the policy ranks for it."""
    from types import SimpleNamespace

    from nrl_core.generation import GenerationEngines
    from nrl_core.weight_sync import CHECKPOINT

    assert VllmConfig.weight_layout == CHECKPOINT
    group = SimpleNamespace(num_workers=1, actors=[], timeout_s=5.0)
    engines = GenerationEngines(group, layout=VllmConfig().weight_layout)
    assert engines.sender().layout == CHECKPOINT


# -- sleep mode emulated by the worker extension (NRL_MEMORY_CONTRACT=1 on vLLM's CPU build) -----


class GeneratingStandInLLM(StandInLLM):
    """:class:`StandInLLM` that also generates (nothing: the contract is checked before)."""

    def generate(self, inputs, sampling, use_tqdm=False) -> list:
        return []


@pytest.mark.gpu_sim
def test_the_extension_emulates_a_deep_sleep_on_cpu(tiny_model_path):
    """vLLM's CPU worker ignores sleep; under the memory contract the engine actor sends its
    sleep and wake-ups to nrl's extension, which loses the weights at level 2 (NaN), refuses a
    generate until a refit restores them, and refuses to wake an awake tag."""
    from types import SimpleNamespace

    from nrl_core.memory_contract import MemoryContractError

    source = _hf_model(tiny_model_path, seed=1)
    tp_worker = TinyVllmWorker(_hf_model(tiny_model_path, seed=1))
    engine = _engine_actor(GeneratingStandInLLM([tp_worker]))
    engine.options = VllmConfig(colocated=True, sleep_level=2)
    engine.on_cpu, engine.emulating = True, True
    engine._vllm = SimpleNamespace(SamplingParams=dict)
    params = SamplingParams(max_new_tokens=1)

    assert engine.sleep() is False
    model = tp_worker.model_runner.model.hf
    assert all(torch.isnan(p).all() for p in model.parameters())
    with pytest.raises(MemoryContractError, match="weights dropped at sleep"):
        engine.generate([[1]], params)  # woke both tags; the weights are still lost
    engine.sleep()
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    engine.update_weights(iter_buckets(state.items(), 256 << 10))
    assert tp_worker.nrl_memory.sleeping == {"kv_cache"}
    engine.generate([[1]], params)  # refitted: valid, and the KV cache woke
    assert not torch.isnan(next(model.parameters())).any()
    with pytest.raises(MemoryContractError, match="while \\['kv_cache'\\] is awake"):
        engine.engine.collective_rpc("nrl_wake_up", args=(["kv_cache"],))
