"""``nrl doctor``: a component is usable only when what its extras require is installed where
it runs, and its target imports."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest
from rich.console import Console

from nrl_core import hookimpl
from nrl_core.cli.doctor import check_component, doctor
from nrl_core.plugins import PluginHost

DIST = "nrl-fake-hub"
MISSING = "nrl-no-such-package"


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """An installed distribution (real metadata on sys.path) whose ``hf`` extra requires a
    package that is not installed, and whose ``ok`` extra requires one that is."""
    info = tmp_path / "nrl_fake_hub-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        f"Name: {DIST}\n"
        "Version: 0.1\n"
        "Provides-Extra: hf\n"
        "Provides-Extra: ok\n"
        f'Requires-Dist: {MISSING}>=1; extra == "hf"\n'
        'Requires-Dist: packaging>=20; extra == "ok"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return DIST


class HubPlugin:
    """Registers like a plugin whose hub dataset imports its library lazily."""

    @hookimpl
    def nrl_register_datasets(self, register):
        # The target imports fine: `datasets` is imported only when the hub is read.
        register("fake_hub", "nrl_core.chat_data:ChatDataset", extras=["hf"])
        register("fake_ok", "nrl_core.chat_data:ChatDataset", extras=["ok"])
        register("fake_typo", "nrl_core.chat_data:NoSuchDataset")

        register(
            "fake_files",
            "nrl_core.chat_data:ChatDataset",
            extras=["hf"],
            extras_for="hub datasets (JSONL files need nothing)",
        )

    @hookimpl
    def nrl_register_environments(self, register):
        register("fake_env", "nrl_core.environments:ExactMatchEnvironment", extras=["hf"])


def _host(distribution: str) -> PluginHost:
    host = PluginHost.discover(selection=[])
    info = host.add(HubPlugin(), "fakehub", distribution=distribution, version="0.1")
    assert info.status == "ok", info.error
    return host


def _spec(host: PluginHost, kind: str, name: str):
    return host.registry().get(kind, name)


def test_a_dataset_missing_its_extra_is_reported_with_the_install_command(fake_distribution):
    host = _host(fake_distribution)
    check = check_component(_spec(host, "dataset", "fake_hub"))
    assert not check.broken
    assert check.detail.startswith("[yellow]no[/yellow]")
    assert f"missing {MISSING}>=1 (not installed)" in check.detail
    # It runs in the driver: installing the extra here is the fix, not an actor venv.
    assert f"pip install '{DIST}[hf]'" in check.detail.replace("\\[", "[")
    assert "venv" not in check.detail


def test_a_dataset_whose_extra_serves_some_sources_is_usable_without_it(fake_distribution):
    """Issue 39: doctor said the `prompts` dataset needs `datasets` even for a JSONL file."""
    check = check_component(_spec(_host(fake_distribution), "dataset", "fake_files"))
    assert not check.broken
    assert check.detail.startswith("yes; hub datasets (JSONL files need nothing) need ")
    assert f"{MISSING}>=1 (not installed)" in check.detail


def test_an_actor_component_missing_its_extra_points_at_its_venv(fake_distribution):
    host = _host(fake_distribution)
    check = check_component(_spec(host, "environment", "fake_env"))
    assert f"missing {MISSING}>=1" in check.detail
    assert "`nrl venvs build fakehub`" in check.detail


def test_satisfied_extras_and_a_broken_target(fake_distribution):
    host = _host(fake_distribution)
    assert check_component(_spec(host, "dataset", "fake_ok")).detail == "yes"
    typo = check_component(_spec(host, "dataset", "fake_typo"))
    assert typo.broken and "has no 'NoSuchDataset'" in typo.detail


def test_doctor_table_and_exit_code(fake_distribution):
    console = Console(width=200, record=True, file=io.StringIO())
    # The typo'd target is broken: exit 1. A missing extra alone is not (next assertion).
    assert doctor(_host(fake_distribution), console=console) == 1
    out = console.export_text()
    row = re.search(r"^\s+dataset fake_hub\s+(\S+)\s+(.*)$", out, re.MULTILINE)
    assert row is not None, out
    assert row.group(1) == f"{DIST}[hf]"
    assert row.group(2).startswith(f"no: missing {MISSING}>=1 (not installed)")
    assert f"pip install '{DIST}[hf]'" in row.group(2)
    assert re.search(r"^\s+dataset fake_ok\s+\S+\s+yes\s*$", out, re.MULTILINE)


def test_a_missing_extra_alone_does_not_fail_doctor(fake_distribution):
    class OnlyHub:
        @hookimpl
        def nrl_register_datasets(self, register):
            register("fake_hub", "nrl_core.chat_data:ChatDataset", extras=["hf"])

    host = PluginHost.discover(selection=[])
    host.add(OnlyHub(), "onlyhub", distribution=fake_distribution, version="0.1")
    console = Console(width=200, record=True, file=io.StringIO())
    assert doctor(host, console=console) == 0
    assert f"pip install '{DIST}[hf]'" in console.export_text()


def test_extras_of_a_distribution_that_is_not_installed_are_a_failure():
    host = PluginHost.discover(selection=[])
    host.add(HubPlugin(), "fakehub", distribution="nrl-not-installed-anywhere", version="0.1")
    check = check_component(_spec(host, "dataset", "fake_hub"))
    assert check.broken
    assert "distribution nrl-not-installed-anywhere is not installed" in check.detail


# -- `nrl doctor --cluster` against a real 2-node Ray cluster on this host ---------------------


def _pids_naming(text: str) -> list[int]:

    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
                )
            except OSError:
                continue
            if text in cmd:
                pids.append(int(entry.name))
    return pids


@pytest.fixture
def two_node_ray(tmp_path):
    """A Ray head and one worker node started here with `ray start` (one CPU each, token
    authentication off for all three processes), stopped by PID (never `ray stop`: it would
    stop every Ray on the machine); yields (address, env)."""

    ray = str(Path(sys.executable).parent / "ray")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tag = f"/tmp/nrl-dr-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    common = ["--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    try:
        for args in (
            ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={tag}-h"],
            [f"--address=127.0.0.1:{port}", f"--temp-dir={tag}-w"],
        ):
            started = subprocess.run(
                [ray, "start", "--node-ip-address=127.0.0.1", *args, *common],
                capture_output=True, text=True, timeout=240, env=env,
            )  # fmt: skip
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}", env
    finally:
        pids = _pids_naming(tag)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _pids_naming(tag) and time.monotonic() < deadline:
            time.sleep(0.3)
        for pid in _pids_naming(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for suffix in ("-h", "-w"):
            shutil.rmtree(tag + suffix, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_doctor_cluster_reports_every_node(two_node_ray, tmp_path):

    address, env = two_node_ray
    result = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "doctor", "--cluster", address, "--disk",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "220"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 node(s)" in result.stdout
    rows = [line for line in result.stdout.splitlines() if metadata.version("ray") in line]
    assert len(rows) == 2, result.stdout
    assert sum("(head)" in row for row in rows) == 1
    free = shutil.disk_usage(tmp_path).free / 2**30
    for row in rows:
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        assert cells[2:7] == [
            sys.version.split()[0],
            metadata.version("nrl-core"),
            metadata.version("torch"),
            metadata.version("ray"),
            "0",  # no GPU on this machine (the driver's list, as `nrl doctor`)
        ], row
        assert abs(float(cells[7].split()[0]) - free) < 2, row  # same disk, seconds apart
    # A folder missing on the nodes is named in their rows, and fails the check.
    missing = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "doctor", "--cluster", address, "--disk",
         str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "220"},
    )  # fmt: skip
    assert missing.returncode == 1
    assert missing.stdout.count("No such file or directory") == 2, missing.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--cluster"],
            "nrl doctor --cluster needs the Ray address: --cluster HOST:PORT or $RAY_ADDRESS",
        ),
        (["--disk", "/tmp"], "nrl doctor: --disk goes with --cluster"),
    ],
)
def test_doctor_cluster_bad_input_is_one_line_exit_2(args, message):

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "doctor", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
