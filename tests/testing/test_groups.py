"""WarmGroups: a later test's group is built in the actors of an earlier one's."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.distributed.errors import WorkerError
from nrl_core.interfaces import ComponentContext
from nrl_core.testing.groups import WarmGroups

pytestmark = pytest.mark.timeout(300)

OPTIONS = {
    # nrl_test_workers is not an installed package: on the actors' path.
    "env_vars": {"PYTHONPATH": str(Path(__file__).parents[1] / "distributed")},
    "num_cpus_per_worker": 0.25,
    "timeout_s": 60,
}
ALL_REDUCE = "nrl_test_workers:AllReduceWorker"
ARGS = (None, ComponentContext(config=None, seed=3))


def _pids(group) -> list[int]:
    return [info.pid for info in group.infos]


def test_a_released_group_is_rebuilt_in_its_actors_unless_it_cannot_be(ray_cluster):
    import ray

    warm = WarmGroups()
    try:
        first = warm.start(ALL_REDUCE, 2, ARGS, name="policy", **OPTIONS)
        other = warm.start(ALL_REDUCE, 2, ARGS, name="reference", **OPTIONS)
        assert set(_pids(first)).isdisjoint(_pids(other))  # two groups at once: two sets
        assert first.run_all("all_reduce", 1) == [3.0, 3.0]
        pids = _pids(first)
        warm.release()

        # The same name, size and options: the same processes, a working new gloo group.
        again = warm.start(ALL_REDUCE, 2, ARGS, name="policy", **OPTIONS)
        assert _pids(again) == pids
        assert again.run_all("all_reduce", 2) == [5.0, 5.0]
        # Other options: actors of their own.
        single = warm.start(ALL_REDUCE, 1, ARGS, name="policy", **OPTIONS)
        assert not set(_pids(single)) & set(pids)
        warm.release()

        # A kept group with a dead rank is shut down, not reused.
        ray.kill(again.actors[1], no_restart=True)
        fresh = warm.start(ALL_REDUCE, 2, ARGS, name="policy", **OPTIONS)
        assert not set(_pids(fresh)) & set(pids)
        assert fresh.run_all("all_reduce", 0) == [1.0, 1.0]
        fresh_pids = _pids(fresh)
        warm.release()

        # A worker that cannot be built raises as WorkerGroup.start does; its group is gone.
        with pytest.raises(WorkerError, match="cannot import worker class 'no_such_module:X'"):
            warm.start("no_such_module:X", 2, name="policy", **OPTIONS)
        assert not fresh.actors
        last = warm.start(ALL_REDUCE, 2, ARGS, name="policy", **OPTIONS)
        assert not set(_pids(last)) & set(fresh_pids)
        # A group the test shut down itself is not kept either.
        last.shutdown()
        warm.release()
        assert not set(_pids(warm.start(ALL_REDUCE, 2, ARGS, name="policy", **OPTIONS))) & set(
            _pids(last)
        )
    finally:
        warm.close()
