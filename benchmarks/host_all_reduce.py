"""The gradient all-reduce of replicated CPU ranks: gloo's against nrl's shared-memory one.

Spawns ``--ranks`` gloo processes (one thread each) and times, in the same run, the in-place
sum of one float32 tensor of ``--numel`` elements (default 3.2M: about the gradients of the GRPO
benchmarks' 3.17M-parameter model) through ``dist.all_reduce`` and through
:class:`nrl_core.distributed.host_all_reduce.HostAllReduce`. Prints both medians and the ratio.

    uv run python benchmarks/host_all_reduce.py [--ranks 2] [--numel N] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nrl_core.distributed.host_all_reduce import HostAllReduce


def _rank(rank: int, world: int, store: str, numel: int, calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    reduce = HostAllReduce()
    x = torch.randn(numel)
    medians = {}
    for label, fn in [("gloo", dist.all_reduce), ("shared memory", reduce)]:
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
        medians[label] = statistics.median(times[5:])
    if rank == 0:
        assert reduce.shared, "shared memory was refused on this host"
        gloo, shm = medians["gloo"], medians["shared memory"]
        print(f"{world} ranks, {numel} float32 ({numel * 4 / 1e6:.1f} MB), median of {calls - 5}")
        print(f"gloo_ms={gloo * 1e3:.2f} shm_ms={shm * 1e3:.2f} ratio={shm / gloo:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=3_200_000)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _rank, args=(args.ranks, f"{tmp}/store", args.numel, args.calls), nprocs=args.ranks
        )


if __name__ == "__main__":
    main()
