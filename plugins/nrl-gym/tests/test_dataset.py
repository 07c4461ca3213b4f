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
