"""The NeMo Gym virtualenv: built once per version, reused by every run on the machine.

NeMo Gym needs Python >= 3.13 while the Ray cluster runs 3.11, so Gym runs as subprocesses in
its own virtualenv and talks HTTP to nrl's endpoint. Gym would also build one venv per server,
downloading a Python when offline fails; instead every server directory of the package gets a
link to this venv (Gym's ``uv_venv_dir`` + ``skip_venv_if_present``), so starting servers
installs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from nrl_core.errors import ConfigError

SERVER_KINDS = (
    "resources_servers",
    "responses_api_agents",
    "responses_api_models",
    "environment_servers",
)
# NeMo Gym 0.7.0 declares Requires-Python >= 3.13.14; its code runs on any 3.13.
PYTHON_VERSION_CLAIM = "3.13.14"


def cache_root() -> Path:
    return Path(os.environ.get("NRL_CACHE_DIR", Path.home() / ".cache" / "nrl"))


def find_python(configured: str | None) -> str:
    """A Python >= 3.13: ``configured`` (``agent.nemo_gym.gym_python``), else the first found."""
    candidates = (
        [configured]
        if configured
        else [
            shutil.which("python3.13"),
            shutil.which("python3.14"),
            *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.1[34]*/bin/python3")),
            "/usr/bin/python3.13",
        ]
    )
    for candidate in candidates:
        if candidate and _version(candidate) >= (3, 13):
            return candidate
    raise ConfigError(
        "NeMo Gym needs Python >= 3.13 and none was found"
        + (f" (agent.nemo_gym.gym_python={configured} is not one)" if configured else "")
        + "; install one (e.g. `uv python install 3.13`) and set agent.nemo_gym.gym_python"
    )


def _version(python: str) -> tuple[int, int]:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        major, minor = out.stdout.split()
        return int(major), int(minor)
    except (OSError, ValueError, subprocess.SubprocessError):
        return (0, 0)


def gym_venv(version: str, python: str | None = None) -> Path:
    """The venv with ``nemo-gym==version`` (built under a file lock on first use)."""
    from filelock import FileLock

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"nemo-gym-{version}"
    marker = venv / ".nrl-complete"
    with FileLock(str(venv) + ".lock"):
        if marker.exists():
            return venv
        interpreter = find_python(python)
        shutil.rmtree(venv, ignore_errors=True)
        uv = _uv()
        for command in (
            [uv, "venv", "--quiet", "--python", interpreter, str(venv)],
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--python",
                str(venv / "bin" / "python"),
                "--python-version",
                PYTHON_VERSION_CLAIM,
                f"nemo-gym=={version}",
            ],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
                raise ConfigError(
                    f"could not build the NeMo Gym venv {venv} ({' '.join(command[:3])}: "
                    f"{tail[0]}); check agent.nemo_gym.nemo_gym_version and network access "
                    "to the package index"
                )
        marker.touch()
    return venv


def package_dir(venv: Path) -> Path:
    """Where the ``nemo_gym`` package and its example servers are installed."""
    (site,) = list((venv / "lib").glob("python3.*/site-packages"))
    return site


def server_venvs(venv: Path) -> Path:
    """A ``uv_venv_dir`` where every server directory of the package links to ``venv``."""
    root = Path(str(venv) + "-servers")
    site = package_dir(venv)
    for kind in SERVER_KINDS:
        for server in (site / kind).iterdir() if (site / kind).is_dir() else ():
            link = root / kind / server.name / ".venv"
            if server.is_dir() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(venv)
    return root


def _uv() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except ImportError:
        return shutil.which("uv") or "uv"
