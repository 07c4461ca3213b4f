"""broadcast_named_tensors and load_stream_into between two real gloo ranks (spawned
processes): rank 0's tensors reach rank 1 bit for bit, in order and in their own dtype, and each
rank keeps exactly its shard of a DTensor, cast to the shard's dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nrl_core.distributed.read_once import broadcast_named_tensors, load_stream_into
from nrl_core.testing.ranks import gloo_world

# Spawned gloo ranks (a multi-process run): the slow tier (docs/testing.md).
pytestmark = pytest.mark.slow


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "ids": torch.arange(11, dtype=torch.int64),
        "proj": torch.randn(6, 4, generator=g).to(torch.bfloat16),
    }


def _ranks(rank: int, world: int, store: str, out: str) -> None:
    with gloo_world(rank, world, store):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        source = _source() if rank == 0 else None
        received = [(n, t.clone()) for n, t in broadcast_named_tensors(source)]
        mesh = init_device_mesh("cpu", (world,))
        # float32 targets: a sharded one (7 rows over 2 ranks: uneven), a plain one.
        targets = {
            "embed": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]),
            "proj": torch.zeros(6, 4),
        }
        targets["absent"] = torch.zeros(2)
        report = load_stream_into(targets, broadcast_named_tensors(source))
        torch.save(
            {
                "received": received,
                "unknown": report.unknown,
                "missing": report.missing,
                "embed_local": targets["embed"].to_local().clone(),
                "embed_full": targets["embed"].full_tensor(),
                "proj": targets["proj"],
            },
            f"{out}/rank{rank}.pt",
        )


def test_two_ranks_receive_rank0s_tensors_and_keep_their_shards(tmp_path: Path):
    mp.spawn(_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    source = _source()
    for result in results:
        names = [n for n, _ in result["received"]]
        assert names == list(source)
        for name, tensor in result["received"]:
            assert tensor.dtype == source[name].dtype
            assert torch.equal(tensor, source[name])
        assert result["unknown"] == {"scalar", "ids"}
        assert result["missing"] == {"absent"}
        expected_embed = source["embed"].float()
        assert torch.equal(result["embed_full"], expected_embed)
        assert torch.equal(result["proj"], source["proj"].float())
    # Each rank holds its own rows only (torch's uneven split: 4 and 3).
    assert torch.equal(results[0]["embed_local"], source["embed"].float()[:4])
    assert torch.equal(results[1]["embed_local"], source["embed"].float()[4:])
