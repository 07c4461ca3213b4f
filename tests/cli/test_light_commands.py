"""Commands that only read configuration never import torch, ray or transformers.

Importing torch alone takes 2-3 s on an idle machine and tens of seconds on a loaded one
(issue 39: `nrl config show grpo` 39-108 s, a misspelled key 15-27 s, `nrl doctor` 35 s), so
``--help``, ``nrl config show``, ``nrl doctor``, ``nrl eval --show-config`` and every config
error must answer without them. Each command runs in a fresh interpreter (a module imported by
an earlier test would hide the import) through a wrapper that prints which heavy modules ended
up in ``sys.modules``. Nothing here is timed: what is checked is what makes them slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "transformers", "datasets", "vllm", "sglang", "megatron")

_WRAPPER = """
import contextlib, io, json, sys
from nrl_core.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # argparse: --help, usage errors
        code = exc.code
heavy = [m for m in json.loads(HEAVY) if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy, "out": out.getvalue(), "err": err.getvalue()}))
"""


def light(*args: str) -> dict:
    """Run ``nrl ARGS`` in a fresh interpreter; its exit code, output and heavy imports."""
    code = _WRAPPER.replace("json.loads(HEAVY)", repr(list(HEAVY)))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "exit_code", "says"),
    [
        (["--help"], 0, "usage: nrl"),
        (["run", "grpo", "--help"], 0, "usage: nrl run"),
        (["config", "show", "grpo"], 0, "grpo:"),
        (["config", "show", "sft"], 0, "sft:"),
        (["config", "show", "dpo"], 0, "dpo:"),
        (["config", "show", "rm"], 0, "rm:"),
        (["config", "show", "distill"], 0, "distill:"),
        (["eval", "--show-config"], 0, "eval:"),
        (["doctor"], 0, "usable here"),
        (["run", "grpo", "grpo.max_num_stpes=3"], 2, "did you mean grpo.max_num_steps?"),
        (["config", "show", "grpo", "grpo.max_num_steps=abc"], 2, "expected int"),
        (["run", "grpo", "data.dataset=/no/such/file.jsonl"], 2, "does not exist"),
        (["eval", "eval.num_samples=x"], 2, "expected int"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_configuration_commands_import_no_heavy_module(args, exit_code, says):
    result = light(*args)
    assert result["code"] == exit_code, result
    assert says in result["out"] + result["err"], result
    assert result["heavy"] == [], f"`nrl {' '.join(args)}` imported {result['heavy']}"


def test_doctor_still_finds_a_broken_target_without_importing_it():
    """The static check of ``nrl doctor`` sees what importing would: the built-in components'
    targets exist, and ``-v`` (which imports them all) agrees on every row."""
    fast = light("doctor")
    slow = light("doctor", "-v")
    assert fast["code"] == slow["code"] == 0
    assert "torch" in slow["heavy"]  # -v is the real import, for comparison

    def rows(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith("  ")]

    assert rows(fast["out"]) == rows(slow["out"])


def test_uv_run_does_not_compile_the_venv_every_time():
    """`[tool.uv] compile-bytecode` makes every `uv run` (each syncs first) walk and recompile
    the whole venv: 21,692 files, 4.5-9.3 s per command on a loaded machine (issue 39). The
    installs compile once instead: CI's sync and the nox sessions' pass --compile-bytecode."""
    uv = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]
    assert "compile-bytecode" not in uv
    assert "uv sync --locked --compile-bytecode" in (REPO / ".ci" / "run").read_text()
    assert '"--compile-bytecode"' in (REPO / "noxfile.py").read_text()
