"""benchmarks/gpu_bundle.py's vLLM chain: does every device call fit the device tool's limits, and
the whole chain the session's device time together with the GPU acceptance?

The quick tests lay out, with the real :func:`lay_out` / :func:`lay_out_vllm`, files of the
sizes the real prepare measured (``gpu_bundle_sizes.json``: every wheel of both bundles, vLLM's
after slimming), and build the real chain of calls over them. The slow test runs the real
prepare (downloads from PyPI, ~2-3 min), then plays the device side on this machine with the
GPU image's Python (3.12): the calls' stash steps in order, a lost earlier part, the joins,
hashes and ``pip install`` of both bundles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIZES = json.loads((Path(__file__).with_name("gpu_bundle_sizes.json")).read_text())


def load_bundle():
    spec = importlib.util.spec_from_file_location(
        "gpu_bundle", REPO / "benchmarks" / "gpu_bundle.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def fake_wheels(folder: Path, sizes: dict[str, int]) -> list[Path]:
    """Files of the measured names and sizes (sparse: their bytes do not matter to the layout)."""
    folder.mkdir(parents=True)
    files = []
    for name, size in sizes.items():
        path = folder / name
        with path.open("wb") as f:
            f.truncate(size)
        files.append(path)
    return files


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The chain over measured sizes, laid out as the real prepare lays it out in the repo
    (``.gpu-bundle/carry1``, ``.gpu-bundle/vllm/carryK``), with paths relative to ``root``."""
    gb = load_bundle()
    root = tmp_path_factory.mktemp("repo")
    out = root / ".gpu-bundle"
    nrl_files = fake_wheels(root / "wheels" / "nrl", SIZES["nrl"])
    nrl = gb.lay_out(nrl_files, out, gb.CARRY_MIB, gb.nrl_extras(nrl_files))
    vllm_files = fake_wheels(root / "wheels" / "vllm", SIZES["vllm"])
    vllm = gb.lay_out_vllm(vllm_files, out / "vllm", gb.CARRY_MIB)
    return gb, root, nrl, vllm, gb.vllm_chain(nrl[0], vllm, root=root)


def test_every_call_carries_under_64_mib_with_the_working_tree(chain):
    gb, root, nrl, vllm, calls = chain
    tree = gb.working_tree_bytes()
    assert len(nrl) == 1, "the acceptance call carries nrl's bundle in one folder"
    assert len(calls) == 1 + len(vllm) and len(vllm) == 3  # 152.9 MiB of vLLM in 3 calls
    for call in calls:
        (folder,) = call.carry
        assert call.carry_bytes == gb.folder_bytes(root / folder)
        travel = (tree + call.carry_bytes) / 2**20
        assert travel <= gb.TRAVEL_MAX_MIB, f"{folder}: {travel:.1f} MiB travel"
    # Every piece of vLLM's bundle is in exactly one folder, listed with its call.
    pieces = [line.split() for line in (vllm[0] / "PIECES").read_text().splitlines()]
    for k, folder in enumerate(vllm, 1):
        listed = {name for call, _, name in pieces if int(call) == k}
        assert listed == {p.name for p in folder.iterdir()} - {"CALL", "CALLS", "PIECES"} - (
            {"stash.sh"} if k > 1 else set()
        )
    parts = sorted(name for _, _, name in pieces if ".whl.part" in name)
    assert parts == [f"{next(iter(SIZES['vllm']))}.part0{i}" for i in (1, 2)]


def test_every_command_fits_the_tools_limits(chain):
    gb, _, _, _, calls = chain
    for call in calls:
        assert len(call.command) <= gb.COMMAND_MAX_CHARS, call.command
        assert call.estimate_s <= call.timeout_s <= gb.COMMAND_MAX_S
        assert len(call.carry) <= 8
    # Each vLLM call stashes its own folder; the last installs and runs.
    assert [c.command.split(" && ")[0] for c in calls[1:]] == [
        f"sh {c.carry[0]}/stash.sh {c.carry[0]}" for c in calls[1:]
    ]
    assert "benchmarks/gpu_vllm.py" in calls[-1].command
    assert f"--budget-s {gb.VLLM_RUN_LIMIT_S}" in calls[-1].command
    assert calls[-1].timeout_s >= gb.VLLM_RUN_LIMIT_S + gb.STASH_S + gb.VLLM_INSTALL_S


def test_the_chain_and_the_acceptance_fit_one_sessions_device_time(chain):
    """The first call is the acceptance's own (quick plan, at its limits); the plan adds the
    machine's start, each call's transfer and the gap before it, and each command's estimate."""
    gb, _, _, _, calls = chain
    acc = gb.acceptance_module()
    quick = acc.PROFILES[acc.DEFAULT_PROFILE["cuda"]]
    assert calls[0].estimate_s == acc.QUICK_PLAN_S >= acc.plan_seconds(quick)
    assert calls[0].command == gb.acceptance_command(".gpu-bundle/carry1")
    tree = gb.working_tree_bytes()
    total = gb.plan_seconds(calls, tree)
    by_hand = gb.START_S + sum(
        (gb.GAP_S if i else 0) + (tree + c.carry_bytes) / 2**20 / gb.TRANSFER_MIB_PER_S
        for i, c in enumerate(calls)
    )
    assert total == pytest.approx(by_hand + sum(c.estimate_s for c in calls))
    assert total <= gb.DEVICE_BUDGET_S, f"plan {total:.0f} s"


def test_the_chain_printout_is_the_tools_arguments(chain, capsys):
    gb, _, _, _, calls = chain
    gb.print_chain(calls, gb.working_tree_bytes())
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert printed == [
        {"command": c.command, "carry": list(c.carry), "timeout_s": c.timeout_s} for c in calls
    ]


def test_the_vllm_version_is_one_nrl_vllm_supports():
    from nrl_vllm.compat import SUPPORTED_VLLM

    gb = load_bundle()
    assert gb.VLLM_VERSION.rsplit(".", 1)[0] in SUPPORTED_VLLM
    assert gb.VLLM_WHEELS.name == f"vllm-{gb.VLLM_VERSION}-wheels.txt" and gb.VLLM_WHEELS.exists()


IMAGE_PACKAGES = ("pathspec", "pluggy", "packaging", "attrs", "pyyaml", "rich", "filelock")
"""Packages of the GPU image (the device tool's KINDS.md) that hatchling's editable builds and
``import nrl_core`` need."""


def python312() -> str | None:
    """A working CPython 3.12 (a pyenv shim may name one it cannot run)."""
    pyenv = Path.home() / ".pyenv" / "versions"
    candidates = sorted(pyenv.glob("3.12.*/bin/python3.12")) if pyenv.exists() else []
    candidates += [Path(p) for p in filter(None, [shutil.which("python3.12")])]
    for candidate in candidates:
        ran = subprocess.run([str(candidate), "-c", "import venv"], capture_output=True)
        if ran.returncode == 0:
            return str(candidate)
    return None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_real_bundles_install_through_the_chains_steps(tmp_path):
    """The real prepare (PyPI), then the device side with Python 3.12 in a venv: a vLLM call
    before nrl's bundle is installed, or whose earlier part is missing, says LOST (exit 3); the
    stash calls in order; vLLM's ``install.sh`` joins, checks and installs every wheel and
    nrl-vllm (measured 2026-11-28 on 2 loaded cores: each stash < 1.1 s, the install 19 s)."""
    py = python312()
    if py is None:
        pytest.skip("needs a Python 3.12 interpreter (the GPU image's) for the cp312 wheels")
    out = tmp_path / "bundle"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_bundle.py"), str(out), "--vllm"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan:" in result.stdout
    folders = sorted((out / "vllm").glob("carry*"))
    sizes = {p.name: p.stat().st_size for p in (out / "vllm" / "slim").glob("*.whl")}
    assert sizes == {k: v for k, v in SIZES["vllm"].items() if k.startswith("vllm-")}, (
        "the slimmed vLLM wheel changed size: update gpu_bundle_sizes.json"
    )

    venv = tmp_path / "device"
    subprocess.run([py, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env["NRL_VLLM_STAGE"] = str(tmp_path / "stage")
    env.pop("VIRTUAL_ENV", None)

    def sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
        )

    # Before the acceptance call installed nrl's bundle, this is a fresh machine.
    lost = sh(str(folders[0] / "stash.sh"), str(folders[0]))
    assert lost.returncode == 3 and "LOST" in lost.stdout, lost.stdout + lost.stderr
    # Call 1's install, as far as it runs without the image (torch, ...; its install.sh ran on
    # the H100): the image's small packages that the editable installs and nrl_core's import
    # need (from PyPI), then the bundle's wheels and nrl's packages as install.sh installs them.
    # --no-compile, as install.sh's pip: compiling every file of Ray's wheel (and the rest) to
    # bytecode up front is most of this install's CPU time, and no step of the chain needs it.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run([*pip, *IMAGE_PACKAGES], check=True, timeout=300)
    wheels = sorted(str(p) for p in (out / "carry1").glob("*.whl"))
    subprocess.run([*pip, "--no-index", "--no-deps", *wheels], check=True, timeout=300)
    editables = [a for p in ("", "plugins/nrl-dtensor") for a in ("-e", str(REPO / p))]
    subprocess.run(
        [*pip, "--no-index", "--no-deps", "--no-build-isolation", *editables],
        check=True, timeout=300,
    )  # fmt: skip
    # The second vLLM call without the first one's part: LOST.
    shutil.rmtree(tmp_path / "stage")
    lost = sh(str(folders[1] / "stash.sh"), str(folders[1]))
    assert lost.returncode == 3 and "LOST" in lost.stdout, lost.stdout + lost.stderr
    shutil.rmtree(tmp_path / "stage")
    for k, folder in enumerate(folders, 1):
        stash = sh(str(folder / "stash.sh"), str(folder))
        assert stash.returncode == 0, stash.stdout + stash.stderr
        assert f"stash: call {k} of {len(folders)} checked" in stash.stdout
    stage = tmp_path / "stage"
    install = sh(str(stage / "install.sh"), str(stage), ".")
    assert install.returncode == 0, install.stderr[-3000:]
    assert "vllm 0.26.0 installed" in install.stdout
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    versions = {_name(p["name"]): p["version"] for p in json.loads(listed.stdout)}
    assert versions["vllm"] == "0.26.0" and versions["ray"] == "2.60.0"
    assert "nrl-vllm" in versions and "nrl-core" in versions
    wanted = [w for w in SIZES["vllm"] if not w.startswith("vllm-")]
    missing = [w for w in wanted if versions.get(_name(w.split("-")[0])) != w.split("-")[1]]
    assert len(wanted) == 81 and not missing


def _name(name: str) -> str:
    """A distribution name normalised (PEP 503), as pip list and wheel files may differ."""
    return re.sub(r"[-_.]+", "-", name).lower()
