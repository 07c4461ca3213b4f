"""Weight sync: bucket packing of a real tiny model, name mapping, refit stats, and the
shared-memory transport end to end between two Ray actors."""

from __future__ import annotations

import pytest
import torch

from nrl_core.weight_sync import (
    NameMap,
    RefitStats,
    SharedMemoryHandle,
    WeightSender,
    WeightSyncError,
    bucket_layout,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)


@pytest.fixture(scope="module")
def tiny_state(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip_is_bit_exact(tiny_state, dtype):
    state = {k: v.to(dtype) for k, v in tiny_state.items()}
    state["int.ids"] = torch.arange(7, dtype=torch.int64)  # odd sizes and non-float dtypes
    state["odd.bytes"] = torch.ones(3, dtype=torch.uint8)
    flat, meta = pack_bucket(state)
    assert flat.dtype == torch.uint8 and flat.numel() == meta.nbytes
    assert all(t.offset % 16 == 0 for t in meta.tensors)
    out = unpack_bucket(flat, meta)
    assert list(out) == list(state)
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(_bits(out[name]), _bits(tensor)), name


def test_round_trip_through_buckets_covers_the_whole_model(tiny_state):
    total = sum(t.numel() * t.element_size() for t in tiny_state.values())
    bucket_bytes = total // 5
    buckets = list(iter_buckets(tiny_state.items(), bucket_bytes))
    assert len(buckets) >= 5
    rebuilt = {}
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for t in bucket.values()) <= (
            bucket_bytes
        )
        flat, meta = pack_bucket(bucket)
        rebuilt.update({k: v.clone() for k, v in unpack_bucket(flat, meta).items()})
    assert rebuilt.keys() == tiny_state.keys()
    assert all(torch.equal(rebuilt[k], tiny_state[k]) for k in tiny_state)
    assert sum(bucket_layout(b).payload_bytes for b in buckets) == total


def test_unpack_rejects_a_short_buffer(tiny_state):
    flat, meta = pack_bucket(dict(list(tiny_state.items())[:2]))
    with pytest.raises(WeightSyncError, match="uint8 bytes"):
        unpack_bucket(flat[:-16], meta)


def test_name_map_renames_prefixes_and_drops():
    mapping = NameMap(
        rename={"lm_head.weight": "output.weight"},
        prefixes=(("model.", "decoder."),),
        drop=frozenset({"decoder.rotary_emb.inv_freq"}),
    )
    bucket = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(1),
        "lm_head.weight": torch.zeros(1),
        "model.rotary_emb.inv_freq": torch.zeros(1),
    }
    assert list(mapping.apply(bucket)) == [
        "decoder.layers.0.self_attn.q_proj.weight",
        "output.weight",
    ]


def test_refit_stats_metrics():
    metrics = RefitStats(seconds=0.5, bytes=2_000_000_000, buckets=4, tensors=10).as_metrics()
    assert metrics["timing/refit_s"] == 0.5
    assert metrics["refit/bytes"] == 2e9
    assert metrics["refit/gb_per_s"] == pytest.approx(4.0)


def test_unknown_transport_is_a_user_error():
    with pytest.raises(WeightSyncError, match="transport"):
        WeightSender(receivers=[], transport="carrier-pigeon")


def test_shared_memory_handle_pickles_to_its_name_only():
    import pickle

    handle = SharedMemoryHandle("nrl-abc")
    assert pickle.loads(pickle.dumps(handle)).name == "nrl-abc"
    with pytest.raises(WeightSyncError, match="same node"):
        handle.open(bucket_layout({"x": torch.zeros(2)}))


_PLAIN = (dict, list, str, int, bool, bytes, type(None))


def _plain_types(value) -> set[type]:
    """Every type inside ``value`` (dict keys and values, list items), recursively."""
    found = {type(value)}
    if isinstance(value, dict):
        for k, v in value.items():
            found |= _plain_types(k) | _plain_types(v)
    elif isinstance(value, list | tuple):
        for v in value:
            found |= _plain_types(v)
    return found


def _as_tuples(value):
    """``value`` with every list turned into a tuple and bytes into bytearray: what a
    transport that keeps tuples (pickle, an in-process call) or hands out buffers may deliver."""
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    return bytearray(value) if isinstance(value, bytes) else value


def _fake_ipc_args(device: int) -> tuple:
    """Rebuild arguments shaped like ``reduce_tensor``'s for a CUDA tensor (see
    plugins/nrl-vllm/tests/test_refit_wire.py::cuda_ipc_args); values stand in for a GPU's."""
    flat = torch.empty(64, dtype=torch.uint8)
    storage = flat._typed_storage()
    head = (torch.Tensor, flat.size(), flat.stride(), 0, type(storage), torch.uint8, device)
    return (*head, b"\x01" * 64, 4096, 0, False, b"/torch_1_2_0", 3, b"\x02" * 64, True)


@pytest.mark.gpu_sim
def test_cuda_ipc_wire_form_names_every_argument_of_torch_rebuild_cuda_tensor():
    """The wire form keeps exactly what torch's receiving side takes, in its order."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from nrl_core.weight_sync import CUDA_IPC_ARGS, CudaIpcHandle, handle_to_wire

    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == CUDA_IPC_ARGS
    wire = handle_to_wire(CudaIpcHandle({"GPU-a": _fake_ipc_args(0)}))
    assert set(wire["by_gpu"]["GPU-a"]) == set(CUDA_IPC_ARGS)


def test_refit_messages_have_a_plain_data_wire_form(tiny_state):
    """Meta and every handle become dicts of primitives only (no attrs objects, types or
    dtypes) and come back equal, whether lists arrive as lists or tuples, bytes as bytes or
    bytearray."""
    from nrl_core.weight_sync import (
        BucketMeta,
        CudaIpcHandle,
        NcclBroadcastHandle,
        handle_from_wire,
        handle_to_wire,
    )

    meta = bucket_layout(dict(list(tiny_state.items())[:4]))
    handles = [
        SharedMemoryHandle("nrl-abc"),
        NcclBroadcastHandle("nrl-refit"),
        CudaIpcHandle({"GPU-a": _fake_ipc_args(0), "GPU-b": _fake_ipc_args(1)}),
    ]
    wires = [meta.to_wire()] + [handle_to_wire(h) for h in handles]
    for wire in wires:
        assert _plain_types(wire) <= set(_PLAIN), wire
    for arrived in (wires, _as_tuples(wires)):
        assert BucketMeta.from_wire(arrived[0]) == meta
        rebuilt = [handle_from_wire(w) for w in arrived[1:]]
        assert [type(h) for h in rebuilt] == [type(h) for h in handles]
        assert rebuilt[0] == handles[0] and rebuilt[1] == handles[1]
        assert rebuilt[2].by_gpu == handles[2].by_gpu
        assert all(type(a[7]) is bytes for a in rebuilt[2].by_gpu.values())


def test_malformed_wire_messages_are_one_line_weight_sync_errors():
    from nrl_core.weight_sync import BucketMeta, CudaIpcHandle, handle_from_wire, handle_to_wire

    meta = bucket_layout({"w": torch.zeros(2)})
    with pytest.raises(WeightSyncError, match=r"malformed bucket meta.*BucketMeta.to_wire"):
        BucketMeta.from_wire({"tensors": [{"name": "w"}], "nbytes": 16})
    with pytest.raises(WeightSyncError, match=r"malformed bucket meta.*got BucketMeta"):
        BucketMeta.from_wire(meta)  # the object itself, not its wire form
    with pytest.raises(WeightSyncError, match=r"malformed bucket handle.*got dict"):
        handle_from_wire({"name": "nrl-abc"})  # an attrs handle after msgpack
    with pytest.raises(WeightSyncError, match="unknown transport 'pigeon'"):
        handle_from_wire({"transport": "pigeon"})
    with pytest.raises(WeightSyncError, match=r"unknown CUDA IPC tensor_cls 'os\.system'"):
        wire = handle_to_wire(CudaIpcHandle({"GPU-a": _fake_ipc_args(0)}))
        wire["by_gpu"]["GPU-a"]["tensor_cls"] = "os.system"
        handle_from_wire(wire)
    with pytest.raises(WeightSyncError, match="no wire form for a bucket handle of type str"):
        handle_to_wire("nrl-abc")


def test_shm_transport_between_two_ray_actors(ray_cluster, tiny_model_path, tiny_state):
    """A sender actor pushes its (differently initialised) weights into a receiver actor
    through /dev/shm; afterwards both hold bit-identical weights."""
    from nrl_core.distributed.worker_group import WorkerGroup

    target = "nrl_core.weight_sync:StateDictEndpoint"
    kwargs = dict(num_cpus_per_worker=0.5, timeout_s=180)
    source = WorkerGroup.start(target, 1, args=(str(tiny_model_path), 1), name="ws-src", **kwargs)
    sink = WorkerGroup.start(target, 1, args=(str(tiny_model_path), 2), name="ws-dst", **kwargs)
    try:
        before_src = source.run_one(0, "digest")
        before_dst = sink.run_one(0, "digest")
        assert before_src != before_dst
        sender = WeightSender(receivers=list(sink.actors), transport="shm")
        stats = source.run_one(0, "push_weights", sender, 64 << 10)
        assert isinstance(stats, RefitStats)
        assert stats.buckets > 1 and stats.seconds > 0
        assert stats.tensors == len(before_src)
        assert stats.bytes == sum(t.numel() * t.element_size() for t in tiny_state.values())
        assert sink.run_one(0, "digest") == before_src  # bit-identical after the refit
    finally:
        source.shutdown()
        sink.shutdown()


@pytest.mark.gpu_sim
@pytest.mark.parametrize("colocated", [True, False])
def test_cuda_ipc_handles_come_only_from_policy_ranks_that_feed_an_engine(colocated, monkeypatch):
    """With fewer colocated engines than policy ranks (here 1 engine, 2 ranks), only rank 0's
    GPU hosts an engine: rank 1 must share no CUDA IPC handle (no engine would open it, and
    torch keeps the block of an unopened handle alive: a full copy of the weights stranded on
    that GPU per refit) and pack no copy; rank 0's handle still reaches the engine. Separate
    engines (an explicit ``refit_transport=cuda_ipc``) sit on no policy GPU: no rank shares.
    The GPU steps (``pack_bucket`` onto the GPU, the device UUID, ``reduce_tensor``) are
    stand-ins; the sender the driver builds and its exchange between ranks are the real ones."""
    from types import SimpleNamespace

    import torch.multiprocessing.reductions as reductions

    from nrl_core.generation import GenerationEngines
    from nrl_core.weight_sync import cuda_ipc

    shared, packed, received = [], [], []

    def fake_pack(bucket):
        packed.append(sorted(bucket))
        flat = SimpleNamespace(device=torch.device("cuda", 0))
        return flat, bucket_layout(bucket)

    class Engine:  # a Ray actor handle's `call.remote`
        class call:
            @staticmethod
            def remote(method, args, kwargs):
                received.append((method, args))
                return None

    monkeypatch.setattr(cuda_ipc, "pack_bucket", fake_pack)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: shared.append(t) or (None, "args"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(uuid="g"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(WeightSender, "_wait", lambda self, refs: refs)
    group = SimpleNamespace(num_workers=1, actors=[Engine()], timeout_s=5.0)
    engines = GenerationEngines(group, transport="cuda_ipc", colocated=colocated)
    sender = engines.sender()
    bucket = {"w": torch.zeros(4)}

    def exchange(rank: int):
        """The all-gather between the two policy ranks, seen from ``rank``: the other rank
        contributes what the same sender decides for it."""
        other_shares = colocated and rank == 1  # the other rank is 0
        other = {"gpu-of-rank-0": "args"} if other_shares else {}
        sent = []

        def gather(obj):
            sent.append(obj)
            return [obj, other] if rank == 0 else [other, obj]

        return gather, sent

    gather, sent = exchange(1)
    sender.send([bucket], rank=1, gather_object=gather)
    assert shared == [] and packed == []  # no handle, no packed copy on rank 1's GPU
    assert sent == [{}, None]  # it still took part in the exchange and the barrier

    gather, sent = exchange(0)
    sender.send([bucket], rank=0, gather_object=gather)
    loads = [args for method, args in received if method == "receive_bucket"]
    assert len(loads) == 1
    handle = loads[0][1]
    if colocated:
        assert len(shared) == 1 and packed == [["w"]]
        assert handle.by_gpu == {"g": "args"}  # rank 0's copy, for the engine on its GPU
    else:
        assert shared == [] and packed == [] and handle.by_gpu == {}


# -- weight layouts (nrl_core.weight_sync.layout) -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The tiny Qwen3-MoE (4 experts, 2 layers) as transformers loads it, and its folder."""
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.tiny import tiny_model_path

    path = tiny_model_path(
        tmp_path_factory.mktemp("nrl-moe"), arch="qwen3_moe", hidden_size=64, num_layers=2
    )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), path


@pytest.mark.gpu_sim
def test_checkpoint_layout_streams_the_published_file_one_tensor_at_a_time(tiny_moe):
    """``in_layout(..., CHECKPOINT)`` turns transformers' in-memory state dict (experts stacked
    into ``mlp.experts.gate_up_proj`` / ``down_proj``) into the saved ``model.safetensors``,
    name for name and value for value, as it streams: each output comes from the one input
    tensor pulled last (nothing is read ahead or held back)."""
    from safetensors import safe_open

    from nrl_core.weight_sync import CHECKPOINT, IN_MEMORY, in_layout

    model, path = tiny_moe
    state = list(model.state_dict().items())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name, _ in state)
    pulled: list[str] = []

    def source():
        for name, tensor in state:
            pulled.append(name)
            yield name, tensor

    out = {}
    for name, tensor in in_layout(source(), CHECKPOINT, model):
        assert name not in out
        out[name] = tensor
        origin = pulled[-1]  # the tensor it came from: the last one pulled, nothing ahead
        if name != origin:
            # model.layers.L.mlp.experts.E.up_proj.weight of model.layers.L.mlp.experts.gate_up_proj
            assert origin.startswith(name.rsplit(".", 3)[0] + "."), (name, origin)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert sorted(out) == sorted(f.keys())
        for name in f.keys():  # noqa: SIM118
            assert torch.equal(out[name], f.get_tensor(name).to(out[name].dtype)), name
    assert len([n for n in out if ".mlp.experts." in n]) == 2 * 4 * 3
    assert dict(in_layout(iter(state), IN_MEMORY, model)).keys() == dict(state).keys()


def test_an_unknown_weight_layout_is_a_weight_sync_error(tiny_moe):
    from nrl_core.weight_sync import in_layout

    with pytest.raises(WeightSyncError, match="unknown weight layout 'disk'"):
        WeightSender(receivers=[], layout="disk")
    with pytest.raises(WeightSyncError, match="unknown weight layout 'disk'"):
        list(in_layout(iter([]), "disk", tiny_moe[0]))


# -- adapter-only LoRA refits (issue 52) ----------------------------------------------------------


def test_an_adapter_travels_inline_and_its_peft_folder_is_what_peft_loads(
    tiny_model_path, tmp_path
):
    """What an adapter refit carries (the inline bucket) gives back the adapter bit for bit,
    and the PEFT folder the core writes from it (safetensors, adapter_config.json) is one peft
    itself loads: the loaded model's logits equal the trainer's peft model's. An adapter with
    trained (non-zero) B is used, so a folder that loaded nothing would differ."""
    pytest.importorskip("peft", reason="peft is the `lora` extra of nrl-dtensor (a dev dependency)")
    import pickle

    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from nrl_core.weight_sync.adapters import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        LoraAdapter,
        inline_bucket,
        write_peft_folder,
    )
    from nrl_core.weight_sync.packing import receive_into

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

    targets = ("k_proj", "q_proj", "v_proj")
    trainer = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    tensors = get_peft_model_state_dict(trainer)
    adapter = LoraAdapter(rank=4, alpha=8.0, target_modules=targets, version=3)
    assert adapter.name == "nrl-lora-v3"

    meta, handle = inline_bucket(tensors)
    handle = pickle.loads(pickle.dumps(handle))  # as Ray carries it
    received = {}
    receive_into(meta, handle, lambda named: received.update((n, t.clone()) for n, t in named))
    assert received.keys() == tensors.keys()
    assert all(torch.equal(received[k], tensors[k]) for k in tensors)

    folder = write_peft_folder(tmp_path / adapter.name, received, adapter)
    assert sorted(p.name for p in folder.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    loaded = PeftModel.from_pretrained(base(), str(folder)).eval()
    ids = torch.tensor([[1, 5, 20, 21, 22, 30, 31]])
    with torch.no_grad():
        expected, got, plain = trainer(ids).logits, loaded(ids).logits, base()(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert (expected - plain).abs().max() > 1e-3  # the adapter changes the logits
