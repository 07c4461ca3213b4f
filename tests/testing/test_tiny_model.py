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
