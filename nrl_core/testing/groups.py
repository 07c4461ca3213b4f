"""Worker groups for test suites that build many short-lived ones: :class:`WarmGroups` keeps a
test's groups when it ends and builds a later test's workers in their actors
(:meth:`~nrl_core.distributed.worker_group.WorkerGroup.rebuild`) instead of starting new
actors. Starting an actor is an interpreter importing Ray, torch, transformers and the plugin:
about 4.5 CPU-seconds on a 2-core machine, more than most multi-rank tests of a tiny model
compute. Everything else is a real group's: the rendezvous, ``torch.distributed`` over gloo,
the calls and their sharding, each worker built from its target in the actor.

A test that checks how actors start, or what a process holds after a worker is gone, starts
its groups itself with :meth:`WorkerGroup.start`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # nrl_core stays light at import: Ray only once a group starts
    from nrl_core.distributed.worker_group import ParallelLayout, WorkerGroup


class WarmGroups:
    """Live worker groups kept between tests, by name, size and start options.

    :meth:`start` gives a group as :meth:`WorkerGroup.start` does, built in the actors of a kept
    group of the same name, size and options when one is idle with every rank alive;
    :meth:`release` (after each test) closes the workers of the groups given out since and
    keeps those groups, at most ``max_idle`` of them (each holds its processes' memory and its
    placement group's resources), shutting down any whose close fails (a dead rank, a test's
    own ``shutdown()``); :meth:`close` (at the end) shuts every kept group down. A new group
    that the cluster's free CPUs cannot hold shuts the longest-idle kept groups down first.
    """

    def __init__(self, max_idle: int = 3) -> None:
        self.max_idle = max_idle
        self._idle: list[tuple[tuple, WorkerGroup]] = []  # the longest idle first
        self._given: list[tuple[tuple, WorkerGroup]] = []

    def start(
        self,
        target: str,
        num_workers: int,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        name: str = "worker",
        layout: ParallelLayout | None = None,
        **options: Any,
    ) -> WorkerGroup:
        """``WorkerGroup.start(target, num_workers, args, kwargs, name=..., layout=...,
        **options)``, in a kept group's actors where one fits. A worker that cannot be built
        raises as there, and its group is shut down."""
        from nrl_core.distributed.worker_group import WorkerGroup

        key = (name, num_workers, repr(sorted(options.items())))
        while kept := [i for i, (k, _) in enumerate(self._idle) if k == key]:
            group = self._idle.pop(kept[-1])[1]
            if group.dead_rank_error("reuse", timeout_s=5) is not None:
                group.shutdown(timeout_s=5)
                continue
            try:
                rendezvous = options.get("rendezvous", True)
                group.rebuild(target, args, kwargs, layout=layout, rendezvous=rendezvous)
            except BaseException:
                # A rank that died after the check above (a ray.kill lands asynchronously: one
                # CI run's rebuild met it in close) makes the group unusable, not the build.
                died = group.dead_rank_error("reuse", timeout_s=5) is not None
                group.shutdown(timeout_s=5)
                if died:
                    continue
                raise
            self._given.append((key, group))
            return group
        self._make_room(num_workers * options.get("num_cpus_per_worker", 1))
        group = WorkerGroup.start(
            target, num_workers, args, kwargs, name=name, layout=layout, **options
        )
        self._given.append((key, group))
        return group

    def _make_room(self, cpus: float) -> None:
        """Shut kept groups down, the longest idle first, until ``cpus`` CPUs are free."""
        import ray

        while self._idle and ray.available_resources().get("CPU", 0.0) < cpus - 1e-6:
            self._idle.pop(0)[1].shutdown(timeout_s=5)

    def release(self) -> None:
        """Close the workers of the groups given out since the last release, and keep those
        groups for :meth:`start`; a group whose workers cannot be closed is shut down."""
        given, self._given = self._given, []
        for key, group in given:
            if not group.actors:  # shut down by the test
                continue
            try:
                group.close_workers()
            except Exception:
                group.shutdown(timeout_s=5)
                continue
            self._idle.append((key, group))
        while len(self._idle) > self.max_idle:
            self._idle.pop(0)[1].shutdown(timeout_s=5)

    def close(self) -> None:
        """Shut down every group, kept or given out."""
        self.release()
        for _, group in self._idle:
            group.shutdown(timeout_s=5)
        self._idle.clear()
