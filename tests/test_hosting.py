"""The actors that host a plugin's environment or agent (nrl_core.hosting.ComponentActor), run
in this process: they build the component from its target, refuse results that do not pair up
with the inputs or are of the wrong type (naming the component's class), and close it."""

from __future__ import annotations

import pytest

from nrl_core.agents import AgentActor, Endpoint, Trajectory
from nrl_core.environments import EnvironmentActor
from nrl_core.errors import ComponentLoadError
from nrl_core.interfaces import ComponentContext, EnvStep

CONTEXT = ComponentContext(config=None)
ENDPOINT = Endpoint("http://127.0.0.1:1/v1", "m")


class Scripted:
    """An environment and an agent at once: answers with ``answer(n)`` for n inputs."""

    closed = 0

    def __init__(self, options, context) -> None:
        self.answer = options

    def step(self, conversations, metadata):
        return self.answer(len(conversations))

    def run(self, rows, endpoint):
        return self.answer(len(rows))

    def close(self) -> None:
        type(self).closed += 1


def test_both_actors_build_their_component_from_a_target_string():
    env = EnvironmentActor("nrl_core.environments:ExactMatchEnvironment", None, CONTEXT)
    assert type(env.env).__name__ == "ExactMatchEnvironment" and env.component is env.env
    with pytest.raises(ComponentLoadError, match=r"^cannot load agent 'nrl_core.agents:Nope'"):
        AgentActor("nrl_core.agents:Nope", None, CONTEXT)
    with pytest.raises(ComponentLoadError, match=r"^environment 'nope' must look like"):
        EnvironmentActor("nope", None, CONTEXT)


def test_an_agent_must_return_one_trajectory_per_row():
    agent = AgentActor(Scripted, lambda n: [Trajectory([])] * n, CONTEXT)
    assert agent.run([{}, {}], ENDPOINT) == [Trajectory([])] * 2
    assert agent.run([], ENDPOINT) == []
    short = AgentActor(Scripted, lambda n: [Trajectory([])] * (n - 1), CONTEXT)
    with pytest.raises(ValueError, match=r"^Scripted.run returned 1 trajectories for 2 rows$"):
        short.run([{}, {}], ENDPOINT)
    wrong = AgentActor(Scripted, lambda n: [{"reward": 1.0}] * n, CONTEXT)
    with pytest.raises(
        TypeError, match=r"^Scripted.run must return nrl_core.agents.Trajectory objects, got dict$"
    ):
        wrong.run([{}], ENDPOINT)


def test_an_environment_must_return_one_step_per_sample():
    env = EnvironmentActor(Scripted, lambda n: [EnvStep(reward=1.0)] * n, CONTEXT)
    assert env._checked_step([[], []], [{}, {}]) == [EnvStep(reward=1.0)] * 2
    long = EnvironmentActor(Scripted, lambda n: [EnvStep(reward=1.0)] * (n + 1), CONTEXT)
    with pytest.raises(ValueError, match=r"^Scripted.step returned 2 results for 1 samples$"):
        long._checked_step([[]], [{}])
    wrong = EnvironmentActor(Scripted, lambda n: [1.0] * n, CONTEXT)
    with pytest.raises(TypeError, match=r"^Scripted.step must return EnvStep objects, got float$"):
        wrong._checked_step([[]], [{}])
    # Through `step`, a sample whose results are refused becomes a recorded error, not a crash.
    (result,) = wrong.step(([[]], [{}]))
    assert result.reward == 0.0 and result.error.startswith("TypeError: Scripted.step must")


def test_closing_an_actor_closes_its_component_when_it_has_a_close():
    before = Scripted.closed
    AgentActor(Scripted, None, CONTEXT).close()
    EnvironmentActor(Scripted, None, CONTEXT).close()
    assert Scripted.closed == before + 2
    EnvironmentActor("nrl_core.environments:ExactMatchEnvironment", None, CONTEXT).close()
