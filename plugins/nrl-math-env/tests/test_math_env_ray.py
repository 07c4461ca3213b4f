"""The ``math`` environment running as a real Ray actor, where signal-based timeouts fail."""

from __future__ import annotations

import time

import pytest
import ray
from nrl_math_env.config import MathEnvConfig
from nrl_math_env.math_env import MathEnvironment

from nrl_core.config.schema import GRPOConfig
from nrl_core.interfaces import ComponentContext

pytestmark = pytest.mark.slow


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "Compute 1/2."}, {"role": "assistant", "content": response}]


def test_math_environment_as_a_ray_actor(ray_cluster):
    # 5 s: a fresh verifier's first call took over 2 s once on the loaded CI machine (every
    # reward 0, statuses unknown), though 0.07 s alone.
    options = MathEnvConfig(num_workers=2, timeout_s=5.0)
    env = ray.remote(MathEnvironment).remote(options, ComponentContext(config=GRPOConfig(), seed=3))
    responses = [r"\boxed{\dfrac12}", "0.5", r"\boxed{0.6}", "", r"\boxed{9^{9^{9^{9}}}}"]
    metadata = [{"answer": "1/2", "task": "math", "id": i} for i in range(len(responses))]
    ray.get(env.__ray_ready__.remote())  # the actor and its verifier processes are up
    start = time.monotonic()
    steps = ray.get(env.step.remote([conversation(r) for r in responses], metadata), timeout=60)
    elapsed = time.monotonic() - start
    statuses = [s.metadata["verify_status"] for s in steps]
    assert statuses == ["ok", "ok", "ok", "ok", "timeout"], [s.metadata for s in steps]
    assert [s.reward for s in steps] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert all(s.terminated for s in steps)
    assert [s.metadata["id"] for s in steps] == list(range(5))  # metadata is carried through
    assert elapsed < 25  # a 5 s limit plus slack for a loaded machine; unbounded without it
    batch = {
        "rewards": [s.reward for s in steps],
        "group_ids": [0, 0, 0, 1, 1],
        "finish_reasons": ["stop"] * 5,
        "response_lengths": [len(r) for r in responses],
        "metadata": [s.metadata for s in steps],
    }
    metrics = ray.get(env.metrics.remote(batch))
    assert metrics["accuracy"] == pytest.approx(0.4) and metrics["pass@2"] == pytest.approx(0.5)
    assert metrics["timeout_fraction"] == pytest.approx(0.2) and metrics["error_fraction"] == 0.0
    ray.get(env.close.remote())
    ray.kill(env)
