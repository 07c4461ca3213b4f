"""Issue 39, item 5: every built-in recipe in a venv with only ``nrl-core[dtensor]`` (the
tutorial's install): ``nrl config show``, ``nrl run --help`` and ``nrl eval``'s config
resolution either work or are refused in one line naming the plugin to install.

One venv, built the tutorial's way (uv, third-party packages pinned to uv.lock), for every
command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.algorithms.recipes import recipe_names
from nrl_core.config.schema import ALGORITHM_CONFIGS

REPO = Path(__file__).resolve().parents[2]
# What a recipe selects that nrl-core[dtensor] lacks, and the plugin a refusal must name.
MISSING_PLUGIN = "nrl-math-env"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core_only(tmp_path_factory) -> Path:
    """The ``bin`` folder of a fresh venv with ``nrl-core[dtensor]`` from this checkout."""
    root = tmp_path_factory.mktemp("core-only")
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is needed to build the nrl-core[dtensor] venv")
    constraints = root / "constraints.txt"
    constraints.write_text(
        subprocess.check_output(
            [uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-dev",
             "--no-header", "--no-annotate"],
            cwd=REPO, text=True,
        )
    )  # fmt: skip
    env = _env({"UV_CONSTRAINT": str(constraints)})
    venv = root / "venv"
    for command in (
        [uv, "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)],
        [uv, "pip", "install", "--python", str(venv / "bin" / "python"), f"{REPO}[dtensor]"],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run(
        [str(venv / "bin" / "nrl"), "plugins"], env=env, capture_output=True, text=True
    )
    assert "nrl-dtensor" in listed.stdout and MISSING_PLUGIN not in listed.stdout, listed.stdout
    return venv / "bin"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT", "NRL_ACTOR_ENV", "NRL_PLUGINS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **(extra or {})}


def _commands() -> list[list[str]]:
    commands = []
    for name in recipe_names():
        if name in ALGORITHM_CONFIGS:
            commands += [["config", "show", name], ["run", name, "--help"]]
        elif name == "eval":
            commands.append(["eval", "--show-config"])
    return commands


def test_every_recipe_works_or_names_the_missing_plugin(core_only, tmp_path):
    commands = _commands()
    assert ["eval", "--show-config"] in commands and ["config", "show", "grpo"] in commands
    outcomes = {}
    for command in commands:
        done = subprocess.run(
            [str(core_only / "nrl"), *command],
            cwd=tmp_path,  # not this checkout: nothing imports from it by accident
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        what = " ".join(command)
        if done.returncode == 0:
            assert done.stdout.strip(), what
            outcomes[what] = "works"
            continue
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, f"{what}: {done.stderr[-3000:]}"
        assert MISSING_PLUGIN in lines[0] and "Traceback" not in done.stderr, f"{what}: {lines}"
        outcomes[what] = lines[0]
    # The algorithms whose recipe needs no plugin beyond dtensor work outright.
    for name in ("sft", "dpo", "rm"):
        assert outcomes[f"config show {name}"] == "works", outcomes
    for name in ALGORITHM_CONFIGS:
        assert outcomes[f"run {name} --help"] == "works", outcomes
