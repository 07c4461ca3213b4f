"""Runs docs/tutorial.md as a reader would, then the CI workflow the tutorial generates.

Every ```bash block of the page is run, in one shell (so ``cd`` and ``source`` carry over),
in an empty folder, as written: the tutorial makes its own virtualenv and installs nrl into it
from the clone (``NRL_SRC``, which the page tells the reader to set). Nothing of this
checkout's ``.venv`` is visible: ``PATH`` holds only ``uv`` and the system's folders.

Then the steps of the generated ``.github/workflows/ci.yml`` run in the generated project, in a
second fresh virtualenv, with the workflow's ``NRL_CORE`` / ``NRL_DTENSOR`` pointed at this
checkout instead of the git repository (the one substitution: no network here).

Both installs resolve from the package index; ``UV_CONSTRAINT`` pins them to ``uv.lock``'s
versions, so they are the tested ones and come from uv's cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "docs" / "tutorial.md"
PROJECT = "nrl-reverse-words"


# A ```bash block, or a file the reader writes: a block right after a line ending in
# "`NAME.ext`:" (the page says "write ... `my_reward.py`:" before showing the file).
_BLOCK = re.compile(r"(?:`([\w.-]+\.\w+)`:\n\n```\w*\n(.*?)```)|(?:```bash\n(.*?)```)", re.S)


def tutorial_steps(text: str | None = None) -> list[tuple[str, str]]:
    """The page's steps in order: ``("write NAME", text)`` for a file the reader writes,
    ``("run", line)`` for each shell command."""
    steps: list[tuple[str, str]] = []
    for name, content, bash in _BLOCK.findall(text if text is not None else TUTORIAL.read_text()):
        if name:
            steps.append((f"write {name}", content))
        else:
            steps += [("run", line) for line in bash.strip().splitlines() if line.strip()]
    return steps


def as_shell(steps: list[tuple[str, str]]) -> list[str]:
    """The steps as shell commands: a file the reader writes becomes a quoted here-document."""
    commands = []
    for kind, text in steps:
        if kind == "run":
            commands.append(text)
        else:
            assert "NRL_EOF" not in text
            commands.append(f"cat > {kind.split(' ', 1)[1]} <<'NRL_EOF'\n{text}NRL_EOF")
    return commands


def tutorial_commands() -> list[str]:
    """The tutorial's shell commands (and the files it has the reader write), in page order."""
    return as_shell(tutorial_steps())


REWARD_FN_SECTION = "## A reward function in one file (no plugin needed)"


def reward_fn_steps() -> list[tuple[str, str]]:
    """The steps of the tutorial's no-plugin section."""
    text = TUTORIAL.read_text()
    section = text.split(REWARD_FN_SECTION, 1)[1].split("\n## ", 1)[0]
    return tutorial_steps(section)


def test_tutorial_has_the_steps_it_promises():
    commands = tutorial_commands()
    assert commands[0].startswith("uv venv")
    assert any("uv pip install" in c and "$NRL_SRC" in c for c in commands)
    assert any(c.startswith("nrl new-plugin --name") for c in commands)
    assert any(c.startswith(f'uv pip install -e "./{PROJECT}[test]"') for c in commands)
    assert any("pytest" in c for c in commands)
    assert any(" nrl run grpo --config examples/reverse_words_cpu.yaml" in c for c in commands)


def test_the_no_plugin_path_needs_under_15_lines():
    """Issue 39: a custom reward took a packaged plugin (53 lines); TRL's takes 13."""
    steps = reward_fn_steps()
    assert [kind for kind, _ in steps] == ["write my_reward.py", "write prompts.jsonl", "run"]
    written = sum(len(text.strip().splitlines()) for _, text in steps)
    assert written < 15, f"{written} lines"
    assert "env.name=reward_fn env.reward_fn.path=my_reward.py:score" in steps[-1][1]


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """An environment without this checkout's venv: only ``uv`` and the system's PATH, and
    ``UV_CONSTRAINT`` pinning third-party packages to uv.lock."""
    tools = tmp_path / "tools"
    tools.mkdir()
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is needed to run the tutorial"
    (tools / "uv").symlink_to(uv)
    venv_bin = str(Path(sys.executable).parent)
    system_path = [p for p in os.environ["PATH"].split(os.pathsep) if p and p != venv_bin]
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        subprocess.check_output(
            [uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-dev",
             "--no-header", "--no-annotate"],
            cwd=REPO, text=True,
        )
    )  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT", "NRL_ACTOR_ENV")
    }
    env.update(
        PATH=os.pathsep.join([str(tools), *system_path]),
        NRL_SRC=str(REPO),
        UV_CONSTRAINT=str(constraints),
    )
    return env


def _run(script: str, cwd: Path, env: dict[str, str], timeout: int) -> str:
    result = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tutorial_and_its_generated_ci_run_as_written(tmp_path):
    env = _clean_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()

    output = _run("\n".join(tutorial_commands()), work, env, timeout=900)
    # The no-plugin section (a reward function in one file): its one GRPO step ran, and every
    # reward call returned a number. (Its own test ran the section again with this checkout's
    # nrl: one nrl run more, the same commands.)
    records = [json.loads(line) for line in (work / "runs/grpo-arithmetic/metrics.jsonl").open()]
    steps = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1], output[-3000:]
    assert steps[0].get("train/env_errors", 0) == 0, steps[0]
    assert "reverse_words" in output  # `nrl plugins` lists the new plugin
    assert re.search(r"\d+ passed", output) and " failed" not in output
    # nrl is installed into the tutorial's own venv (its `nrl` script, its torch), from the
    # clone: uv installs a workspace's members editable, so the package is the clone's.
    venv_python = work / "nrl-env" / "bin" / "python"
    assert (work / "nrl-env" / "bin" / "nrl").is_file()
    where = subprocess.check_output(
        [
            str(venv_python),
            "-c",
            "import nrl_core, torch; print(nrl_core.__file__, torch.__file__)",
        ],
        cwd=work,  # not this checkout: `python -c` imports from the working folder first
        text=True,
    ).split()
    assert where[0] == str(REPO / "nrl_core" / "__init__.py")
    assert where[1].startswith(str(work / "nrl-env")), where
    metrics = work / PROJECT / "runs" / "reverse_words" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records if "train/reward_mean" in r] == [1, 2]

    project = work / PROJECT
    workflow = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())
    ci_env = {**env, **workflow["env"]}
    ci_env.update(
        NRL_CORE=str(REPO),
        NRL_DTENSOR=str(REPO / "plugins" / "nrl-dtensor"),
        RUNNER_TEMP=str(tmp_path),  # set by GitHub Actions on its runners
    )
    runs = [step for step in workflow["jobs"]["test"]["steps"] if "run" in step]
    assert [step["name"] for step in runs] == [
        "Install",
        "Tests",
        "GRPO smoke run (2 steps, tiny model)",
    ]
    for step in runs:
        output = _run(step["run"], project, {**ci_env, **step.get("env", {})}, timeout=600)
        if step["name"] == "Tests":
            assert re.search(r"\d+ passed", output) and " failed" not in output
    ci_metrics = tmp_path / "nrl-ci" / "reverse_words" / "metrics.jsonl"
    assert len(ci_metrics.read_text().splitlines()) >= 2
    assert (project / ".venv" / "bin" / "nrl").is_file()  # the workflow's own venv
