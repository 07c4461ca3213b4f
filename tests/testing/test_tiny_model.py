"""The tiny model is built quietly: it is built in the driver of `nrl run`, whose console third-
party output must not reach (issue 39: a "Writing model shards" bar did)."""

from __future__ import annotations

import subprocess
import sys

BUILD = """
import sys
from transformers.utils import logging
from nrl_core.testing.tiny import build_tiny_model
build_tiny_model(sys.argv[1], hidden_size=16, num_layers=1)
print("bars still on:", logging.is_progress_bar_enabled())
"""


def test_building_the_tiny_model_prints_no_progress_bar(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Writing model shards" not in done.stderr + done.stdout
    assert (tmp_path / "tiny" / "config.json").is_file()
    # Only for the build: transformers' own setting is as it was.
    assert "bars still on: True" in done.stdout


def test_every_named_family_builds_its_published_model_type(tmp_path):
    """Each ``tiny-<arch>`` name of the newer families (issue 48) builds the architecture it
    names, saved and loaded through ``from_pretrained``'s config; an unknown arch is refused
    naming the ones there are."""
    import pytest
    from transformers import AutoConfig

    from nrl_core.testing.tiny import ARCHS, NAMED_SIZES, build_tiny_model

    expected = {
        "tiny-qwen3_5": "qwen3_5_text",
        "tiny-qwen3_5_moe": "qwen3_5_moe_text",
        "tiny-gpt_oss": "gpt_oss",
        "tiny-llama4": "llama4_text",
    }
    for name, model_type in expected.items():
        arch = NAMED_SIZES[name]["arch"]
        assert arch in ARCHS
        path = build_tiny_model(tmp_path / name, arch=arch, hidden_size=32, num_layers=4)
        assert AutoConfig.from_pretrained(path).model_type == model_type
    with pytest.raises(ValueError, match="gpt_oss"):
        build_tiny_model(tmp_path / "x", arch="gpt2")


def test_tiny_llama4_takes_its_chunk_and_keeps_temperature_tuning_for_vllm(tmp_path):
    """``attention_chunk_size`` reaches the config (vLLM's CPU build needs 128); the attention
    temperature tuning transformers applies is also in generation_config.json, where vLLM
    reads it (off below 32K context otherwise)."""
    import json

    from transformers import AutoConfig

    from nrl_core.testing.tiny import build_tiny_model

    path = build_tiny_model(
        tmp_path / "l4", arch="llama4", hidden_size=32, num_layers=4, attention_chunk_size=128
    )
    config = AutoConfig.from_pretrained(path)
    assert config.attention_chunk_size == 128 and config.attn_temperature_tuning is True
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["attn_temperature_tuning"] is True
    default = build_tiny_model(tmp_path / "l4-16", arch="llama4", hidden_size=32, num_layers=4)
    assert AutoConfig.from_pretrained(default).attention_chunk_size == 16
