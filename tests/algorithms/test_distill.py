"""`nrl run distill` through the real CLI: a 2-rank student, a 1-rank teacher, local Ray."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.algorithms.test_grpo_cli import metrics, run_nrl

pytestmark = pytest.mark.slow

SMALL = [
    "distill.num_prompts_per_step=4",
    "distill.num_generations_per_prompt=2",
    "distill.teacher_warmup_steps=2",
    "distill.topk=16",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
    "teacher.train_global_batch_size=8",
    "teacher.train_micro_batch_size=8",
    "data.max_val_samples=8",
    "cluster.num_cpus=2",
]


def run_distill(tmp_path: Path, *overrides: str, check: bool = True, quiet: bool = True):
    return run_nrl(tmp_path, *overrides, check=check, quiet=quiet, algorithm="distill", base=SMALL)


# One 4-step run read by the next two tests (a distillation run starts Ray, a 2-rank student
# and a 1-rank teacher: about 30 CPU-s before its first step): validation at steps 0 and 4,
# checkpoints at steps 2 and 4.
FOUR_STEPS = ["distill.max_num_steps=4", "distill.val_period=4", "checkpointing.save_period=2"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """The run folder (``run/``, ``ckpt/``) of one `nrl run distill` of FOUR_STEPS."""
    path = tmp_path_factory.mktemp("distill")
    run_distill(path, *FOUR_STEPS)
    return path


def test_four_steps_score_with_the_teacher_and_keep_it(four_steps, tmp_path):
    records = metrics(four_steps)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    start = records[0]
    assert start["teacher_warmup/steps"] == 2
    assert start["teacher_warmup/loss_last"] < start["teacher_warmup/loss_first"]
    assert 0 <= start["val/teacher_accuracy"] <= 1 and "val/accuracy" in start
    for record in records[1:]:
        # topk=16 of a 128-row vocabulary: the tail bucket holds the rest of the mass.
        assert 0 < record["train/teacher_topk_mass"] < 1
        assert record["train/kl_to_teacher"] == record["train/reverse_kl"] > 0
        assert record["train/loss"] == pytest.approx(record["train/kl_to_teacher"], rel=1e-6)
        assert math.isfinite(record["train/logprob_gap"]) and record["train/forward_kl"] > 0
        assert record["timing/step_s"] > record["timing/teacher_s"] > 0
        assert "train/reward_mean" in record
    assert "val/accuracy" in records[-1]
    assert (four_steps / "ckpt" / "step_4").is_dir()
    assert (four_steps / "ckpt" / "teacher_after_warmup" / "model.safetensors").is_file()

    # The charts go to a copy: the shared run folder stays as the run left it.
    run = tmp_path / "run"
    shutil.copytree(four_steps / "run", run)
    plot = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "plot", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    for chart in ("kl_to_teacher.png", "logprob_gap.png", "val_accuracy.png", "step_time.png"):
        assert (run / chart).stat().st_size > 1000


def test_resume_reproduces_the_uninterrupted_run(four_steps, tmp_path):
    """Resumed from step 2 to step 4 (the student from its checkpoint, the teacher from the
    snapshot its warm-up left): steps 3 and 4 are the uninterrupted run's. The uninterrupted
    run is the shared four-step run; a copy of it without its step-4 checkpoint is the run to
    resume (the resume drops its metrics after step 2): one run of its own instead of three (a
    reference, a stopped one, the resume), for CI time."""
    expected = {r["step"]: r for r in metrics(four_steps)}
    shutil.copytree(four_steps, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "ckpt" / "step_4")
    resumed_run = run_distill(tmp_path, *FOUR_STEPS, quiet=False)
    # Without whitespace: the console wraps long paths anywhere, even inside a word.
    said = "".join((resumed_run.stdout + resumed_run.stderr).split())
    assert "resumingfrom" in said and "ckpt/step_2" in said, said
    resumed = {r["step"]: r for r in metrics(tmp_path)}
    assert sorted(resumed) == sorted(expected) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in ("train/kl_to_teacher", "train/logprob_gap", "train/grad_norm"):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)


def test_without_an_environment_nothing_is_scored(tmp_path):
    # One student rank, not the recipe's two (a process fewer): what is tested is that no
    # environment scores anything, not the ranks; the teacher keeps the run on Ray.
    run_distill(
        tmp_path,
        "env.name=none",
        "distill.max_num_steps=1",
        "distill.teacher_warmup_steps=0",
        "policy.num_workers=1",
    )
    (record,) = [r for r in metrics(tmp_path) if r["step"] == 1]
    assert record["train/kl_to_teacher"] > 0
    assert not any("reward" in key or key.startswith("val/") for key in record)


def test_a_teacher_with_another_tokenizer_is_one_line_before_anything_starts(tmp_path):
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny import tiny_model_path

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_path(), teacher, ignore=shutil.ignore_patterns(".complete"))
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(teacher)
    result = run_distill(tmp_path, f"teacher.model_name={teacher}", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not share a tokenizer" in lines[0], result.stderr
    assert "<|extra|>" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run folder or Ray


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.name=nll", "loss.name=nll does not read a teacher's scores"),
        ("env.name=nowhere", "env.name"),
    ],
)
def test_misconfigurations_are_one_line(tmp_path, override, message):
    result = run_distill(tmp_path, override, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
