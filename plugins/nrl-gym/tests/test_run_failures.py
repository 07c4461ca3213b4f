"""A Gym agent's /run that answers something broken, or nothing, fails its row and never the run
(issue 47): small HTTP servers answering as a broken Gym agent would, through the agent's real
httpx client."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from nrl_gym.agent import ROW_KEY, NemoGymAgent
from nrl_gym.config import NemoGymAgentConfig

GOOD = {
    "response": {
        "output": [
            {
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-1.0],
            }
        ]
    },
    "reward": 1.0,
}


@pytest.fixture
def broken_gym_agents(served):
    app = FastAPI()

    @app.post("/ok/run")
    async def ok() -> dict:
        return GOOD

    @app.post("/not_json/run")
    async def not_json() -> Response:
        return Response(b'{"response": {"output": [', media_type="application/json")

    @app.post("/deep/run")
    async def deep() -> Response:
        return Response(b"[" * 100_000 + b"]" * 100_000, media_type="application/json")

    @app.post("/unpaired/run")
    async def unpaired() -> dict:
        item = {"prompt_token_ids": [1], "generation_token_ids": [2, 3], "generation_log_probs": [-1]}  # fmt: skip
        return {"response": {"output": [item]}, "reward": 1.0}

    @app.post("/reward_text/run")
    async def reward_text() -> dict:
        return {**GOOD, "reward": "high"}

    @app.post("/error/run")
    async def error() -> JSONResponse:
        return JSONResponse({"detail": "boom"}, status_code=500)

    @app.post("/silent/run")
    async def silent() -> dict:
        await asyncio.sleep(60)
        return GOOD

    with served(app) as base:
        yield lambda name: f"{base}/{name}"


def test_a_broken_or_silent_run_fails_its_row_and_the_others_are_kept(broken_gym_agents):
    """Issue 47: a /run body that was not JSON ended the run (JSONDecodeError) while a 500
    failed one row; now each broken answer fails its own row."""
    agent = NemoGymAgent(NemoGymAgentConfig(request_timeout_s=2.0))
    agent.servers = SimpleNamespace(url_of=broken_gym_agents)
    names = ["ok", "not_json", "deep", "unpaired", "reward_text", "error", "silent", "ok"]
    rows = [{ROW_KEY: {"agent_ref": {"name": n}, "i": i}, "task": "t"} for i, n in enumerate(names)]
    started = time.monotonic()
    trajectories = asyncio.run(agent._run_all(rows))
    assert time.monotonic() - started < 15
    reasons = dict(zip(names[1:-1], [t.failure_reason for t in trajectories[1:-1]], strict=True))
    assert "not_json's /run answered 200 with a body that is not JSON" in reasons["not_json"]
    assert "deep's /run answered 200 with a body that is not JSON" in reasons["deep"]
    assert "unpaired's /run answered a result nrl cannot read: a model call has 2 generated ids but 1 logprobs" in reasons["unpaired"]  # fmt: skip
    assert "reward_text's /run answered a result nrl cannot read" in reasons["reward_text"]
    assert reasons["error"].startswith("/run answered 500")
    assert reasons["silent"] == (
        "silent's /run did not answer within agent.nemo_gym.request_timeout_s=2 s"
    )
    for good in (trajectories[0], trajectories[-1]):
        assert good.failure_reason is None and good.reward == 1.0
        assert [c.generation_token_ids for c in good.calls] == [[3]]
