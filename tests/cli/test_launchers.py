"""Every way of launching ``nrl run`` gives the same run, and leaves nothing behind.

The four launchers a user meets: ``uv run nrl``, ``uv run --no-sync nrl``, the venv's ``nrl``
script, and ``python -m nrl_core.cli``. Under ``uv run``, Ray used to start every worker with
``uv run`` in a copy of the working directory (its uv-run hook, now disabled by nrl): a
throw-away venv per run under the Ray temp folder's ``runtime_resources/``.

``uv run`` without ``--no-sync`` syncs the project venv first, and that venv is shared with the
rest of the test session. So it runs with ``--locked`` (a stale ``uv.lock`` is an error, never
rewritten), and only after ``uv sync --locked --inexact --dry-run`` (what ``uv run`` does by
default: inexact, installs what is missing, removes nothing) reported that it would make no
changes; the venv's installed distributions are compared before and after all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
    "grpo.sft_warmup_steps=0",
    "grpo.val_period=0",
    "grpo.max_num_steps=2",
    "checkpointing.enabled=false",
    "cluster.num_cpus=2",
    "seed=7",
    # One policy rank, still on Ray (`auto` would host it in the `nrl` process, where no Ray
    # worker starts and the uv-run hook could not show): one worker process is what the hook
    # would have given a throw-away venv, and the runs' numbers do not depend on the rank count.
    "policy.num_workers=1",
    "cluster.backend=local",
]
TIME_KEYS = ("timing/", "throughput/")  # and rates such as refit/gb_per_s


def _uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _launchers() -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    return {
        "uv run --locked": [_uv(), "run", "--locked", "nrl"],
        "uv run --no-sync": [_uv(), "run", "--no-sync", "nrl"],
        "venv script": [str(bin_dir / "nrl")],
        "python -m": [sys.executable, "-m", "nrl_core.cli"],
    }


def _installed(python: str) -> list[tuple[str, int]]:
    """The distributions installed in ``python``'s environment (name, dist-info mtime)."""
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return sorted(
        (p.name, p.stat().st_mtime_ns) for p in Path(site).iterdir() if p.suffix == ".dist-info"
    )


def _numbers(path: Path) -> list[dict[str, float]]:
    """The metrics records without the timing-dependent values."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {
            k: v
            for k, v in record.items()
            if not k.startswith(TIME_KEYS) and not k.endswith("_per_s")
        }
        for record in records
    ]


def _run(name: str, prefix: list[str], tmp_path: Path) -> tuple[list[dict], list[str]]:
    """Run ``prefix run grpo`` in the repo root with a private temp root; return the metrics
    and the files seen under any ``runtime_resources/`` folder while it ran."""
    root = Path(tempfile.mkdtemp(prefix="nrl-l-", dir="/tmp"))  # short: Ray's socket paths
    log_dir = tmp_path / name.replace(" ", "_")
    env = {**os.environ, "NRL_ACTOR_ENV": "system", "TMPDIR": str(root)}
    env.pop("VIRTUAL_ENV", None)  # as a user's shell: uv finds the project's own venv
    command = [*prefix, "run", "grpo", "-q", f"logger.log_dir={log_dir}", "logger.run_name=r"]
    try:
        proc = subprocess.Popen(
            [*command, *TINY],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        runtime_files: set[str] = set()
        while proc.poll() is None:
            for folder in root.glob("nrl-ray-*/session_*/runtime_resources"):
                runtime_files |= {str(p) for p in folder.rglob("*") if p.is_file()}
            time.sleep(0.5)
        err = proc.stderr.read()
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        left = sorted(p.name for p in root.iterdir() if p.name.startswith(("nrl-ray-", "ray")))
        assert left == [], f"{name} left Ray temp folders behind: {left}"
        return _numbers(log_dir / "r" / "metrics.jsonl"), sorted(runtime_files)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_launcher_gives_the_same_run_and_leaves_nothing_behind(tmp_path):
    dry_run = subprocess.run(
        [_uv(), "sync", "--locked", "--inexact", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        timeout=300,
    )
    if dry_run.returncode != 0 or "Would make no changes" not in dry_run.stderr + dry_run.stdout:
        pytest.fail(
            "`uv run` would change the project venv (out of sync with uv.lock); run `uv sync` "
            f"first:\n{dry_run.stderr[-2000:]}"
        )
    before = _installed(sys.executable)
    results = {name: _run(name, prefix, tmp_path) for name, prefix in _launchers().items()}
    assert _installed(sys.executable) == before, "a launcher changed the project venv"

    for name, (_, runtime_files) in results.items():
        assert runtime_files == [], f"{name} made a throw-away environment: {runtime_files[:5]}"
    reference_name = "python -m"
    reference = results[reference_name][0]
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert "train/loss" in reference[1] and "train/reward_mean" in reference[1]
    for name, (records, _) in results.items():
        assert len(records) == len(reference), name
        for got, expected in zip(records, reference, strict=True):
            assert set(got) == set(expected), (name, set(got) ^ set(expected))
            for key, value in expected.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), (name, key)
                else:  # step numbers, counts, and null for a metric a step has no data for
                    assert got[key] == value, (name, key)
