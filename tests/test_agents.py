"""The driver's side of agents (nrl_core.agents.AgentPool): a stalled agent is reported in one
waiting line (issue 47: an agent that never answered was waited on for 15 minutes in silence)."""

from __future__ import annotations

import time

from nrl_core.agents import AgentActor, AgentPool, Endpoint, Trajectory
from nrl_core.distributed.worker_group import InProcessGroup

ENDPOINT = Endpoint(base_url="http://127.0.0.1:1/v1", model="m")


class SleepyAgent:
    """Returns a failed trajectory per row after ``options`` seconds."""

    def __init__(self, options: float, context=None) -> None:
        self.seconds = options

    def run(self, rows, endpoint):
        time.sleep(self.seconds)
        return [Trajectory(calls=[], failure_reason="slept") for _ in rows]


def _pool(seconds: float, **options) -> AgentPool:
    actor = AgentActor(SleepyAgent, seconds, None)  # hosted in this process (no Ray)
    return AgentPool({"sleepy": InProcessGroup(actor, name="sleepy")}, **options)


ROWS = [{"task": "weather"}, {"task": "weather"}, {"task": "dialogue"}]


def test_a_stalled_agent_gets_one_waiting_line_naming_it_its_tasks_and_rows(capfd):
    pool = _pool(1.6, notice_after_s=0.4)
    out = pool.run("sleepy", ROWS, ENDPOINT)
    assert [t.failure_reason for t in out] == ["slept"] * 3
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # once per stall, not once a second
    assert lines[0].startswith(
        "waiting for agent sleepy (tasks dialogue, weather): 3 rows outstanding, no trajectory "
        "back and no model call for "
    )


def test_an_agent_that_uses_the_model_is_not_stalled_and_a_quick_one_says_nothing(capfd):
    busy = _pool(1.2, notice_after_s=0.3, quiet_s=lambda: 0.0)  # a model call is in flight
    busy.run("sleepy", ROWS, ENDPOINT)
    _pool(0.0, notice_after_s=0.3).run("sleepy", ROWS, ENDPOINT)
    assert capfd.readouterr().err == ""


def test_each_stall_gets_its_own_line(capfd):
    """Quiet for 0.5 s, a model call, quiet again: two stalls, two lines."""
    started = time.monotonic()

    def quiet_s() -> float:
        elapsed = time.monotonic() - started
        return elapsed if elapsed < 0.9 else elapsed - 0.9  # a call answered at 0.9 s

    _pool(2.2, notice_after_s=0.5, quiet_s=quiet_s).run("sleepy", ROWS, ENDPOINT)
    assert len(capfd.readouterr().err.splitlines()) == 2


def test_the_endpoint_is_quiet_until_a_request_is_answered(tiny_model_path):
    """The batcher's clock the waiting line reads: busy while a request is in flight, quiet
    from its answer on (a real PolicyServer, through HTTP)."""
    import httpx
    from transformers import AutoTokenizer

    from nrl_core.config.schema import ServerConfig
    from nrl_core.serving.server import PolicyServer

    def generate(prompts, params, stops):
        assert server.batcher.quiet_s() == 0.0  # in flight
        return type("Out", (), {"token_ids": [[5]], "logprobs": [[-0.5]], "finish_reasons": ["stop"]})  # fmt: skip

    server = PolicyServer(
        generate,
        AutoTokenizer.from_pretrained(tiny_model_path),
        model_id="m",
        max_model_len=64,
        config=ServerConfig(batch_window_ms=0),
    )
    url = server.start()
    try:
        assert server.batcher.quiet_s() == float("inf")  # never answered
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(f"{url}/chat/completions", json=body, timeout=30).status_code == 200
        assert 0.0 < server.batcher.quiet_s() < 5.0
    finally:
        server.stop()
