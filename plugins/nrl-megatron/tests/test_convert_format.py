"""``nrl convert``'s detection of the megatron checkpoint format (no megatron-core needed: it
only reads file names; the full round trip is in test_grpo_cli.py)."""

from __future__ import annotations

import pytest

from nrl_core.checkpoint import detect_format, megatron_ranks
from nrl_core.errors import ConfigError


def step_with(tmp_path, *files):
    policy = tmp_path / "step_3" / "policy"
    policy.mkdir(parents=True)
    for name in files:
        (policy / name).write_bytes(b"")
    return tmp_path / "step_3"


def test_megatron_rank_files_are_detected_and_counted(tmp_path):
    step = step_with(tmp_path, "rank0.pt", "rank1.pt", "rank3.pt")
    assert detect_format(step, "megatron") == "megatron_rank"
    assert megatron_ranks(step) == 2  # contiguous from rank0: rank3 without rank2 is ignored


def test_a_format_that_contradicts_the_config_is_a_user_error(tmp_path):
    step = step_with(tmp_path, "rank0.pt")
    with pytest.raises(ConfigError, match=r"is a megatron .* names policy.backend=dtensor"):
        detect_format(step, "dtensor")
    dcp = step_with(tmp_path / "other", ".metadata")
    with pytest.raises(ConfigError, match=r"is a dtensor .* names policy.backend=megatron"):
        detect_format(dcp, "megatron")


def test_an_empty_policy_folder_names_both_formats(tmp_path):
    with pytest.raises(ConfigError, match=r"rank0\.pt from the megatron policy"):
        detect_format(step_with(tmp_path), "megatron")
