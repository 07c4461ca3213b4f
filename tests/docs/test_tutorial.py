"""Runs the commands of docs/tutorial.md, in order, as a reader would.

Every ```bash block of the page is run, in one shell (so ``cd`` carries over), in an empty
folder, with a fresh virtualenv that has nrl-core installed first on PATH. One substitution:
``pip install`` becomes ``uv pip install --no-deps``, because the fresh venv borrows the core's
heavy dependencies from the dev environment (see tests/test_plugin_template.py) and a resolver
would otherwise download torch and Ray again.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "docs" / "tutorial.md"


def _template_test_helpers():
    spec = importlib.util.spec_from_file_location(
        "_template_helpers", REPO / "tests" / "test_plugin_template.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tutorial_commands() -> list[str]:
    """The tutorial's shell commands, in page order."""
    blocks = re.findall(r"```bash\n(.*?)```", TUTORIAL.read_text(), re.S)
    return [line for block in blocks for line in block.strip().splitlines() if line.strip()]


def test_tutorial_has_the_steps_it_promises():
    commands = tutorial_commands()
    assert commands[0].startswith("nrl new-plugin --name")
    assert any(c.startswith("pip install -e ./nrl-reverse-words") for c in commands)
    assert any("pytest" in c for c in commands)
    assert any(" nrl run grpo --config examples/reverse_words_cpu.yaml" in c for c in commands)


@pytest.mark.slow
def test_tutorial_commands_run(tmp_path):
    helpers = _template_test_helpers()
    bin_dir = helpers.make_venv(tmp_path / "env", REPO)
    work = tmp_path / "work"
    work.mkdir()
    script = "set -euo pipefail\n" + "\n".join(
        c.replace("pip install ", "uv pip install --no-deps ") for c in tutorial_commands()
    )
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=work,
        env=helpers.run_env(bin_dir),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reverse_words" in result.stdout  # `nrl plugins` lists the new plugin
    assert re.search(r"\d+ passed", result.stdout) and " failed" not in result.stdout
    metrics = work / "nrl-reverse-words" / "runs" / "reverse_words" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()]
    assert len(records) >= 2
