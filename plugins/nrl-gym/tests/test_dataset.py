"""NeMo Gym JSONL rows as samples (nrl_gym.dataset)."""

import json
from pathlib import Path

import pytest
from nrl_gym.agent import ROW_KEY
from nrl_gym.config import NemoGymDataConfig
from nrl_gym.dataset import NemoGymDataset

from nrl_core.errors import ConfigError

EXAMPLE = Path(__file__).parents[1] / "examples" / "weather.jsonl"


def test_rows_keep_every_field_and_become_chat_messages():
    samples = NemoGymDataset(NemoGymDataConfig(path=str(EXAMPLE))).load("train")
    first_row = json.loads(EXAMPLE.read_text().splitlines()[0])
    assert len(samples) == 8
    assert samples[0].metadata[ROW_KEY] == first_row
    assert [m["role"] for m in samples[0].messages] == ["system", "user"]  # developer -> system
    with pytest.raises(KeyError):
        NemoGymDataset(NemoGymDataConfig(path=str(EXAMPLE))).load("validation")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"agent_ref": {"name": "a"}}, "responses_create_params.input"),
        ({"responses_create_params": {"input": []}}, "agent_ref.name"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    good = EXAMPLE.read_text().splitlines()[0]
    path.write_text(good + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=rf"rows.jsonl:2: .*{message}"):
        NemoGymDataset(NemoGymDataConfig(path=str(path))).load("train")


def test_each_gym_task_reads_its_own_file(nrl_registry):
    """`data.tasks[i].dataset: nemo_gym_jsonl:<file>`: two Gym environments, two files, two
    tasks (a bare `<file>.jsonl` would go to the math JSONL reader)."""
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_task_splits
    from nrl_core.interfaces import ComponentContext

    examples = Path(__file__).parents[1] / "examples"
    config = resolve_config(
        "grpo",
        overrides=[
            "data.tasks=["
            f"{{name: cards, dataset: 'nemo_gym_jsonl:{examples / 'blackjack.jsonl'}', "
            "agent: nemo_gym},"
            f"{{name: talk, dataset: 'nemo_gym_jsonl:{examples / 'dialogue.jsonl'}', "
            "agent: nemo_gym}]"
        ],
        registry=nrl_registry,
    )
    splits = load_task_splits(config.data, nrl_registry, ComponentContext(config=config))
    for task, agent in (("cards", "blackjack_gymnasium_agent"), ("talk", "example_multi_turn")):
        train, val = splits[task]
        assert len(train) + len(val) == 8 and {s.task for s in train + val} == {task}
        assert all(s.metadata[ROW_KEY]["agent_ref"]["name"].startswith(agent) for s in train)


def test_a_dataset_that_reads_no_file_is_one_line(nrl_registry):
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_task_splits
    from nrl_core.interfaces import ComponentContext

    config = resolve_config(
        "grpo",
        overrides=["data.tasks=[{name: a, dataset: 'arithmetic:x.jsonl'}]"],
        registry=nrl_registry,
    )
    with pytest.raises(ConfigError, match="does not read a file"):
        load_task_splits(config.data, nrl_registry, ComponentContext(config=config))
