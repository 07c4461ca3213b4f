"""The plugin template (``plugin_template/``) and ``nrl new-plugin``.

Fast tests bake the template for several names and check the computed names and the
generated files. The slow end-to-end test installs a baked plugin into a fresh virtualenv,
runs the plugin's own (generated) tests there, and trains it for 2 GRPO steps through the CLI.

Fresh virtualenv, fast: ``uv venv`` plus ``uv pip install --no-deps -e <repo> -e <plugin>``
installs the core and the plugin into a venv of their own, so only that venv sees the
generated plugin (this checkout's ``.venv`` is shared and must not gain a plugin). The core's
third-party dependencies (torch, ray, transformers, pytest: gigabytes) are not downloaded again:
a ``.pth`` file runs ``site.addsitedir`` on the dev environment's site-packages, which puts
them on ``sys.path`` after the venv's own packages. ``addsitedir`` (unlike a bare path line)
also processes the ``.pth`` files there, which editable installs need.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from nrl_core.cli import main as nrl_main
from nrl_core.cli.new_plugin import TemplateError, generate

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "plugin_template"

NAMES = [
    # name, distribution, package, component, class prefix
    ("Reverse Words", "nrl-reverse-words", "nrl_reverse_words", "reverse_words", "ReverseWords"),
    ("my-env", "nrl-my-env", "nrl_my_env", "my_env", "MyEnv"),
    ("nrl-Sudoku", "nrl-sudoku", "nrl_sudoku", "sudoku", "Sudoku"),
    ("Tool Use_v2  (beta)", "nrl-tool-use-v2-beta", "nrl_tool_use_v2_beta", "tool_use_v2_beta",
     "ToolUseV2Beta"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "dist", "package", "component", "prefix"), NAMES)
def test_names_become_valid_distribution_and_import_names(
    tmp_path, name, dist, package, component, prefix
):
    project = generate(name, tmp_path, template=str(TEMPLATE))
    assert project == tmp_path / dist
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    assert meta["project"]["name"] == dist
    assert meta["project"]["entry-points"]["nrl.plugins"] == {component: f"{package}.plugin"}
    assert set(meta["project"]["optional-dependencies"]) == {"env", "test"}
    source = project / "src" / package
    assert package.isidentifier() and source.is_dir()
    for path in [*source.glob("*.py"), *(project / "tests").glob("*.py")]:
        ast.parse(path.read_text(), filename=str(path))  # renders to valid Python
    plugin = (source / "plugin.py").read_text()
    assert f'"{component}",' in plugin and f"{prefix}Environment" in plugin
    assert f"class {prefix}Dataset" in (source / "dataset.py").read_text()
    assert (project / "examples" / f"{component}_cpu.yaml").is_file()
    assert (project / ".github" / "workflows" / "ci.yml").is_file()
    assert "{{" not in (project / "README.md").read_text()


def test_generated_code_passes_ruff(tmp_path):
    project = generate("Reverse Words", tmp_path, template=str(TEMPLATE))
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run(
        [str(ruff), "check", "--isolated", "--select", "E,F,W,B,UP", "--line-length", "120",
         "--target-version", "py311", str(project)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["3d", "---", "!!"])
def test_unusable_names_are_refused(tmp_path, name):
    with pytest.raises(TemplateError, match="cannot make a plugin"):
        generate(name, tmp_path, template=str(TEMPLATE))
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused name"


def test_cli_new_plugin(tmp_path, capsys):
    code = nrl_main(
        ["new-plugin", "--name", "Count Vowels", "--description", "Counts vowels.",
         "--author", "A. Author", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    project = tmp_path / "nrl-count-vowels"
    out = capsys.readouterr().out
    assert f"created {project}" in out
    # Issue 39: a bare `pip install` in a uv venv (which has no pip) ran the system's pip. The
    # dev venv (made by uv) has none: uv's command; a venv with pip: that venv's pip.
    has_pip = importlib.util.find_spec("pip") is not None
    installer = "python -m pip install" if has_pip else "uv pip install"
    assert f"next: {installer} -e '{project}[test]'" in out
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == "Counts vowels." and meta["authors"][0]["name"] == "A. Author"
    # A second run refuses to overwrite unless --force.
    assert nrl_main(["new-plugin", "--name", "Count Vowels", "--output-dir", str(tmp_path)]) != 0
    assert nrl_main(["new-plugin", "--name", "Count Vowels", "--output-dir", str(tmp_path),
                     "--force"]) == 0  # fmt: skip


def test_the_wheel_carries_the_template(tmp_path):
    """`nrl new-plugin` works from a non-editable install: nrl-core's wheel holds the template
    (issue 20: it was only in the checkout)."""
    import zipfile

    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
    subprocess.run(
        [uv, "build", "--wheel", "--package", "nrl-core", "-o", str(tmp_path), "-q"],
        cwd=REPO, check=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("nrl_core-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(Path("nrl_core/plugin_template") / path.relative_to(TEMPLATE))
        for path in TEMPLATE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert "nrl_core/plugin_template/cookiecutter.json" in expected
    assert any(name.endswith(".github/workflows/ci.yml") for name in expected)
    assert expected <= names, sorted(expected - names)


# ---------------------------------------------------------------------------------------------
# End to end


def make_venv(root: Path, *editables: Path) -> Path:
    """A fresh venv with ``editables`` installed (no deps) and the dev env's packages behind
    them (see the module docstring). Returns the venv's bin folder."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
    venv = root / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            text=True,
        ).strip()
    )  # fmt: skip
    dev_site = sysconfig.get_path("purelib")
    (site / "zz_nrl_dev_env.pth").write_text(f"import site; site.addsitedir({dev_site!r})\n")
    args = [a for path in editables for a in ("-e", str(path))]
    subprocess.run(
        [uv, "pip", "install", "-q", "--no-deps", "--python", str(venv / "bin" / "python"), *args],
        check=True,
    )
    return venv / "bin"


def run_env(bin_dir: Path) -> dict[str, str]:
    """Environment for commands in the fresh venv: its bin first, then the dev env's (for
    ``uv``), and environment actors in the driver's interpreter."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
        VIRTUAL_ENV=str(bin_dir.parent),
        NRL_ACTOR_ENV="system",
    )
    return env


GRPO_SMALL = [
    "policy.num_workers=1",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=8",
    "policy.max_total_sequence_length=40",
    "generation.max_new_tokens=5",
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_period=0",
    "grpo.sft_warmup_steps=0",
    "cluster.num_cpus=2",
    "checkpointing.enabled=false",
]


@pytest.mark.slow
def test_baked_plugin_installs_tests_and_trains(tmp_path):
    project = generate("Reverse Words", tmp_path / "src", template=str(TEMPLATE))
    bin_dir = make_venv(tmp_path, REPO, project)
    env = run_env(bin_dir)

    plugins = subprocess.run(
        [str(bin_dir / "nrl"), "plugins", "--json"], env=env, capture_output=True, text=True
    )
    assert plugins.returncode == 0, plugins.stderr
    mine = [p for p in json.loads(plugins.stdout) if p["name"] == "reverse_words"]
    assert mine and mine[0]["status"] == "ok", plugins.stdout
    assert mine[0]["distribution"] == "nrl-reverse-words"
    assert {c["kind"] for c in mine[0]["components"]} == {"environment", "dataset"}

    tests = subprocess.run(
        [str(bin_dir / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout

    log_dir = tmp_path / "runs"
    run = subprocess.run(
        [str(bin_dir / "nrl"), "run", "grpo", "env.name=reverse_words",
         "data.dataset=reverse_words", "data.reverse_words.max_length=3",
         f"logger.log_dir={log_dir}", "logger.run_name=e2e", *GRPO_SMALL],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (log_dir / "e2e" / "metrics.jsonl").open()]
    steps = [r for r in records if "train/reward_mean" in r or "train/loss" in r]
    assert len(steps) >= 2, records
