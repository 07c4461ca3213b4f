"""``benchmarks/cpu_seconds.py``'s own logic: naming a run's processes and splitting their
sampled CPU time into steps (the run itself takes minutes: see docs/performance.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_seconds.py"


@pytest.fixture(scope="module")
def cpu_seconds():
    spec = importlib.util.spec_from_file_location("cpu_seconds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_process_group_names_the_run_processes(cpu_seconds):
    group = cpu_seconds.process_group
    assert group("/venv/bin/python -m nrl_core.cli run grpo -q x=1") == "driver"
    assert group("ray::nrl-policy-0" + " " * 80) == "ray::nrl-policy-0"
    assert group("ray::nrl-generation-vllm-0.call_sharded   ") == "ray::nrl-generation-vllm-0"
    assert group("VLLM::EngineCore    ") == "VLLM::EngineCore"
    assert group("/venv/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=x") == "raylet"
    assert group("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --x") == (
        "log_monitor.py"
    )
    assert group("") == "?"


def test_cpu_per_step_splits_cpu_time_at_the_logged_steps(cpu_seconds):
    # (time, steps logged, {pid: (cmdline, cumulative CPU-s)}); pid 3 starts in step 2 and
    # exits (empty command line) in its last sample.
    samples = [
        (0.0, 0, {1: ("python -m nrl_core.cli run", 0.5), 2: ("ray::nrl-policy-0", 0.0)}),
        (1.0, 0, {1: ("python -m nrl_core.cli run", 0.7), 2: ("ray::nrl-policy-0", 1.0)}),
        (2.5, 1, {1: ("python -m nrl_core.cli run", 0.8), 2: ("ray::nrl-policy-0", 2.0)}),
        (3.0, 1, {2: ("ray::nrl-policy-0", 2.5), 3: ("VLLM::Worker", 0.25)}),
        (4.5, 2, {2: ("ray::nrl-policy-0", 3.0), 3: ("", 1.25)}),
    ]
    steps = cpu_seconds.cpu_per_step(samples)
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["wall_s"] for s in steps] == [2.5, 2.0]
    assert steps[0]["cpu"] == {"driver": pytest.approx(0.3), "ray::nrl-policy-0": 2.0}
    assert steps[1]["cpu"] == {"ray::nrl-policy-0": 1.0, "VLLM::Worker": 1.25}


def test_bad_arguments_exit_2_in_one_line():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "1"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "cpu_seconds.py: --steps (1) must be at least 2 (the first carries start-up)"
    )
