"""The ``inprocess`` cluster: which runs ``auto`` puts in process, the one-line refusal of an
explicit ``inprocess`` it cannot host, Ctrl-C / SIGTERM, and the main recipe through it and
through Ray computing the same metrics and weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nrl_core.config.loader import resolve_config
from nrl_core.distributed.errors import WorkerError
from nrl_core.distributed.inprocess import (
    InProcessWorkerGroup,
    _on_sigterm,
    cluster_backend,
    hosting_problem,
)
from nrl_core.plugins import PluginHost

ONE_RANK = [
    "policy.num_workers=1",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "grpo.sft_warmup_steps=1",
    "data.max_val_samples=8",
    "grpo.val_period=2",
    "cluster.num_cpus=2",
]


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


@pytest.fixture
def no_gpus(monkeypatch):
    """This machine's GPUs out of the way of the rule (the CPU path is what is tested)."""
    monkeypatch.setattr("nrl_core.distributed.devices.machine_has_gpus", lambda: False)


def grpo(registry, *overrides):
    return resolve_config("grpo", None, ["policy.model_name=tiny", *overrides], registry)


@pytest.mark.parametrize(
    ("overrides", "backend", "reason"),
    [
        ([], "inprocess", None),
        (["policy.num_workers=2"], "local", "policy.num_workers=2"),
        (["generation.torch.colocated=false"], "local", "separate engines"),
        (["agent.name=nope_agent"], "local", "policy endpoint"),
        (["policy.actor_env=/usr/bin/python3"], "local", "another interpreter"),
        (["cluster.backend=local"], "local", None),
        (["cluster.backend=inprocess"], "inprocess", None),
    ],
)
def test_auto_runs_in_process_only_where_that_is_exact(
    registry, no_gpus, overrides, backend, reason
):
    config = grpo(registry, "policy.num_workers=1", *overrides)
    assert cluster_backend(config, registry) == backend
    problem = hosting_problem(config, registry)
    assert (problem is None) if reason is None else (reason in problem)


def test_auto_keeps_ray_on_a_machine_with_gpus(registry, monkeypatch):
    monkeypatch.setattr("nrl_core.distributed.devices.machine_has_gpus", lambda: True)
    config = grpo(registry, "policy.num_workers=1")
    assert cluster_backend(config, registry) == "local"


def nrl(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
        **kwargs,
    )


def test_explicit_inprocess_with_two_ranks_is_refused_in_one_line_before_ray(tmp_path):
    started = time.monotonic()
    result = nrl(
        "run", "grpo", f"logger.log_dir={tmp_path}", "cluster.backend=inprocess", timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cluster.backend=inprocess cannot host this run: policy.num_workers=2" in lines[0]
    assert "cluster.backend=local" in lines[0]  # what to do instead
    assert "Traceback" not in result.stderr and not (tmp_path / "grpo-arithmetic").exists()
    assert time.monotonic() - started < 60


def run_grpo(tmp_path: Path, backend: str, *overrides: str, quiet: bool = True):
    return nrl(
        "run",
        "grpo",
        *(["-q"] if quiet else []),
        f"logger.log_dir={tmp_path}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"cluster.backend={backend}",
        *ONE_RANK,
        *overrides,
    )


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights_of(step: Path) -> dict:
    """The policy's state of a checkpoint (its DCP folder, read as torch does: the model's
    and the optimizer's tensors), flattened to ``{"model/name": value}``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step.parent / f"{step.name}.pt"
    dcp_to_torch_save(step / "policy", out)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(f"{prefix}[{index}]", item)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=True))
    return flat


@pytest.mark.slow
def test_main_recipe_in_process_equals_ray_bit_for_bit(tmp_path):
    """`nrl run grpo` with 1 rank, 3 steps (a warm-up step, validation at steps 0 and 2):
    through the in-process cluster and through a local Ray cluster. Every metric but the
    timings (and the tokens per second derived from them) and every weight are equal."""
    import torch

    results = {}
    for backend in ("inprocess", "local"):
        result = run_grpo(tmp_path / backend, backend, "grpo.max_num_steps=3")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        results[backend] = tmp_path / backend
    ours, theirs = (metrics_of(results[b] / "run") for b in ("inprocess", "local"))
    assert [m["step"] for m in ours] == [m["step"] for m in theirs] == [0, 1, 2, 3]

    def timeless(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/"))}

    assert [timeless(m) for m in ours] == [timeless(m) for m in theirs]
    assert any("train/loss" in m for m in ours) and any("val/accuracy" in m for m in ours)
    mine, yours = (weights_of(results[b] / "ckpt" / "step_3") for b in ("inprocess", "local"))
    assert mine.keys() == yours.keys()
    tensors = [name for name in mine if isinstance(mine[name], torch.Tensor)]
    assert any(n.startswith("/model/") for n in tensors) and len(tensors) > 10
    for name in mine:
        if isinstance(mine[name], torch.Tensor):
            assert torch.equal(mine[name], yours[name]), name
        else:
            assert mine[name] == yours[name], name
    # The run said where it ran, and started no Ray.
    log = (results["inprocess"] / "run" / "nrl.log").read_text()
    assert "in process" in log and "Started a local Ray instance" not in log


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_end_an_in_process_run_cleanly(tmp_path, signum, code):
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        f"logger.log_dir={tmp_path}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "cluster.backend=inprocess",
        *ONE_RANK,
        "grpo.max_num_steps=1000",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    try:
        for line in proc.stdout:  # off a terminal: one line per step
            if line.startswith("step "):
                break
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # The lock on the run folder went with the run: a new one may start there.
    assert not (tmp_path / "run" / ".nrl.lock").exists() or _unlocked(tmp_path / "run")


def _unlocked(folder: Path) -> bool:
    import fcntl

    with (folder / ".nrl.lock").open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


class _Exits:
    """A worker whose method ends its process as user code may."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def stop(self, code) -> None:
        sys.exit(code)

    def terminated(self) -> None:
        _on_sigterm(signal.SIGTERM, None)  # as if SIGTERM came during this call

    def ok(self) -> int:
        return 1


def test_a_workers_sys_exit_is_its_failure_not_the_end_of_the_driver():
    """A Ray actor's sys.exit() ends the actor, which the run reports; in process it ended the
    driver, with the worker's exit code (0: a run that stopped looked like success)."""
    group = InProcessWorkerGroup.start(_Exits, 1, name="env-test")
    try:
        for code, shown in ((0, "SystemExit: 0"), (None, "SystemExit"), (3, "SystemExit: 3")):
            with pytest.raises(WorkerError) as exc:
                group.run_one(0, "stop", code)
            assert str(exc.value).startswith(f"env-test rank 0 failed in stop: {shown} (")
            assert exc.value.exit_code == 1
        assert group.run_one(0, "ok") == 1  # the worker is still there
        # The run's own SIGTERM handler still ends the run, with 143.
        with pytest.raises(SystemExit) as stopped:
            group.run_one(0, "terminated")
        assert stopped.value.code == 143 and not isinstance(stopped.value, WorkerError)
    finally:
        group.shutdown()
