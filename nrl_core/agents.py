"""Agent-driven rollouts: what an agent returns, and running agents as Ray actors.

An agent (:class:`nrl_core.interfaces.Agent`) calls the run's policy endpoint itself, as an
OpenAI client would, and returns one :class:`Trajectory` per row: the exact token ids of each
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

import attrs

from nrl_core.data import split_even
from nrl_core.interfaces import ComponentContext
from nrl_core.registry import resolve_target

AGENT_ACTOR_TARGET = "nrl_core.agents:AgentActor"
BUILTIN_AGENT = "env"
"""The core's agent: its own generate / ``env.step`` loop (:func:`nrl_core.algorithms.rollout.rollout`),
which runs in the driver on token ids and needs no endpoint."""


@attrs.frozen
class Endpoint:
    """Where an agent reaches the policy."""

    base_url: str
    """The OpenAI base URL, ending in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``)."""
    model: str
    """The model id to send (``GET /v1/models`` lists it)."""
    api_key: str | None = None
    """The bearer token the endpoint expects, or None when it expects none."""

    @property
    def root_url(self) -> str:
        """The server's root (``base_url`` without ``/v1``), where ``/tokenize`` and
        ``/inference/v1/generate`` live."""
        return self.base_url.removesuffix("/").removesuffix("/v1")


@attrs.frozen
class ModelCall:
    """One call of the policy, with the exact ids it saw and produced."""

    prompt_token_ids: list[int]
    """Every id the model was conditioned on, in order."""
    generation_token_ids: list[int]
    """The ids it generated (the stop token included when hit)."""
    generation_log_probs: list[float]
    """The logprob of each generated id under the sampling policy (same length)."""

    def __attrs_post_init__(self) -> None:
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"a model call has {len(self.generation_token_ids)} generated ids but "
                f"{len(self.generation_log_probs)} logprobs; they must pair up"
            )


@attrs.frozen
class Trajectory:
    """What an agent made of one row."""

    calls: list[ModelCall]
    """The model calls in the order they were made (empty when the row failed before any)."""
    reward: float = 0.0
    """The verifier's reward for the finished conversation."""
    failure_reason: str | None = None
    """Why the row failed (the agent's or a server's error), or None. A failed row is masked
    out of the loss and counted in ``train/agent_failures``."""
    finish_reason: str = "stop"
    """How the LAST call ended: ``"stop"`` or ``"length"`` (for overlong filtering)."""


class AgentActor:
    """Hosts one agent inside a Ray actor.

    Args:
        target: the agent's ``"module:attr"``, imported here, in the actor.
        options: the agent's options object (its registered config class).
        context: the run-wide :class:`~nrl_core.interfaces.ComponentContext`.
    """

    def __init__(self, target: str | object, options: Any, context: ComponentContext) -> None:
        self.agent = resolve_target(target, what="agent")(options, context)

    def run(self, rows: Sequence[dict[str, Any]], endpoint: Endpoint) -> list[Trajectory]:
        if not rows:
            return []
        out = list(self.agent.run(list(rows), endpoint))
        if len(out) != len(rows):
            raise ValueError(
                f"{type(self.agent).__name__}.run returned {len(out)} trajectories "
                f"for {len(rows)} rows"
            )
        for item in out:
            if not isinstance(item, Trajectory):
                raise TypeError(
                    f"{type(self.agent).__name__}.run must return nrl_core.agents.Trajectory "
                    f"objects, got {type(item).__name__}"
                )
        return out

    def close(self) -> None:
        close = getattr(self.agent, "close", None)
        if callable(close):
            close()


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
