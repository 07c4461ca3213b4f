"""Several Gym environments as several tasks, each naming its own Gym config files
(``data.tasks[i].agent_configs``): one ``ng_run`` serves them all, and a task's rows must name
an agent that its own configs declare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from nrl_gym.agent import ROW_KEY, NemoGymAgent
from nrl_gym.config import EXAMPLE_CONFIG, NemoGymAgentConfig

from nrl_core.config.schema.data import TaskConfig
from nrl_core.errors import ConfigError

REPO = Path(__file__).parents[3]
EXAMPLE = REPO / "plugins" / "nrl-gym" / "examples" / "two_tasks_cpu.yaml"


def _context(tasks: list[dict], agent: str = "env") -> SimpleNamespace:
    config = SimpleNamespace(
        agent=SimpleNamespace(name=agent),
        data=SimpleNamespace(tasks=[TaskConfig(**task) for task in tasks]),
        logger=None,
    )
    return SimpleNamespace(config=config, rank=0)


def _example_tasks() -> list[dict]:
    return yaml.safe_load(EXAMPLE.read_text())["data"]["tasks"]


def test_every_task_config_is_served_once_beside_the_shared_ones():
    tasks = [
        *_example_tasks(),
        {"name": "math", "dataset": "arithmetic"},  # the core's loop: no Gym configs
        # A task of another agent: its files are not Gym's.
        {"name": "other", "agent": "someone_else", "agent_configs": ["x.yaml"]},
    ]
    shared = NemoGymAgentConfig(config_paths=[tasks[0]["agent_configs"][0], "shared.yaml"])
    agent = NemoGymAgent(shared, _context(tasks))
    assert set(agent.task_configs) == {"blackjack", "dialogue"}
    assert agent.config_paths() == [
        "resources_servers/blackjack/configs/blackjack.yaml",
        "shared.yaml",
        "resources_servers/example_multi_turn_gymnasium/configs/example_multi_turn_gymnasium.yaml",
    ]
    # Nothing anywhere: Gym's example environment, as before.
    assert NemoGymAgent(None, _context([])).config_paths() == [EXAMPLE_CONFIG]


@pytest.mark.slow  # builds (or reuses) the cached Gym venv, whose configs are read
@pytest.mark.timeout(900)
def test_a_row_naming_another_task_s_agent_is_refused_in_one_line():
    from nrl_gym.install import config_instances, gym_venv

    agent = NemoGymAgent(None, _context(_example_tasks()))
    venv = gym_venv("0.7.0")
    # What the agent computes before starting ng_run.
    agent._declared = {t: config_instances(venv, p) for t, p in agent.task_configs.items()}
    rows = {
        name: json.loads(
            (REPO / "plugins" / "nrl-gym" / "examples" / f"{name}.jsonl").open().readline()
        )
        for name in ("blackjack", "dialogue")
    }
    # Each example row names an agent its own task's config declares.
    agent._check_route({ROW_KEY: rows["blackjack"], "task": "blackjack"})
    agent._check_route({ROW_KEY: rows["dialogue"], "task": "dialogue"})
    with pytest.raises(ConfigError) as caught:
        agent._check_route({ROW_KEY: rows["dialogue"], "task": "blackjack"})
    message = str(caught.value)
    assert "\n" not in message
    assert "task 'blackjack'" in message and "example_multi_turn_gymnasium_agent" in message
    assert "blackjack_gymnasium_agent" in message  # what it declares


def test_agent_configs_on_a_task_of_the_core_loop_exit_2_before_ray(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "data:\n  tasks:\n    - {name: math, dataset: arithmetic, agent_configs: [some/gym.yaml]}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "run", "grpo", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.tasks[0].agent_configs" in lines[0], done.stderr
    assert "agent: env" in lines[0]
