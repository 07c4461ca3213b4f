"""HostAllReduce between real gloo ranks (spawned processes): the shared-memory path gives
gloo's sums on every rank, and every case shared memory cannot serve falls back to gloo on all
ranks together."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nrl_core.distributed.host_all_reduce import HostAllReduce
from nrl_core.testing.ranks import gloo_world

# Spawned gloo ranks (a multi-process run): the slow tier (docs/testing.md).
pytestmark = pytest.mark.slow


def _sizes_and_dtypes():
    # Growth (a collective re-mapping) on the third call; odd sizes; an integer dtype.
    return (
        [(1000, torch.float32)] * 2
        + [(5003, torch.float32), (77, torch.int64)]
        + [(3000, torch.float32)] * 4
    )


def _no_gloo_barrier(*args, **kwargs):
    raise AssertionError("a barrier went through gloo; the ranks wait on their pipes")


def _ranks(rank: int, world: int, store: str, shm_dirs: list[str], out: str) -> None:
    with gloo_world(rank, world, store):
        # A gloo barrier is a TCP round trip (1-2 ms on a busy machine): no call may use one.
        dist.barrier = _no_gloo_barrier
        reduce = HostAllReduce(shm_dir=Path(shm_dirs[rank]))
        results = []
        for call, (numel, dtype) in enumerate(_sizes_and_dtypes()):
            g = torch.Generator().manual_seed(1000 * call + rank)
            x = torch.randn(numel, generator=g).mul(100).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            got = reduce(x.clone())
            results.append((got, expected))
        coalesced = []
        for call in range(4):
            g = torch.Generator().manual_seed(7000 + 100 * call + rank)
            parts = [torch.randn(n, generator=g) for n in (300, 1, 4096 * (call + 1))]
            parts.append(torch.randn(5, 7, generator=g))  # not flat: taken row by row
            expected = torch.cat([t.reshape(-1) for t in parts])
            dist.all_reduce(expected)
            expected.div_(world)
            # One rank comes late, so the other waits at the barriers.
            time.sleep(0.05 if (call + rank) % 2 else 0.0)
            before = [t.clone() for t in parts]
            got = reduce.sum_coalesced(parts, divide_by=world)
            unchanged = all(torch.equal(a, b) for a, b in zip(parts, before, strict=True))
            coalesced.append((got, expected, unchanged))
        torch.save(
            {"shared": reduce.shared, "results": results, "coalesced": coalesced},
            f"{out}/rank{rank}.pt",
        )


def _run(tmp_path: Path, world: int, shm_dirs: list[Path]) -> list[dict]:
    for d in shm_dirs:
        if d.name != "missing":
            d.mkdir(parents=True, exist_ok=True)
    mp.spawn(
        _ranks,
        args=(world, str(tmp_path / "store"), [str(d) for d in shm_dirs], str(tmp_path)),
        nprocs=world,
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_two_ranks_get_gloos_exact_sums_through_shared_memory(tmp_path):
    shm = tmp_path / "shm"
    ranks = _run(tmp_path, 2, [shm, shm])
    assert [r["shared"] for r in ranks] == [True, True]
    for r in ranks:
        for got, expected in r["results"]:
            # a + b is the same bits in either order: gloo's exact result.
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        # Taken as one tensor and averaged: gloo's bits too (the division is the same one),
        # with the inputs left as they were.
        for got, expected, unchanged in r["coalesced"]:
            assert torch.equal(got, expected) and unchanged
    # Every buffer file and pipe was unlinked once opened.
    assert list(shm.iterdir()) == []


def test_three_ranks_agree_bit_for_bit(tmp_path):
    shm = tmp_path / "shm"
    ranks = _run(tmp_path, 3, [shm] * 3)
    assert [r["shared"] for r in ranks] == [True] * 3
    for call in range(len(_sizes_and_dtypes())):
        got = [r["results"][call][0] for r in ranks]
        expected = ranks[0]["results"][call][1]
        # Summation order may differ from gloo's with three ranks, never between ranks.
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
        torch.testing.assert_close(got[0], expected, rtol=1e-6, atol=1e-4)
    for call in range(len(ranks[0]["coalesced"])):
        got = [r["coalesced"][call][0] for r in ranks]
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
        torch.testing.assert_close(got[0], ranks[0]["coalesced"][call][1])
    assert list(shm.iterdir()) == []


@pytest.mark.parametrize("case", ["one rank without the directory", "separate hosts"])
def test_every_rank_falls_back_to_gloo_when_one_cannot_share(tmp_path, case):
    if case == "one rank without the directory":
        dirs = [tmp_path / "shm", tmp_path / "missing"]
    else:
        # Different /dev/shm per rank, as on two hosts: no rank finds its peer's file.
        dirs = [tmp_path / "host0", tmp_path / "host1"]
    ranks = _run(tmp_path, 2, dirs)
    assert [r["shared"] for r in ranks] == [False, False]
    for r in ranks:
        for got, expected in r["results"]:
            assert torch.equal(got, expected)
        for got, expected, unchanged in r["coalesced"]:
            assert torch.equal(got, expected) and unchanged
    for d in dirs:
        assert not d.exists() or list(d.iterdir()) == []
