"""A small OpenAI-speaking agent for testing agent-driven rollouts (registered by tests, not by
the core), and the shortest worked example of writing one.

:class:`TwoTurnAgent` answers each row in two model calls through the run's policy endpoint:
the row's prompt, then the first reply sent back WITH its token fields plus a follow-up user
turn ("Final answer?"), as an OpenAI client would keep a conversation going. The reward is 1
when the last line of the final answer equals the row's ``answer``. It uses only the standard
library (``urllib``), so it runs in any actor environment.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nrl_core import hookimpl
from nrl_core.agents import Endpoint, ModelCall, Trajectory

FOLLOW_UP = "Final answer?"
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")

NRL_WITH_TEST_AGENTS = """
import sys
from nrl_core import plugins
from nrl_core.testing import agents

discover = plugins.PluginHost.discover.__func__

def with_test_agents(cls, selection=None):
    host = discover(cls, selection)
    host.add(agents, "testing-agents")
    return host

plugins.PluginHost.discover = classmethod(with_test_agents)
from nrl_core.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""``python -c NRL_WITH_TEST_AGENTS run ...``: ``nrl`` with this module's agents added as a
plugin (per-test registration: they are not an installed plugin), for CLI tests of agent
tasks with any engine."""


class TwoTurnAgent:
    """Two chat-completion calls per row, rows in parallel (``max_concurrency`` threads)."""

    def __init__(self, options: Any = None, context: Any = None, max_concurrency: int = 16):
        self.max_concurrency = max_concurrency

    def run(self, rows: Sequence[dict[str, Any]], endpoint: Endpoint) -> list[Trajectory]:
        with ThreadPoolExecutor(self.max_concurrency) as pool:
            return list(pool.map(lambda row: self._one(row, endpoint), rows))

    def _one(self, row: dict[str, Any], endpoint: Endpoint) -> Trajectory:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        calls: list[ModelCall] = []
        try:
            for turn in range(2):
                reply = _chat(endpoint, messages)
                message = reply["choices"][0]["message"]
                calls.append(ModelCall(*(message[f] for f in TOKEN_FIELDS)))
                # Send the reply back as it came, token fields included: the endpoint then
                # continues from exactly the ids that were sampled.
                messages.append(message)
                if turn == 0:
                    messages.append({"role": "user", "content": FOLLOW_UP})
        except (urllib.error.URLError, KeyError, ValueError) as exc:
            return Trajectory(calls=calls, failure_reason=f"{type(exc).__name__}: {exc}")
        lines = (message.get("content") or "").strip().splitlines() or [""]
        reward = float(lines[-1].strip() == str(row.get("answer", "")).strip())
        finish = "length" if reply["choices"][0]["finish_reason"] == "length" else "stop"
        # An environment number of its own (logged as <split>/<task>/agent/final_lines).
        metrics = {"final_lines": float(len(lines))}
        return Trajectory(calls=calls, reward=reward, finish_reason=finish, metrics=metrics)


def _chat(endpoint: Endpoint, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"model": endpoint.model, "messages": messages}).encode()
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    request = urllib.request.Request(
        f"{endpoint.base_url}/chat/completions", data=body, headers=headers
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@hookimpl
def nrl_register_agents(register):
    """Tests add this module as a plugin (``PluginHost.add``) to get ``two_turn``."""
    register(
        "two_turn",
        "nrl_core.testing.agents:TwoTurnAgent",
        description="two chat-completion calls per row over HTTP (tests)",
    )
