"""The refit process group (:func:`nrl_core.weight_sync.init_nccl_group`) meets its members.

On a GPU the trainer's rank 0 builds the group with ``init_nccl_group`` while SGLang engine ranks
build theirs with SGLang 0.5.23's ``init_custom_process_group`` (vLLM engine ranks call
``init_nccl_group`` too). The ranks only meet when both sides put the backend's rendezvous keys
under the same store prefixes, which does not depend on the backend: here the groups use gloo
on CPU, with the same store layout as NCCL, between this test process (rank 0, the trainer) and
a second Python process (rank 1, the engine).
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from nrl_core.weight_sync import (
    _NCCL_GROUPS,
    destroy_nccl_group,
    init_nccl_group,
    iter_buckets,
    pack_bucket,
)

TIMEOUT_S = 25
"""Bound on each rendezvous: a group whose ranks never meet fails within it."""

# The engine rank as SGLang 0.5.23 builds it: the torch calls of init_custom_process_group
# (sglang/srt/utils/common.py:2859-2927, reached from WeightUpdater.init_weights_update_group,
# model_executor/model_runner_components/weight_updater.py:100-144, with
# init_method=f"tcp://{addr}:{port}") and then its per-tensor receive
# (receive_weights_from_distributed, weight_updater.py:280-298). Only the backend (gloo) and the
# timeout differ. It prints the sha256 of each received tensor.
SGLANG_RANK = textwrap.dedent(
    """
    import hashlib, json, sys
    from datetime import timedelta
    import torch
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)

    addr, port, rank, world, name, timeout, specs = sys.argv[1:8]
    timeout = timedelta(seconds=float(timeout))
    store, rank, world = next(rendezvous(
        f"tcp://{addr}:{port}", int(rank), int(world), timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), store, group_name=name,
        backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    received, works = [], []
    for dtype, shape in json.loads(specs):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        works.append(torch.distributed.broadcast(t, src=0, group=pg, async_op=True))
        received.append(t)
    for w in works:
        w.wait()
    print(json.dumps([
        hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for t in received]))
    """
)

# A vLLM engine rank: nrl's own init_nccl_group on the engine side (plugins/nrl-vllm/src/
# nrl_vllm/extension.py: nrl_init_nccl_group) and the packed-bucket receive of
# NcclBroadcastHandle. It prints the sha256 of the received buffer.
NRL_RANK = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from nrl_core.weight_sync import BucketMeta, NcclBroadcastHandle, init_nccl_group

    addr, port, rank, world, name, timeout, nbytes = sys.argv[1:8]
    init_nccl_group(name, addr, int(port), int(rank), int(world), backend="gloo",
                    timeout_s=float(timeout))
    flat = NcclBroadcastHandle(name).open(BucketMeta((), int(nbytes)), "cpu")
    print(json.dumps(hashlib.sha256(flat.numpy()).hexdigest()))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def bucket(tiny_model_path):
    """A real refit bucket: the first few tensors of the tiny model, bfloat16 as engines get."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return next(iter_buckets(state.items(), 1 << 16))


def _run_pair(script: str, extra: str, send) -> str:
    """Start the engine rank (rank 1) in a second process, join as rank 0 with
    ``init_nccl_group(backend="gloo")``, run ``send(pg)`` and return what the engine printed."""
    name, port = f"nrl-refit-{uuid.uuid4().hex[:6]}", _free_port()
    args = ["127.0.0.1", str(port), "1", "2", name, str(TIMEOUT_S), extra]
    engine = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        init_nccl_group(name, "127.0.0.1", port, 0, 2, backend="gloo", timeout_s=TIMEOUT_S)
        send(_NCCL_GROUPS[name])
        out, err = engine.communicate(timeout=2 * TIMEOUT_S)
        assert engine.returncode == 0, (out[-500:], err[-2000:])
        return json.loads(out.strip().splitlines()[-1])
    finally:
        destroy_nccl_group(name)
        if engine.poll() is None:
            engine.kill()
            engine.communicate()


@pytest.mark.gpu_sim
def test_trainer_group_meets_sglang_engine_ranks(bucket):
    """Rank 0 from init_nccl_group, rank 1 as SGLang builds it: each tensor of a real bucket,
    broadcast one by one as WeightSender does for SGLang, arrives bit-exact."""
    specs = json.dumps(
        [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in bucket.values()]
    )

    def send(pg):
        for tensor in bucket.values():
            pg.broadcast(tensor.contiguous(), 0).wait()

    assert _run_pair(SGLANG_RANK, specs, send) == [_sha(t) for t in bucket.values()]


@pytest.mark.gpu_sim
def test_trainer_group_meets_nrl_engine_ranks(bucket):
    """Both ranks from init_nccl_group (the vLLM engine side): a packed bucket arrives bit-exact
    through NcclBroadcastHandle.open, and the engine process, which leaves its group to the
    interpreter's exit, exits cleanly (exit status 0 checked in _run_pair)."""
    flat, meta = pack_bucket(bucket)
    received = _run_pair(NRL_RANK, str(meta.nbytes), lambda pg: pg.broadcast(flat, 0).wait())
    assert received == hashlib.sha256(flat.numpy()).hexdigest()


def test_unknown_backend_is_refused():
    from nrl_core.weight_sync import WeightSyncError

    with pytest.raises(WeightSyncError, match="backend 'mpi'"):
        init_nccl_group("x", "127.0.0.1", _free_port(), 0, 1, backend="mpi")
