"""The resource feasibility check: what a worker group needs against what the cluster has, refused
in one line before any actor starts; and the resources of the Ray cluster this process joined."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import attrs

from nrl_core.distributed.errors import InsufficientResourcesError
from nrl_core.interfaces import ClusterResources


@attrs.frozen
class ResourceNeed:
    """What one worker group asks for, for :func:`check_resources`."""

    name: str
    num_workers: int
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0

    @property
    def cpus(self) -> float:
        return self.num_workers * self.num_cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.num_workers * self.num_gpus_per_worker


def cpu_threads_per_rank(
    total_cpus: float, num_ranks: int, busy_cpus: float = 0.0, other_load: float = 0.0
) -> int:
    """Torch threads for each of ``num_ranks`` ranks that compute at the same time on a
    CPU-only cluster of ``total_cpus`` cores (>= 0), ``busy_cpus`` (>= 0) of which other
    workers of the run use while the ranks compute (separate generation engines), and
    ``other_load`` (>= 0) of which other processes keep busy (the load average the run found):
    ``floor((total_cpus - busy_cpus) / num_ranks)``, lowered to the nearest whole number of
    ``(total_cpus - busy_cpus - other_load) / num_ranks``, at least 1.

    One rank on two idle cores gets two threads, two ranks one each: the ranks together use
    every core and never more. A thread more than the cores free makes each OpenMP barrier
    wait for a descheduled sibling: on two cores under a load average of 10, one generation
    call took 1.5 s on one thread and 4 to 29 s on two. Environment actors, teachers and
    critics are not counted: they compute while the policy waits.
    """
    ranks = max(1, num_ranks)
    threads = math.floor((total_cpus - busy_cpus) / ranks)
    if other_load > 0:
        threads = min(threads, math.floor((total_cpus - busy_cpus - other_load) / ranks + 0.5))
    return max(1, threads)


def cpu_thread_plan(
    total_cpus: float,
    num_ranks: int,
    num_engines: int,
    overlap: bool,
    other_load: float = 0.0,
) -> tuple[int, int]:
    """``(threads per policy rank, threads per separate engine)`` on a CPU-only cluster of
    ``total_cpus`` cores (>= 0) with ``num_ranks`` (>= 1) policy ranks and ``num_engines``
    (>= 0) separate generation engines, ``other_load`` (>= 0) cores kept busy by other
    processes (see :func:`cpu_threads_per_rank`). The engine count is 0 without engines.

    ``overlap`` False (synchronous GRPO: the ranks wait while the engines generate, and the
    engines while the ranks train): each side gets every free core, the ranks
    ``cpu_threads_per_rank(total, ranks)``, each engine ``cpu_threads_per_rank(total,
    engines)``; counting the engines against the ranks (as before) left a lone rank one
    thread of two idle cores. ``overlap`` True (asynchronous GRPO: engines generate while
    the ranks train): ranks and engines compute at once and share the cores evenly; each
    engine gets ``cpu_threads_per_rank(total, ranks + engines)`` and the ranks what the
    engines leave. On two cores, two ranks and one engine: 1 thread each either way, the
    engine 2 when synchronous.
    """
    ranks, engines = max(1, num_ranks), max(0, num_engines)
    if not engines:
        return cpu_threads_per_rank(total_cpus, ranks, 0.0, other_load), 0
    if not overlap:
        return (
            cpu_threads_per_rank(total_cpus, ranks, 0.0, other_load),
            cpu_threads_per_rank(total_cpus, engines, 0.0, other_load),
        )
    engine = cpu_threads_per_rank(total_cpus, ranks + engines, 0.0, other_load)
    return cpu_threads_per_rank(total_cpus, ranks, engine * engines, other_load), engine


def cpu_count() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset``
    narrow; ``os.cpu_count()`` counts the whole machine), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _plural(value: float, unit: str) -> str:
    return f"{_fmt(value)} {unit}{'' if value == 1 else 's'}"


def check_resources(needs: Sequence[ResourceNeed], resources: ClusterResources) -> None:
    """Raise :class:`InsufficientResourcesError` when ``needs`` cannot all be placed.

    Called before any actor starts, so an impossible request fails in a second with numbers
    instead of Ray waiting forever for resources that will never appear.
    """
    have = (
        f"the cluster has {_plural(resources.total_gpus, 'GPU')} and "
        f"{_plural(resources.total_cpus, 'CPU')}"
    )
    fix = (
        "lower num_workers / the per-worker resources, or run on a larger cluster "
        "(cluster.num_cpus, cluster.gpus_per_node, cluster.backend=ray)"
    )
    for need in needs:
        if need.gpus > resources.total_gpus:
            raise InsufficientResourcesError(
                f"{need.name} needs {_plural(need.gpus, 'GPU')}; {have}; {fix}"
            )
        if need.cpus > resources.total_cpus:
            raise InsufficientResourcesError(
                f"{need.name} needs {_plural(need.cpus, 'CPU')}; {have}; {fix}"
            )
        # One worker is one bundle, and a bundle never spans nodes.
        fits_somewhere = any(
            need.num_cpus_per_worker <= cpus and need.num_gpus_per_worker <= gpus
            for cpus, gpus in zip(resources.cpus_per_node, resources.gpus_per_node, strict=True)
        )
        if need.num_workers and not fits_somewhere:
            raise InsufficientResourcesError(
                f"one {need.name} worker needs {_plural(need.num_cpus_per_worker, 'CPU')} and "
                f"{_plural(need.num_gpus_per_worker, 'GPU')} on a single node; no node has that "
                f"({have}); {fix}"
            )
    total_cpus = sum(n.cpus for n in needs)
    total_gpus = sum(n.gpus for n in needs)
    if len(needs) > 1 and (total_gpus > resources.total_gpus or total_cpus > resources.total_cpus):
        names = " + ".join(n.name for n in needs)
        raise InsufficientResourcesError(
            f"{names} together need {_plural(total_gpus, 'GPU')} and "
            f"{_plural(total_cpus, 'CPU')}; {have}; {fix}"
        )


def ray_resources() -> ClusterResources:
    """The alive nodes' CPUs and GPUs of the Ray cluster this process is connected to."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return ClusterResources(
        num_nodes=len(nodes),
        cpus_per_node=[float(n["Resources"].get("CPU", 0)) for n in nodes],
        gpus_per_node=[float(n["Resources"].get("GPU", 0)) for n in nodes],
    )


def config_gpus(config) -> int:
    """The GPUs a run of ``config`` holds on a GPU cluster, for launchers that size one ahead
    (the KubeRay example's pods, the Slurm script's wait): one per policy rank
    (``policy.num_workers``), plus ``num_engines x tensor_parallel_size`` for generation
    engines that are not colocated (colocated engines share the policy's GPUs). A teacher or
    reward model of its own is not counted. 0 or more."""
    gpus = config.policy.num_workers
    generation = getattr(config, "generation", None)
    options = generation.options_for() if generation is not None else None
    if options is not None and not getattr(options, "colocated", True):
        gpus += getattr(options, "num_engines", 1) * getattr(options, "tensor_parallel_size", 1)
    return gpus
