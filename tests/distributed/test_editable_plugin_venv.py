"""A third-party plugin installed editable beside the checkout (``uv pip install -e
/somewhere/plugin``), not a member of the workspace, gets its own actor venv: the plugin from
its source folder with its extras, nrl-core from the checkout, the lock's ray and torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nrl_core.cli.new_plugin import generate
from nrl_core.distributed import actor_env
from nrl_core.interfaces import ComponentContext

from .conftest import HERE

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_editable_plugin_outside_the_workspace_gets_an_actor_venv(tmp_path, ray_cluster):
    import ray

    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.environments import ENV_ACTOR_TARGET, EnvironmentPool

    # A plugin from nrl's template, somewhere else, whose `env` extra needs a package the
    # driver does not have (cowsay; uv's cache holds it for the actor-venv tests).
    project = generate("Echo Env", tmp_path / "elsewhere", template=str(REPO / "plugin_template"))
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("env = []", 'env = ["cowsay>=6.0"]'))
    assert tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["env"]
    # Installed editable the way uv installs it (PEP 610 direct_url.json, a .pth), into a
    # folder of its own: this checkout's .venv is shared and must not gain a plugin.
    site = tmp_path / "site"
    subprocess.run(
        [actor_env.uv_binary(), "pip", "install", "--quiet", "--no-deps", "--target", str(site),
         "--editable", str(project)],
        check=True, timeout=120,
    )  # fmt: skip
    direct_url = json.loads(next(site.glob("nrl_echo_env-*.dist-info")).joinpath(
        "direct_url.json").read_text())  # fmt: skip
    assert direct_url["dir_info"] == {"editable": True}

    venvs = tmp_path / "venvs"
    env = {
        **os.environ,
        # PYTHONPATH does not run .pth files: the source folder is named as the .pth would.
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(site), str(project / "src"), os.environ.get("PYTHONPATH")) if p
        ),
        "NRL_VENV_DIR": str(venvs),
        "COLUMNS": "250",  # one line per venv
        # Its venv holds torch (nrl-core's dependency), which this test never imports:
        # compiling it at build would be most of the test's time.
        "UV_COMPILE_BYTECODE": "0",
    }
    build = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "venvs", "build", "echo_env"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    # One venv per extras combination of the plugin's actor components: the environment
    # (`env`). Its dataset runs in the driver, so it gets none (nrl_core's ACTOR_KINDS).
    assert "echo_env (nrl-echo-env[env]): built" in build.stdout, build.stdout
    assert "echo_env (nrl-echo-env): built" not in build.stdout, build.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "venvs", "list", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    entries = json.loads(listed.stdout)
    assert sorted((e["plugin"], e["extras"], e["mode"], e["status"]) for e in entries) == [
        ("echo_env", ["env"], "installed", "fresh"),
    ]
    [entry] = [e for e in entries if e["extras"] == ["env"]]
    python = Path(entry["path"]) / "bin" / "python"

    # The environment runs in an actor of that venv: plugin code from its source folder,
    # cowsay from the venv, nrl-core from this checkout and the driver's ray.
    group = WorkerGroup.start(
        "nrl_probe_workers:ProbeWorker",
        1,
        name="probe",
        python=str(python),
        env_vars={"PYTHONPATH": str(HERE)},
        num_cpus_per_worker=0.25,
        timeout_s=120,
    )
    try:
        interpreter = group.run_one(0, "python")
        found = group.run_one(0, "modules", ["cowsay", "nrl_echo_env", "nrl_core", "ray"])
    finally:
        group.shutdown()
    assert interpreter == str(python)
    assert found["cowsay"]["file"] is not None  # the extra, which the driver lacks
    assert found["nrl_echo_env"]["file"] == str(project / "src" / "nrl_echo_env" / "__init__.py")
    assert found["nrl_core"]["file"] == str(REPO / "nrl_core" / "__init__.py")
    assert found["ray"]["version"] == ray.__version__

    envs = WorkerGroup.start(
        ENV_ACTOR_TARGET,
        1,
        args=("nrl_echo_env.environment:EchoEnvEnvironment", None, ComponentContext(config=None)),
        name="env-echo_env",
        python=str(python),
        num_cpus_per_worker=0.25,
        timeout_s=120,
    )
    try:
        [result] = EnvironmentPool({"default": envs}).step(
            ["echo_env"], [[{"role": "assistant", "content": "olleh"}]], [{"answer": "olleh"}]
        )
    finally:
        envs.shutdown()
    assert result.error is None and result.reward == 1.0

    # A changed dependency of the plugin is a new venv: the built one is now stale.
    pyproject.write_text(pyproject.read_text().replace('"cowsay>=6.0"', '"cowsay>=6.1"'))
    listed = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "venvs", "list", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert [e["status"] for e in json.loads(listed.stdout)] == ["stale"]
