"""The GPU a rank runs on: the one Ray gave its actor, wherever it sits in the actor's
``CUDA_VISIBLE_DEVICES`` — never ``cuda:LOCAL_RANK``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nrl_core.config.schema import RunConfig
from nrl_core.distributed.devices import visible_gpu_index
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext

pytestmark = pytest.mark.gpu_sim
ROOT = Path(__file__).resolve().parents[2]


def test_every_rank_of_a_gpu_group_picks_the_gpu_ray_gave_it(ray_cluster):
    from nrl_core.distributed.worker_group import WorkerGroup

    group = WorkerGroup.start(
        "nrl_core.testing.recording:RecordingEngineWorker",
        4,
        args=(None, ComponentContext(config=RunConfig())),
        name="gpu-ranks",
        num_cpus_per_worker=0.25,
        num_gpus_per_worker=1,
        timeout_s=60,
    )
    try:
        seen = group.run_all("where")
        local_ranks = [int(env["LOCAL_RANK"]) for env in group.run_all("where_env")]
    finally:
        group.shutdown()
    assert max(local_ranks) == 3  # one node: cuda:LOCAL_RANK would be cuda:3 for the last rank
    gpus = []
    for where in seen:
        visible = where["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == 1  # Ray narrows each actor to its own GPU
        assert 0 <= where["gpu_index"] < len(visible)
        gpus.append(visible[where["gpu_index"]])
        assert gpus[-1] == where["ray_gpu_ids"][0]
    assert sorted(gpus) == ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    ("env", "assigned", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "3"}, ["3"], 0),  # Ray narrowed it
        ({"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_RANK": "0"}, ["6"], 2),  # a TP bundle
        ({"LOCAL_RANK": "1"}, ["5"], 5),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
        ({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1"}, [], 1),  # torchrun, no Ray GPUs
    ],
)
def test_visible_gpu_index(env, assigned, expected):
    assert visible_gpu_index(env, assigned) == expected


def test_a_gpu_hidden_from_the_worker_is_one_line():
    with pytest.raises(NrlError, match=r"Ray assigned GPU 2 .* hides it"):
        visible_gpu_index({"CUDA_VISIBLE_DEVICES": "0,1"}, ["2"])


def test_no_policy_plugin_derives_its_cuda_device_from_local_rank():
    """Policy workers ask the core (select_cuda_device), which knows about Ray's narrowing."""
    offenders = []
    for source in sorted(ROOT.glob("plugins/*/src/**/*.py")):
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if re.search(r"LOCAL_RANK", line) and re.search(r"cuda|device", line):
                offenders.append(f"{source.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
