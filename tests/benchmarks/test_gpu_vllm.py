"""benchmarks/gpu_vllm.py (the vLLM chain's GPU run) on CPU: its run resolves, its figures add up.

The run itself needs a GPU; here the same overrides go through nrl's real config resolution
(``nrl config show grpo``), and the JSON's arithmetic runs on recorded-shaped data.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_vllm.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runs_overrides_resolve_to_a_colocated_multi_turn_vllm_run(tmp_path):
    gv = load_script()
    overrides = gv.grpo_overrides("tiny", str(tmp_path / "logs"), cpus=16, gpus=1, limit_s=400)
    result = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "config", "show", "grpo", *overrides],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    shown = result.stdout
    for line in (
        "backend: vllm",
        "enforce_eager: true",
        "gpu_memory_utilization: 0.3",
        "val_period: 1",
        f"max_rollout_turns: {gv.TURNS}",
        f"max_num_steps: {gv.STEPS}",
        "dataset: guess_number",
        "on_policy_shortcut: false",
    ):
        assert line in shown, line
    assert "colocated: true" in shown  # the engine sleeps while the policy trains
    assert "\nsleep_level: 2" in shown or "  sleep_level: 2" in shown


def test_memory_summary_reads_the_engines_awake_and_asleep_levels():
    gv = load_script()
    mib = 1024
    # Start-up (policy loads), engine awake, asleep while training, awake, asleep, shut down.
    series = [1, 6, 48, 49, 7, 8, 47, 6, 0.5]
    summary = gv.memory_summary([(i, x * mib) for i, x in enumerate(series)], 143 * mib)
    assert summary["awake_peak_gib"] == 49
    # Between the first and the last awake sample: not the start-up's 1 nor the 6 and 0.5 of
    # the run's end.
    assert summary["asleep_min_gib"] == 7
    assert summary["freed_by_sleep_gib"] == 42
    assert summary["awake_stretches"] == 2 and summary["total_gib"] == 143
    # An engine that never sleeps frees nothing.
    flat = gv.memory_summary([(i, 48 * mib) for i in range(5)], None)
    assert flat["freed_by_sleep_gib"] == 0 and flat["awake_stretches"] == 1
    assert gv.memory_summary([], None) == {"samples": 0}


def test_step_figures_keep_each_steps_refit_and_logprob_gap():
    gv = load_script()
    records = [
        {"step": 0, "val/game/accuracy": 0.0},
        {"step": 1, "timing/step_s": 3.0, "timing/refit_s": 0.4, "train/gen_logprob_error": 1.01,
         "train/gen_logprob_error_max": 1.2, "train/loss": 0.1},
        {"step": 1, "val/game/accuracy": 0.125},
        {"step": 2, "timing/step_s": 2.0, "timing/refit_s": 0.3, "train/gen_logprob_error": 1.02,
         "train/gen_logprob_error_max": 1.3},
    ]  # fmt: skip
    figures = gv.step_figures(records)
    assert [s["timing/refit_s"] for s in figures["steps"]] == [0.4, 0.3]
    assert [s["train/gen_logprob_error_max"] for s in figures["steps"]] == [1.2, 1.3]
    assert "train/loss" not in figures["steps"][0]  # only the keys the report names
    assert [v["step"] for v in figures["validations"]] == [0, 1]
    assert gv._records(['{"step": 1}', '{"step": 2, "tim']) == [{"step": 1}]


@pytest.mark.parametrize("budget", ["10", "59"])
def test_a_budget_under_a_minute_is_one_error_line_and_exit_2(budget):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--budget-s", budget], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: --budget-s must be at least 60; got {budget}\n"
