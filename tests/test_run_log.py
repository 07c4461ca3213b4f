"""The run log's caps on captured output (issue 47): a line keeps its first MAX_LINE_BYTES,
a source writes about MAX_STEP_OUTPUT_BYTES per step, and one line says what was cut."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from nrl_core.run_log import (
    MAX_LINE_BYTES,
    MAX_STEP_OUTPUT_BYTES,
    RUN_LOG_FILE,
    RunLogWriter,
    log_output,
    open_run_log,
    step_done,
)

CUT = re.compile(r"\[nrl: output of (.+) cut: (\d+) bytes over the per-step cap of (\d+) bytes")


def _lines(tmp_path) -> list[str]:
    return (tmp_path / RUN_LOG_FILE).read_text().splitlines()


def _of(lines: list[str], source: str) -> list[str]:
    """The captured lines of ``source``, without the time and level."""
    return [line.split(f" INFO {source} ", 1)[1] for line in lines if f" INFO {source} " in line]


def test_a_long_line_keeps_its_first_bytes_and_says_how_many_were_cut(tmp_path):
    close = open_run_log(tmp_path)
    log_output("(w)", ["x" * (MAX_LINE_BYTES + 100), "é" * MAX_LINE_BYTES, "short"])
    close()
    long, wide, short = _of(_lines(tmp_path), "(w)")
    assert long == "x" * MAX_LINE_BYTES + (
        f" [nrl: line cut: 100 bytes over the per-line cap of {MAX_LINE_BYTES}]"
    )
    # Cut at a byte count, never inside a character: é is 2 bytes of UTF-8.
    assert wide == "é" * (MAX_LINE_BYTES // 2) + (
        f" [nrl: line cut: {MAX_LINE_BYTES} bytes over the per-line cap of {MAX_LINE_BYTES}]"
    )
    assert short == "short"


def test_each_source_writes_about_the_per_step_cap_and_one_line_says_what_was_cut(tmp_path):
    close = open_run_log(tmp_path)
    line = "y" * 1023  # 1 KiB with its newline
    lines_per_step = 2 * MAX_STEP_OUTPUT_BYTES // len(line)
    for step in (1, 2):
        log_output("(loud)", [f"{line}\n"] * lines_per_step)
        log_output("(quiet)", [f"step {step}"])
        step_done(step)
        step_done(step)  # the same step again (its validation): changes nothing
    log_output("(loud)", ["after the last step"])
    close()
    lines = _lines(tmp_path)
    kept = MAX_STEP_OUTPUT_BYTES // len(line) + (MAX_STEP_OUTPUT_BYTES % len(line) > 0)
    assert _of(lines, "(loud)") == [line] * kept + [line] * kept + ["after the last step"]
    assert _of(lines, "(quiet)") == ["step 1", "step 2"]  # another source keeps its own cap
    said = [CUT.search(x).groups() for x in lines if CUT.search(x)]
    dropped = str((lines_per_step - kept) * len(line))
    assert said == [("(loud)", dropped, str(MAX_STEP_OUTPUT_BYTES))] * 2  # once per step
    assert os.path.getsize(tmp_path / RUN_LOG_FILE) < 2 * (MAX_STEP_OUTPUT_BYTES + 64 * 1024)


def test_the_writer_holds_no_more_than_a_line_of_a_line_without_its_end(tmp_path):
    """In-process workers print through a RunLogWriter: 4 MiB written without a newline kept
    4 MiB waiting, and then all of it went to the run log."""
    close = open_run_log(tmp_path)
    writer = RunLogWriter("(w)")
    for _ in range(64):
        writer.write("z" * 65536)
        assert len(writer._pending) <= MAX_LINE_BYTES
    writer.write("\n")
    writer.write("\r10%" + " " * MAX_LINE_BYTES + "\r100% done\n")  # a progress bar: its last state
    close()
    cut, bar = _of(_lines(tmp_path), "(w)")
    extra = 64 * 65536 - MAX_LINE_BYTES
    assert cut == "z" * MAX_LINE_BYTES + (
        f" [nrl: line cut: {extra} bytes over the per-line cap of {MAX_LINE_BYTES}]"
    )
    assert bar == "100% done"


@pytest.mark.slow
def test_a_reward_function_that_prints_a_lot_leaves_a_bounded_run_log(tmp_path):
    """The issue's case: 4 MiB a call grew nrl.log to 1 GiB in one step. Here 4 MiB in one
    line and 400 lines of 4 KiB a call, 4 calls a step, 2 steps (about 35 MB)."""
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent(
            """
            def score(prompt, completion, **row):
                print("x" * (4 << 20))
                for _ in range(400):
                    print("y" * 4095)
                return 0.5
            """
        )
    )
    prompts = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(2) for b in range(2)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    run = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q", "data.dataset=prompts",
         "data.prompts.path=prompts.jsonl", "env.name=reward_fn",
         "env.reward_fn.path=my_reward.py:score", "policy.num_workers=1",
         "grpo.max_num_steps=2", "grpo.sft_warmup_steps=0", "grpo.val_period=0",
         "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
         "checkpointing.enabled=false", "logger.log_dir=runs", "logger.run_name=r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    log = tmp_path / "runs/r" / RUN_LOG_FILE
    size = os.path.getsize(log)
    # Two steps of one source, each at most the cap and a line, and the run's own lines.
    assert size < 2 * (MAX_STEP_OUTPUT_BYTES + MAX_LINE_BYTES) + 64 * 1024, size
    text = log.read_text()
    line_cut = f"[nrl: line cut: {(4 << 20) - MAX_LINE_BYTES} bytes over the per-line cap"
    assert line_cut in text
    said = [m.groups() for m in CUT.finditer(text)]
    assert len(said) == 2, said  # once a step
    assert all(int(n) > 4 * 400 * 4096 - MAX_STEP_OUTPUT_BYTES for _, n, _ in said), said
    assert all(s.startswith("(env-reward_fn rank 0") for s, _, _ in said), said
