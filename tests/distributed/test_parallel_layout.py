"""The core's rank layout (``ParallelLayout``): which data shard, pipeline stage and expert
slice each rank has, and which rank returns each shard's result. Pure arithmetic, checked
against an enumeration of the documented order (Megatron-Core's: tp fastest, then cp, then dp,
then pp)."""

from __future__ import annotations

import itertools

import pytest

from nrl_core.distributed.worker_group import ParallelLayout
from nrl_core.errors import NrlError

LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2),
    ParallelLayout(pp=2),
    ParallelLayout(tp=2, pp=2),
    ParallelLayout(tp=2, cp=2, pp=2),
    ParallelLayout(pp=2, ep=2),
    ParallelLayout(cp=2, ep=4),
    ParallelLayout(tp=2, pp=2, ep=2),
]


def enumerate_ranks(layout: ParallelLayout, dp: int) -> list[dict[str, int]]:
    """Every rank's coordinates, in rank order, by nested loops (pp slowest, tp fastest)."""
    ranks = []
    for p, d, c, t in itertools.product(
        range(layout.pp), range(dp), range(layout.cp), range(layout.tp)
    ):
        ranks.append({"dp": d, "pp": p, "cp": c, "tp": t})
    return ranks


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_each_rank_knows_its_shard_stage_and_expert_slice(layout):
    dp = 4
    workers = dp * layout.model_parallel_size
    assert layout.dp_size(workers) == dp
    ranks = enumerate_ranks(layout, dp)
    assert len(ranks) == workers
    for rank, where in enumerate(ranks):
        assert layout.dp_rank(rank, workers) == where["dp"]
        assert layout.pp_rank(rank, workers) == where["pp"]
        assert layout.cp_rank(rank) == where["cp"]
        assert layout.tp_rank(rank) == where["tp"]
    # Expert parallelism splits the ranks that share the dense weights (same tp rank and
    # stage): each such group of dp * cp ranks holds every expert slice equally often.
    for t, p in itertools.product(range(layout.tp), range(layout.pp)):
        group = [r for r, w in enumerate(ranks) if (w["tp"], w["pp"]) == (t, p)]
        assert len(group) == dp * layout.cp
        slices = [layout.ep_rank(r, workers) for r in group]
        assert slices == [i % layout.ep for i in range(len(group))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_one_rank_per_shard_returns_it_from_the_last_stage(layout):
    dp = 3 if layout.ep == 1 else layout.ep  # a dp * cp the expert size divides
    ranks = enumerate_ranks(layout, dp)
    returning = [layout.result_rank(d, len(ranks)) for d in range(dp)]
    for d, rank in enumerate(returning):
        assert ranks[rank] == {"dp": d, "pp": layout.pp - 1, "cp": 0, "tp": 0}
    assert len(set(returning)) == dp


@pytest.mark.parametrize(
    ("layout", "workers", "message"),
    [
        (ParallelLayout(tp=2, pp=2), 6, "6 workers cannot be split into tp=2 x pp=2 x cp=1"),
        (ParallelLayout(pp=3), 2, "use a multiple of 3 workers"),
        (ParallelLayout(ep=4), 2, "ep=4 must divide the 2 data x context parallel ranks"),
        (ParallelLayout(pp=2, ep=2), 2, "multiple of 4 workers"),
        (ParallelLayout(cp=2, ep=4), 2, "ep=4 must divide the 2 data x context parallel ranks"),
        (ParallelLayout(pp=0), 2, "parallel sizes and the worker count must be >= 1"),
    ],
)
def test_impossible_layouts_are_refused_in_one_line(layout, workers, message):
    with pytest.raises(NrlError, match=message) as raised:
        layout.dp_size(workers)
    assert "\n" not in str(raised.value)


def test_context_parallel_ranks_hold_expert_slices_too():
    # 2 data x 2 context parallel ranks hold 4 expert slices: ep counts both.
    assert ParallelLayout(cp=2, ep=4).dp_size(4) == 2
