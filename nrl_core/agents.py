"""Agent-driven rollouts: what an agent returns, and running agents as Ray actors.

An agent (:class:`nrl_core.interfaces.Agent`) calls the run's policy endpoint itself, as an
OpenAI client would, and returns one :class:`Trajectory` per row (the types live in
:mod:`nrl_core.data`, below the interfaces, and are re-exported here): the exact token ids of each
model call and the reward. The core turns a trajectory into a training sequence
(:func:`nrl_core.algorithms.rollout.episode_from_trajectory`): the first call's prompt, then for
each call the part of its prompt that is new (tool results, the next user turn; no loss) and its
generated ids (with loss). Every call's prompt must start with everything before it; a
trajectory where one does not (the agent rewrote its history) is masked out of the loss and
counted in ``train/noncontiguous``.

:class:`AgentActor` hosts a plugin's agent inside a Ray actor; :class:`AgentPool` is the
driver's side (one worker group per agent, rows split over its actors).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nrl_core.data import Endpoint, ModelCall, Trajectory, split_even
from nrl_core.hosting import ComponentActor

__all__ = [
    "AGENT_ACTOR_TARGET",
    "BUILTIN_AGENT",
    "AgentActor",
    "AgentPool",
    "Endpoint",
    "ModelCall",
    "Trajectory",
]

AGENT_ACTOR_TARGET = "nrl_core.agents:AgentActor"
BUILTIN_AGENT = "env"
"""The core's agent: its own generate / ``env.step`` loop (:func:`nrl_core.algorithms.rollout.rollout`),
which runs in the driver on token ids and needs no endpoint."""


class AgentActor(ComponentActor):
    """Hosts one agent inside a Ray actor (built as :class:`~nrl_core.hosting.ComponentActor`
    says: ``AgentActor(target, options, context)``)."""

    kind = "agent"
    result_type, result_name = Trajectory, "nrl_core.agents.Trajectory"
    results_word, inputs_word = "trajectories", "rows"

    def run(self, rows: Sequence[dict[str, Any]], endpoint: Endpoint) -> list[Trajectory]:
        if not rows:
            return []
        return self.checked(self.component.run(list(rows), endpoint), "run", len(rows))


STALL_NOTICE_S = 60.0
"""After this many seconds in which an agent call has returned nothing and the endpoint has
answered no model call (none in flight either), the driver prints one waiting line."""


class AgentPool:
    """The agents of a run, each a worker group of :class:`AgentActor`, by agent name.

    Args:
        groups: agent name -> its worker group.
        quiet_s: seconds since the policy endpoint last answered a model call, 0 while one is
            in flight (:meth:`~nrl_core.serving.batcher.RequestBatcher.quiet_s`); None: not
            known (then only the time since the call started counts).
        notice_after_s: how long a stall lasts before its waiting line (> 0).
    """

    def __init__(
        self,
        groups: dict[str, Any],
        quiet_s: Callable[[], float] | None = None,
        notice_after_s: float = STALL_NOTICE_S,
    ) -> None:
        self.groups = groups
        self.quiet_s = quiet_s
        self.notice_after_s = notice_after_s

    def run(
        self, agent: str, rows: Sequence[dict[str, Any]], endpoint: Endpoint
    ) -> list[Trajectory]:
        """Run ``rows`` through agent ``agent``, split over its actors; results in row order.

        While the agent makes model calls it is working, however long its rows take. When it
        has returned nothing and the endpoint has been idle for ``notice_after_s`` (its rows
        wait on tools, a verifier, or a hung server), one line on stderr names the agent, its
        tasks and the rows outstanding; once per stall (a model call ends it)."""
        group = self.groups[agent]
        shards = split_even(list(rows), group.dp_size)
        done = threading.Event()
        watcher = threading.Thread(
            target=self._watch, args=(agent, rows, done), name=f"nrl-wait-{agent}", daemon=True
        )
        watcher.start()
        try:
            outputs = group.run_sharded("run", shards, endpoint)
        finally:
            done.set()
            watcher.join(timeout=5)
        return [t for out in outputs for t in out]

    def _watch(self, agent: str, rows: Sequence[dict[str, Any]], done: threading.Event) -> None:
        started = time.monotonic()
        tasks = sorted({str(r["task"]) for r in rows if r.get("task") is not None})
        which = f" (task{'s' if len(tasks) > 1 else ''} {', '.join(tasks)})" if tasks else ""
        noticed = False
        while not done.wait(min(1.0, self.notice_after_s / 4)):
            quiet = time.monotonic() - started
            if self.quiet_s is not None:
                quiet = min(quiet, self.quiet_s())
            if quiet < self.notice_after_s:
                noticed = False  # the agent used the model: a later stall is a new one
            elif not noticed:
                noticed = True
                print(
                    f"waiting for agent {agent}{which}: {len(rows)} rows outstanding, no "
                    f"trajectory back and no model call for {quiet:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

    def shutdown(self) -> None:
        for group in self.groups.values():
            try:
                group.run_all("close")
            finally:
                group.shutdown()
