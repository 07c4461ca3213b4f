"""``benchmarks/async_grpo.py``'s own logic: argument parsing, the three configurations'
overrides, and the table and last line it prints from each configuration's step records (the
runs themselves memorize a model and start nrl nine times: ``nox -s bench-async``)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "async_grpo.py"


@pytest.fixture(scope="module")
def bench():
    # The script imports its sibling scripts (grpo_step, packing) as top-level modules.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("async_grpo_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_arguments_and_configurations(bench):
    args = bench.parse_args(["--steps", "3", "--warmup", "1", "--rounds", "1", "a.b=1"])
    assert (args.steps, args.warmup, args.rounds, args.engines) == (3, 1, 1, 2)
    assert args.overrides == ["a.b=1"]
    variants = bench.configs(engines=2, groups_per_call=2, max_tokens_per_call=16)
    assert set(variants) == set(bench.CONFIGS)
    for overrides in variants.values():  # every configuration on the same separate engines
        assert "generation.colocated=false" in overrides
        assert "generation.num_engines=2" in overrides
    assert not any(o.startswith("grpo.async") for o in variants["sync"])
    assert "grpo.async.groups_per_call=0" in variants["async_batch"]
    assert not any("in_flight" in o for o in variants["async_batch"])
    assert {
        "grpo.async.groups_per_call=2",
        "grpo.async.in_flight_weight_updates=true",
        "grpo.async.max_tokens_per_call=16",
    } <= set(variants["async_inflight"])


def test_answers_have_the_drawn_lengths(bench):
    assert [len(bench.answer(n)) for n in (8, 26, 27, 60)] == [8, 26, 27, 60]
    assert bench.answer(28) == "abcdefghijklmnopqrstuvwxyzab"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "2", "--warmup", "2"], "--steps (2) must exceed --warmup (2)"),
        (["--engines", "0"], "--engines (0) must be at least 1"),
        (["--longest", "4"], "--longest (4) must be at least 8"),
        (["policy.num_workers"], "overrides must be KEY=VALUE"),
    ],
)
def test_bad_input_is_one_line_exit_2(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def record(step_s: float, generation_s: float, idle: float | None = None) -> dict:
    r = {
        "timing/step_s": step_s,
        "timing/generation_s": generation_s,
        "train/response_length_mean": 12.0,
    }
    if idle is not None:
        r["async/engine_idle_fraction"] = idle
    return r


def test_table_and_last_line(bench):
    runs = {
        # two rounds each; steps/min = 60 * steps / sum(step_s)
        "sync": [[record(2.0, 1.5)] * 2, [record(1.0, 0.5)] * 2],
        "async_batch": [[record(1.5, 0.0, 0.4)] * 3, [record(1.5, 0.0, 0.2)]],
        "async_inflight": [[record(1.0, 0.0, 0.1)] * 2, [record(1.0, 0.0, 0.1)] * 2],
    }
    lines = bench.summarize(runs)
    assert lines[0].split()[:4] == ["config", "step_s", "steps/min", "engine_idle"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(rows) == set(bench.CONFIGS)
    assert float(rows["sync"][2]) == pytest.approx(60 * 4 / 6.0, abs=0.05)
    # sync's idle share is what the step spends outside generation: median of 0.25 and 0.5
    assert float(rows["sync"][3]) == pytest.approx(0.375, abs=0.0051)  # printed to 2 places
    assert float(rows["async_batch"][3]) == pytest.approx(0.4, abs=0.005)
    assert rows["async_batch"][5:] == ["40.0", "40.0"]  # each round's steps per minute
    last = lines[-1]
    assert re.fullmatch(r"inflight_over_batch_async=\d+\.\d{3}", last), last
    assert float(last.split("=")[1]) == pytest.approx((60 / 1.0) / (60 / 1.5), abs=0.001)


@pytest.mark.slow  # a process: the script as nox runs it, stopping at its argument check
def test_script_rejects_bad_steps_before_anything_heavy():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "1", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "async_grpo.py: --steps (1) must exceed --warmup (1)"


def test_convergence_arguments_and_configurations(bench):
    args = bench.parse_args(["--convergence", "--seeds", "42,1,2", "--ages", "1,2"])
    assert args.convergence and args.seeds == [42, 1, 2] and args.ages == [1, 2]
    assert not bench.parse_args([]).convergence  # steps per minute stays the default
    variants = bench.convergence_configs(
        [1, 2], engines=2, groups_per_call=4, max_tokens_per_call=0
    )
    assert list(variants) == ["sync", "age1", "age2"]
    assert variants["sync"] == []  # the main job exactly as the README runs it
    for age in (1, 2):
        assert {
            "generation.colocated=false",
            "generation.num_engines=2",
            "grpo.async.enabled=true",
            f"grpo.async.max_trajectory_age_steps={age}",
            "grpo.async.groups_per_call=4",
            "grpo.async.in_flight_weight_updates=true",
        } <= set(variants[f"age{age}"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ages", "0,1"], "--ages (0,1) must be 1 or more"),
        (["--seeds", "42,x"], "--seeds ('42,x') must be integers separated by commas"),
        (["--seeds", "1,1"], "--seeds (1,1) repeats a value"),
    ],
)
def test_bad_convergence_input_is_one_line_exit_2(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--convergence", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_convergence_out_must_be_new_or_empty(bench, capsys, tmp_path):
    # An earlier run's folder under --out: `nrl run` would resume it instead of training anew.
    (tmp_path / "sync-seed42").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--convergence", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is not empty" in err and err.count("\n") == 1
    empty = tmp_path / "new"
    assert bench.parse_args(["--convergence", "--out", str(empty)]).out == str(empty)


def job(final: float, best: float, rewards: list[float], step_s: float, age: float = 0.0):
    """A run's metrics records as the main job writes them: validation at step 0, in the
    middle and at the end, one record per step."""
    records = [{"step": 0, "val/accuracy": 0.1}]
    last = len(rewards)
    for step, reward in enumerate(rewards, start=1):
        r = {"step": step, "timing/step_s": step_s, "train/reward_mean": reward}
        if age:
            r["async/trajectory_age_mean"] = age
        if step == last // 2:
            r["val/accuracy"] = best
        if step == last:
            r["val/accuracy"] = final
        records.append(r)
    return records


def test_run_figures(bench):
    figures = bench.run_figures(job(0.9, 0.95, [0.0, 0.5, 1.0, 1.0], 30.0, age=1.5), 200.0)
    assert (figures["final"], figures["best"], figures["age"]) == (0.9, 0.95, 1.5)
    assert (figures["wall_s"], figures["train_s"]) == (200.0, 120.0)
    assert figures["curve"][1] == (60.0, 2, 0.5)  # (training seconds so far, step, reward)


def test_convergence_table_and_verdict(bench):
    def fig(final, rewards=(0.0, 0.5, 1.0, 1.0), step_s=30.0, age=0.0):
        return bench.run_figures(job(final, 1.0, list(rewards), step_s, age), 100.0)

    sync = {42: fig(0.9), 1: fig(1.0), 2: fig(0.95)}
    results = {
        "sync": sync,
        "age1": {42: fig(1.0, age=1.0), 1: fig(1.0, age=1.0), 2: fig(0.9, age=1.0)},
        "age2": {42: fig(0.85, step_s=45.0), 1: fig(1.0, step_s=45.0), 2: fig(0.95, step_s=45.0)},
    }
    lines = bench.convergence_summary(results, windows=2)
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows["sync"][1:7] == ["0.900", "1.000", "0.950", "0.950", "1.000", "3/3"]
    assert rows["age1"][4] == "0.967" and rows["age1"][6] == "3/3"  # above the band counts
    assert rows["age1"][7] == "1.00"  # mean trajectory age
    assert rows["age2"][4] == "0.933" and rows["age2"][6] == "2/3"  # seed 42 under 0.9
    assert rows["age2"][9] == "180"  # training seconds: 4 steps of 45 s
    assert "[0.900, 1.000]" in lines[4]
    by_step = lines[lines.index("train reward by step: 1-2 3-4") + 1].split()
    assert by_step == ["sync", "0.250", "1.000"]
    minute = lines.index("train reward by minute of training: 1 2 3")
    # age2's steps end at 45, 90, 135, 180 s: one per minute after the first
    assert lines[minute + 3].split() == ["age2", "0.000", "0.500", "1.000"]
    assert lines[-1] == "async_within_sync_band=yes age1=0.967 age2=0.933 sync=0.900-1.000"

    # a mean under the band's minimum, or a run that failed, is a "no"
    results["age2"][42] = fig(0.5)
    assert bench.convergence_summary(results)[-1].startswith("async_within_sync_band=no ")
    results["age2"][42] = None
    lines = bench.convergence_summary(results)
    assert "failed" in lines[3] and lines[-1].startswith("async_within_sync_band=no ")


def test_cpu_profile_roles_and_phases(bench):
    assert bench._role("python -m nrl_core.cli run grpo", 7, 7) == "driver"
    assert bench._role("ray::nrl-policy-1.train", 7, 8) == "policy"
    assert bench._role("ray::nrl-generation-0", 7, 9) == "generation"
    assert bench._role("ray::DashboardAgent", 7, 10) == "ray-system"
    assert bench._role("/venv/bin/raylet --raylet_socket_name=x", 7, 11) == "ray-system"
    records = [
        {"timing/train_s": t, "timing/refit_s": 0.1, "timing/generation_s": 0.0} for t in (1, 2, 9)
    ]
    assert bench.phases(records) == "step: train_s=2.000 refit_s=0.100 wait_s=0.000"


def test_cpu_profile_report_takes_the_steady_steps(bench, tmp_path):
    profile = bench.CpuProfile(tmp_path / "metrics.jsonl")
    profile.roles = {1: "driver", 2: "policy", 3: "policy"}
    s = 1_000_000_000  # schedstat counts nanoseconds
    machine = [(0, 0), (100, 200), (300, 400), (500, 600)]  # busy, total jiffies
    profile.samples = [
        (0.0, 0, machine[0], {1: (5 * s, 0), 2: (9 * s, 0)}),  # start-up: not counted
        (10.0, 2, machine[1], {1: (6 * s, 0), 2: (10 * s, 1 * s), 3: (0, 0)}),
        (20.0, 4, machine[2], {1: (8 * s, 0), 2: (15 * s, 2 * s), 3: (5 * s, 1 * s)}),
        (30.0, 4, machine[3], {1: (99 * s, 0), 2: (99 * s, 0), 3: (99 * s, 0)}),  # shut-down
    ]
    lines = profile.report(warmup=2)
    assert "2 steps in 10.0 s (5.000 s/step)" in lines[0]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert rows["driver"] == [1.0, 0.0, 0.2, 0.2]  # 2 s on a CPU over 2 steps, 10 s wall
    assert rows["policy"] == [5.0, 1.0, 1.0, 1.2]  # ranks 2 and 3: 5 + 5 s, queued 1 + 1 s
    assert rows["total"] == [6.0, 1.0, 1.2, 1.4]


def test_configs_choose_the_runs(bench, capsys):
    assert bench.parse_args([]).configs == list(bench.CONFIGS)
    assert bench.parse_args(["--configs", "async_inflight,async_batch"]).configs == [
        "async_inflight",
        "async_batch",
    ]
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--configs", "sync,async_batch"])  # no ratio without async_inflight
    assert exit_info.value.code == 2
    assert "must name async_batch and async_inflight" in capsys.readouterr().err


def test_schedstat_reads_this_process(bench):
    import os
    import time

    before = bench._schedstat(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:  # 50 ms on a CPU
        pass
    after = bench._schedstat(os.getpid())
    # /proc/<pid>/stat counts clock ticks (10 ms), so allow one either side
    assert 0.03e9 <= after[0] - before[0] <= 0.2e9
    assert after[1] >= before[1] >= 0
    assert bench._schedstat(2**22 + 1) is None  # past pid_max: no such process
