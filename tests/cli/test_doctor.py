"""``nrl doctor``: a component is usable only when what its extras require is installed where
it runs, and its target imports."""

from __future__ import annotations

import io
import re

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
