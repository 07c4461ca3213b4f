"""The ``nemo_gym_jsonl`` dataset: NeMo Gym's JSONL rows as nrl samples.

Each row keeps all its fields (they go back to Gym's agent, and extra fields such as an
expected answer reach its ``/verify``); its ``responses_create_params.input`` also becomes the
sample's chat messages, which nrl uses for prompt-length checks and logs.
"""

from __future__ import annotations

from typing import Any

from nrl_core.data import Sample
from nrl_core.datasets import read_jsonl_rows
from nrl_core.errors import ConfigError
from nrl_gym.agent import ROW_KEY
from nrl_gym.config import NemoGymDataConfig


class NemoGymDataset:
    """Rows of ``data.nemo_gym_jsonl.path`` (``val_path`` for validation)."""

    def __init__(self, options: NemoGymDataConfig | None, context: Any = None) -> None:
        self.options = options or NemoGymDataConfig()

    def load(self, split: str) -> list[Sample]:
        if split == "train":
            path, key = self.options.path, "data.nemo_gym_jsonl.path"
        elif self.options.val_path:
            path, key = self.options.val_path, "data.nemo_gym_jsonl.val_path"
        else:
            raise KeyError(split)
        return [sample_of(row, where) for where, row in read_jsonl_rows(path, key=key)]


def sample_of(row: dict[str, Any], where: str) -> Sample:
    params = row.get("responses_create_params")
    if not isinstance(params, dict) or not isinstance(params.get("input"), list | str):
        raise ConfigError(
            f"{where}: a NeMo Gym row needs responses_create_params.input (a list of messages)"
        )
    name = (
        (row.get("agent_ref") or {}).get("name") if isinstance(row.get("agent_ref"), dict) else None
    )
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: a NeMo Gym row needs agent_ref.name (the agent to run it)")
    items = params["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": role, "content": str(content or "")})
    return Sample(messages=messages, metadata={ROW_KEY: row})
