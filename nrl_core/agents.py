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

from collections.abc import Sequence
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


class AgentPool:
    """The agents of a run, each a worker group of :class:`AgentActor`, by agent name."""

    def __init__(self, groups: dict[str, Any]) -> None:
        self.groups = groups

    def run(
        self, agent: str, rows: Sequence[dict[str, Any]], endpoint: Endpoint
    ) -> list[Trajectory]:
        """Run ``rows`` through agent ``agent``, split over its actors; results in row order."""
        group = self.groups[agent]
        shards = split_even(list(rows), group.dp_size)
        outputs = group.run_sharded("run", shards, endpoint)
        return [t for out in outputs for t in out]

    def shutdown(self) -> None:
        for group in self.groups.values():
            try:
                group.run_all("close")
            finally:
                group.shutdown()
