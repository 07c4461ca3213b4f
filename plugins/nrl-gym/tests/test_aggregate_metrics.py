"""Gym's ``/aggregate_metrics``: asked once per (task, Gym agent) of a call, its
``agent_metrics`` logged as ``agent/agg/<name>``; an agent without it is skipped, never a
failure. The agents here are small HTTP servers answering as Gym 0.7.0's
``SimpleResponsesAPIAgent`` does (``AggregateMetrics``: ``agent_metrics``, ``key_metrics``...);
the example runs (docs/agents.md) call Gym's own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from nrl_gym.agent import ROW_KEY, NemoGymAgent

from nrl_core.agents import Trajectory


@pytest.fixture
def gym_like_agents(served):
    asked: list[dict] = []
    app = FastAPI()

    @app.post("/with/aggregate_metrics")
    async def aggregate(request: Request) -> dict:
        body = await request.json()
        asked.append(body)
        rewards = [r["reward"] for r in body["verify_responses"]]
        mean = sum(rewards) / len(rewards)
        return {"agent_metrics": {"mean/reward": mean, "num_repeats": 2, "note": "text"}}

    with served(app) as base:
        yield {"with": f"{base}/with", "without": f"{base}/without"}, asked


def _row(agent: str, task: str, prompt: str) -> dict:
    gym = {"responses_create_params": {"input": prompt}, "agent_ref": {"name": agent}}
    return {ROW_KEY: gym, "task": task}


def _result(reward: float) -> dict:
    return {"response": {"output": []}, "reward": reward, "responses_create_params": {}}


def test_each_task_and_agent_gets_gym_s_aggregate_and_a_missing_one_is_skipped(
    gym_like_agents, caplog
):
    urls, asked = gym_like_agents
    agent = NemoGymAgent()
    agent.servers = SimpleNamespace(url_of=lambda name: urls[name])
    rows = [
        _row("with", "a", "p1"),
        _row("with", "a", "p1"),  # a second rollout of the same row
        _row("with", "a", "p2"),
        _row("with", "b", "p3"),
        _row("without", "c", "p4"),
        _row("with", "a", "p5"),  # failed: not aggregated
    ]
    rewards = [1.0, 0.0, 0.5, -1.0, 1.0, 0.0]
    done = [(Trajectory(calls=[], reward=r), _result(r)) for r in rewards]
    done[-1] = (Trajectory(calls=[], failure_reason="boom"), None)

    async def go():
        async with httpx.AsyncClient() as client:
            await agent._add_aggregate_metrics(client, rows, done)
            await agent._add_aggregate_metrics(client, rows[4:5], done[4:5])

    with caplog.at_level("DEBUG", logger="nrl_gym.agent"):
        asyncio.run(go())
    # Task a (3 results) and task b (1), each on its own; their metrics are Gym's numbers.
    assert [len(body["verify_responses"]) for body in asked] == [3, 1]
    first = asked[0]["verify_responses"]
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in first] == [
        (0, 0),
        (0, 1),
        (1, 0),
    ]
    assert all("response" not in r and "responses_create_params" not in r for r in first)
    for trajectory, _ in done[:3]:
        assert trajectory.metrics == {"agg/mean/reward": 0.5, "agg/num_repeats": 2.0}
    assert done[3][0].metrics == {"agg/mean/reward": -1.0, "agg/num_repeats": 2.0}
    # No endpoint: no metrics, no failure, and one debug line (not asked again).
    assert done[4][0].metrics == {} and done[4][0].failure_reason is None
    assert done[5][0].metrics == {}
    skipped = [r for r in caplog.records if "has no /aggregate_metrics" in r.getMessage()]
    assert len(skipped) == 1
