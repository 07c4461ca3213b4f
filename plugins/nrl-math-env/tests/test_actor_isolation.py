"""With actor isolation on (the default ``venv`` mode), this plugin's environments run in this
plugin's own virtualenv, started exactly as a GRPO run starts them.

The venv is built under a temporary ``NRL_VENV_DIR`` and layered on the driver's site-packages
(``NRL_ACTOR_VENV_LAYER=1``), so building it takes seconds (see ``docs/runtime.md``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray
from rich.console import Console

from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.loader import resolve_config
from nrl_core.distributed import actor_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _interpreter(actor) -> dict[str, str]:
    """What the Ray actor's own process reports about its interpreter."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda _: {
                "executable": __import__("sys").executable,
                "prefix": __import__("sys").prefix,
            }
        ),
        timeout=120,
    )


def test_environment_actors_run_in_the_plugins_venv(
    ray_cluster, nrl_registry, tmp_path, monkeypatch
):
    env_name = "guess_number"  # its options (a plugin class) travel to the actor too
    venvs = tmp_path / "venvs"
    monkeypatch.setenv(actor_env.VENV_DIR_VAR, str(venvs))
    monkeypatch.setenv(actor_env.LAYER_VAR, "1")
    monkeypatch.delenv(actor_env.ACTOR_ENV_VAR, raising=False)  # the default: venv mode
    config = resolve_config(
        "grpo",
        None,
        [f"env.name={env_name}", f"data.dataset={env_name}", "env.num_workers=1"],
        nrl_registry,
    )
    session = RunSession(config, nrl_registry, algorithm="grpo", console=Console(quiet=True))
    try:
        pool = session.components.start_environments(config.env)  # the path GRPO's set-up takes
        group = pool.groups["default"]
        reported = _interpreter(group.actors[0])

        # The venv built for this plugin's distribution, under the temporary venv dir.
        (venv,) = [p for p in venvs.iterdir() if not p.name.startswith(".")]
        marker = json.loads((venv / actor_env.MARKER).read_text())
        assert marker["distribution"] == "nrl-math-env" and marker["layer"]
        assert reported["executable"] == str(venv / "bin" / "python")
        assert Path(reported["prefix"]).resolve() == venv.resolve()
        assert reported["executable"] != sys.executable
        assert Path(sys.prefix).resolve() != venv.resolve()

        # And the environment works there: a right answer scores through the pool.
        sample = (
            session.registry.get("dataset", env_name)
            .load()(config.data.options_for(env_name), session.context)
            .load("validation")[0]
        )
        conversation = [*sample.messages, {"role": "assistant", "content": str(sample.answer)}]
        metadata = {**sample.metadata, "answer": sample.answer, "task": sample.task}
        (result,) = pool.step([sample.task], [conversation], [metadata])
        assert result.error is None and result.reward == 1.0 and result.step.terminated
    finally:
        session.close()
