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
