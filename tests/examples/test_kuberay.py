"""The KubeRay example (``examples/kuberay/rayjob-grpo.yaml``): its pods hold what its run needs.

No Kubernetes here: the RayJob is parsed, its entrypoint's config resolved as ``nrl run`` would,
and the pods' GPUs, Ray's view of them, the image, Ray's version and the shared results volume
compared with that config. Each check is also shown to catch a broken copy.
"""

from __future__ import annotations

import copy
import shlex
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from nrl_core.algorithms.recipes import default_recipe
from nrl_core.config.loader import resolve_config
from nrl_core.distributed.resources import config_gpus
from nrl_core.plugins import PluginHost

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kuberay" / "rayjob-grpo.yaml"


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _gpus(group: dict) -> int:
    return sum(
        int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        for c in _containers(group)
    )


def rayjob_problems(job: dict, registry) -> list[str]:
    """What in the RayJob ``job`` disagrees with the config its entrypoint runs."""
    problems = []
    if job.get("apiVersion") != "ray.io/v1" or job.get("kind") != "RayJob":
        problems.append("not a ray.io/v1 RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    if words[:2] != ["nrl", "run"]:
        return [*problems, f"the entrypoint is not `nrl run ...`: {words[:3]}"]
    algorithm, overrides = words[2], words[3:]
    config = resolve_config(
        algorithm, None, overrides, registry, defaults=default_recipe(algorithm)
    )
    if config.cluster.backend != "ray":
        problems.append(
            f"cluster.backend={config.cluster.backend}: the run must join the RayJob's cluster (ray)"
        )
    spec = job["spec"]["rayClusterSpec"]
    head, workers = spec["headGroupSpec"], spec["workerGroupSpecs"]
    if _gpus(head) or head["rayStartParams"].get("num-gpus") != "0":
        problems.append("the head holds GPUs: the policy ranks run on the worker pods")
    per_node, total = config.cluster.gpus_per_node, 0
    for group in workers:
        gpus, told = _gpus(group), int(group["rayStartParams"].get("num-gpus", -1))
        if gpus != told:
            problems.append(
                f"group {group['groupName']}: pods have {gpus} GPUs, Ray is told {told}"
            )
        if gpus != per_node:
            problems.append(
                f"group {group['groupName']}: pods have {gpus} GPUs, cluster.gpus_per_node={per_node}"
            )
        if not group["minReplicas"] == group["replicas"] == group["maxReplicas"]:
            problems.append(f"group {group['groupName']}: a run needs a fixed number of pods")
        total += group["replicas"] * gpus
    needed = config_gpus(config)
    if total != needed:
        problems.append(f"the worker pods have {total} GPUs, the run uses {needed}")
    if spec.get("rayVersion") != metadata.version("ray"):
        problems.append(
            f"rayVersion {spec.get('rayVersion')} is not the lock's Ray {metadata.version('ray')}"
        )
    images = {c["image"] for group in [head, *workers] for c in _containers(group)}
    if len(images) != 1:
        problems.append(f"the pods run different images: {sorted(images)}")
    log_dir = Path(config.logger.log_dir)
    for group in [head, *workers]:
        mounts = [m for c in _containers(group) for m in c.get("volumeMounts", [])]
        claims = {
            v["name"]
            for v in group["template"]["spec"].get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        if not any(m["name"] in claims and log_dir.is_relative_to(m["mountPath"]) for m in mounts):
            problems.append(
                f"{group.get('groupName', 'head')}: logger.log_dir {log_dir} is not on a shared volume"
            )
    return problems


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover(None).registry()


def test_the_example_holds_what_its_run_needs(registry):
    job = yaml.safe_load(EXAMPLE.read_text())
    assert rayjob_problems(job, registry) == []
    # 16 policy ranks with colocated vLLM engines: 2 pods of 8 GPUs.
    assert (
        config_gpus(
            resolve_config(
                "grpo",
                None,
                shlex.split(job["spec"]["entrypoint"])[3:],
                registry,
                defaults=default_recipe("grpo"),
            )
        )
        == 16
    )


def _edit(job: dict, path: str, value) -> dict:
    changed = copy.deepcopy(job)
    *keys, last = path.split(".")
    node = changed
    for key in keys:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return changed


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        (
            "spec.rayClusterSpec.workerGroupSpecs.0.replicas",
            1,
            "the worker pods have 8 GPUs, the run uses 16",
        ),
        (
            "spec.rayClusterSpec.workerGroupSpecs.0.rayStartParams",
            {"num-gpus": "4"},
            "pods have 8 GPUs, Ray is told 4",
        ),
        ("spec.rayClusterSpec.headGroupSpec.rayStartParams", {}, "the head holds GPUs"),
        ("spec.rayClusterSpec.rayVersion", "2.9.0", "rayVersion 2.9.0 is not the lock's Ray"),
        (
            "spec.entrypoint",
            "nrl run grpo cluster.backend=ray cluster.gpus_per_node=8 policy.num_workers=16 generation.backend=vllm generation.vllm.colocated=false generation.vllm.num_engines=4 logger.log_dir=/results/runs",
            "the worker pods have 16 GPUs, the run uses 20",
        ),
        (
            "spec.entrypoint",
            "nrl run grpo cluster.backend=ray cluster.gpus_per_node=8 policy.num_workers=16 logger.log_dir=/tmp/runs",
            "logger.log_dir /tmp/runs is not on a shared volume",
        ),
    ],
)
def test_a_broken_copy_is_caught(registry, path, value, problem):
    job = _edit(yaml.safe_load(EXAMPLE.read_text()), path, value)
    problems = rayjob_problems(job, registry)
    assert any(problem in p for p in problems), problems
