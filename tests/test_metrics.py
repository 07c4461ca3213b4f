"""``metrics.jsonl``: a run killed mid-write leaves a torn last line; resume and plots read on."""

from __future__ import annotations

import json

import pytest

from nrl_core.config.schema import LoggerConfig
from nrl_core.errors import ConfigError
from nrl_core.metrics import METRICS_FILE, MetricsLogger, read_metrics


def _write(run_dir, *records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / METRICS_FILE).write_text(text)


def test_resume_drops_a_torn_last_line_and_later_steps(tmp_path):
    _write(
        tmp_path, {"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3}, tail='{"step": 4, "x"'
    )
    logger = MetricsLogger(tmp_path, LoggerConfig(), resume_step=2)
    logger.log(3, {"x": 3.5})
    assert read_metrics(tmp_path) == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
        {"step": 3, "x": 3.5},
    ]


def test_read_metrics_tolerates_only_a_torn_last_line(tmp_path):
    _write(tmp_path, {"step": 1}, tail='{"step": 2, "trunc')
    assert read_metrics(tmp_path) == [{"step": 1}]
    _write(tmp_path, {"step": 1}, tail='not json\n{"step": 3}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_metrics(tmp_path)
