"""The NeMo Gym virtualenvs: built once per (Gym, Python, Ray) version, reused by every run.

Gym joins the run's own Ray cluster (``ray_head_node_address``), and Ray wants one Python and
one Ray version across a cluster (a 3.13 process joining a 3.11 cluster is refused: "Version
mismatch", measured). So the Gym venv is built with the run's own Python and the run's Ray
version. nemo-gym 0.7.0 declares ``Requires-Python >= 3.13.14`` but its code and its
dependencies run on 3.11 (checked: every module of the servers nrl uses compiles and imports,
and its example environments train); pip-style resolution refuses that declaration, so the
package is installed without its dependencies and they are installed from its metadata.

Gym would also build one venv per server directory (``uv venv`` + the server's
``requirements.txt``), downloading a Python when offline fails; instead every server directory
gets a link to a venv of ours (Gym's ``uv_venv_dir`` + ``skip_venv_if_present``): the shared
one, or, for a server whose ``requirements.txt`` asks for more than nemo-gym, a venv with those
requirements too, keyed by them (see :func:`server_venvs`). Starting servers installs nothing
once these are built.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

from nrl_core.errors import ConfigError

SERVER_KINDS = (
    "resources_servers",
    "responses_api_agents",
    "responses_api_models",
    "environment_servers",
)
# NeMo Gym 0.7.0 declares Requires-Python >= 3.13.14 (see the module's docstring).
PYTHON_VERSION_CLAIM = "3.13.14"
COMPLETE = ".nrl-complete"
COMPILED = ".nrl-compiled"
"""Marks a venv whose bytecode was compiled (:func:`_compile`); a venv built before the marker
existed gets compiled once on its next use."""


def cache_root() -> Path:
    return Path(os.environ.get("NRL_CACHE_DIR", Path.home() / ".cache" / "nrl"))


def ray_version() -> str:
    """The Ray version of this process (the run's): Gym's venv gets exactly this one."""
    from importlib.metadata import version

    return version("ray")


def run_python(configured: str | None) -> str:
    """The interpreter the Gym venv is built with: ``configured`` (``agent.nemo_gym.gym_python``)
    or the one running this process; it must be this process's Python version, since Gym's
    processes join the run's Ray cluster."""
    mine = platform.python_version()
    if not configured:
        return getattr(sys, "_base_executable", None) or sys.executable
    theirs = _version(configured)
    if theirs != mine:
        raise ConfigError(
            f"agent.nemo_gym.gym_python={configured} is Python {theirs or 'unknown'}, but the "
            f"run's Ray cluster runs Python {mine} and Gym joins it; leave gym_python unset "
            f"(the run's own Python) or name a Python {mine}"
        )
    return configured


def _version(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def gym_venv(version: str, python: str | None = None) -> Path:
    """The venv with ``nemo-gym==version`` and its dependencies, for this Python and Ray
    (built under a file lock on first use)."""
    return _venv(
        f"nemo-gym-{version}-py{platform.python_version()}-ray{ray_version()}",
        version,
        python,
        requirements=[],
    )


def _venv(name: str, version: str, python: str | None, requirements: list[str]) -> Path:
    from filelock import FileLock

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    with FileLock(str(venv) + ".lock"):
        if (venv / COMPLETE).exists():
            _compile(venv)
            return venv
        interpreter = run_python(python)
        shutil.rmtree(venv, ignore_errors=True)
        target = ["--python", str(venv / "bin" / "python")]
        _uv(venv, ["venv", "--quiet", "--python", interpreter, str(venv)])
        _uv(
            venv,
            [
                "pip",
                "install",
                "--quiet",
                *target,
                "--no-deps",
                "--python-version",
                PYTHON_VERSION_CLAIM,
                f"nemo-gym=={version}",
            ],
        )
        deps = [*gym_requirements(venv), f"ray[default]=={ray_version()}", *requirements]
        listed = venv / "nrl-requirements.txt"
        listed.write_text("\n".join(deps) + "\n")
        _uv(venv, ["pip", "install", "--quiet", *target, "-r", str(listed)])
        (venv / COMPLETE).touch()
        _compile(venv)
    return venv


def _compile(venv: Path) -> None:
    """Compile the venv's bytecode once. ``uv pip install`` writes none, and where
    ``PYTHONDONTWRITEBYTECODE`` is set (CI) no process writes it either, so every Gym process
    (ng_run, its servers, their Ray workers) compiled what it imports at each start: importing
    nemo_gym's server utilities, FastAPI, Ray and openai took 2.8 CPU-s, 1.05 compiled
    (2-core machine), for ~30 CPU-s once. A file that does not compile (a template, another
    Python's syntax) is left to be compiled, or fail, at import, as before."""
    if (venv / COMPILED).exists():
        return
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "compileall", "-q", "-j", "0", str(package_dir(venv))],
        capture_output=True,
        check=False,
    )
    (venv / COMPILED).touch()


def gym_requirements(venv: Path) -> list[str]:
    """nemo-gym's own dependencies (its metadata's ``Requires-Dist`` without extras), Ray
    left out (pinned to the run's version instead)."""
    (metadata,) = package_dir(venv).glob("nemo_gym-*.dist-info/METADATA")
    message = Parser().parsestr(metadata.read_text())
    out = []
    for requirement in message.get_all("Requires-Dist") or []:
        if "extra ==" in requirement or re.match(r"ray\b", requirement.strip()):
            continue
        out.append(requirement)
    return out


def _uv(venv: Path, args: list[str]) -> None:
    command = [_uv_bin(), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        shutil.rmtree(venv, ignore_errors=True)
        raise ConfigError(
            f"could not build the NeMo Gym venv {venv} (uv {' '.join(args[:2])}: {tail[0]}); "
            "check agent.nemo_gym.nemo_gym_version and network access to the package index"
        )


def package_dir(venv: Path) -> Path:
    """Where the ``nemo_gym`` package and its example servers are installed."""
    (site,) = list((venv / "lib").glob("python3.*/site-packages"))
    return site


def server_requirements(server_dir: Path) -> list[str]:
    """What a Gym server's ``requirements.txt`` asks for beyond nemo-gym itself (its
    ``-e nemo-gym @ ../../`` line, which Gym also drops when installed from PyPI), in order;
    comments and blank lines left out."""
    path = server_dir / "requirements.txt"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or "../.." in line:
            continue
        out.append(line)
    return out


def server_dirs(venv: Path, config_paths: Iterable[str]) -> list[Path]:
    """The server directories (``<kind>/<name>``) the Gym config files name, in order."""
    site = package_dir(venv)
    found: list[Path] = []
    for config in config_paths:
        blocks = _read_config(site, config)
        for block in blocks.values() if isinstance(blocks, dict) else ():
            for kind, servers in block.items() if isinstance(block, dict) else ():
                if kind in SERVER_KINDS and isinstance(servers, dict):
                    for name in servers:
                        if (site / kind / name).is_dir() and site / kind / name not in found:
                            found.append(site / kind / name)
    return found


def config_instances(venv: Path, config_paths: Iterable[str]) -> set[str]:
    """The server instances the Gym config files declare (their top-level keys: the names
    rows give in ``agent_ref.name``); a file that cannot be read declares none."""
    site = package_dir(venv)
    names: set[str] = set()
    for config in config_paths:
        blocks = _read_config(site, config)
        if isinstance(blocks, dict):
            names.update(str(name) for name in blocks)
    return names


def server_venvs(venv: Path, config_paths: Iterable[str] = (), python: str | None = None) -> Path:
    """A ``uv_venv_dir`` where every server directory of the package links to ``venv``, except
    the configured servers whose ``requirements.txt`` asks for more: those link to a venv with
    nemo-gym plus those requirements, built once and keyed by them (offline once built)."""
    from filelock import FileLock

    root = Path(str(venv) + "-servers")
    site = package_dir(venv)
    version = _installed_version(venv)
    wanted: dict[Path, Path] = {}
    for server in server_dirs(venv, config_paths):
        extra = server_requirements(server)
        if extra:
            key = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:12]
            wanted[server] = _venv(f"{venv.name}-req-{key}", version, python, extra)
    with FileLock(str(root) + ".lock"):
        for kind in SERVER_KINDS:
            for server in (site / kind).iterdir() if (site / kind).is_dir() else ():
                if not server.is_dir():
                    continue
                link = root / kind / server.name / ".venv"
                target = wanted.get(server, venv)
                if link.is_symlink() and Path(os.readlink(link)) == target:
                    continue
                link.parent.mkdir(parents=True, exist_ok=True)
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(target)
    return root


def _installed_version(venv: Path) -> str:
    (dist,) = package_dir(venv).glob("nemo_gym-*.dist-info")
    return dist.name.removeprefix("nemo_gym-").removesuffix(".dist-info")


def _uv_bin() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except ImportError:
        return shutil.which("uv") or "uv"


def _read_config(site: Path, config: str):
    """A Gym config file's YAML (a path relative to Gym's package folder ``site``, or
    absolute); None when it cannot be read: ng_run names the file in its own error."""
    import yaml

    path = Path(config) if Path(config).is_absolute() else site / config
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
