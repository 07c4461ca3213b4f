"""NeMo Gym's servers, started with its own ``ng_run`` in the Gym venv, or joined.

``ng_run`` starts a head server (which serves the merged config and the list of server
instances) and one process per configured server. Everything runs in one new process session
on loopback; Gym's own Ray instance keeps its files in a folder of ours, removed at stop.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from nrl_core.errors import NrlError
from nrl_gym.config import TRAINING_MODEL_CONFIG
from nrl_gym.install import package_dir, server_venvs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GymServers:
    """The server instances of a Gym head server, by instance name (the name rows put in
    ``agent_ref.name``), started by :meth:`start` or joined by :meth:`join`."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.head_url: str | None = None
        self.instances: dict[str, str] = {}
        self.log_path: Path | None = None
        self._ray_dir: str | None = None

    def start(
        self, venv: Path, config_paths: list[str], endpoint: Any, *, timeout_s: float
    ) -> None:
        """``ng_run`` the configs plus the training model server pointed at ``endpoint``."""
        site = package_dir(venv)
        port = free_port()
        self._ray_dir = tempfile.mkdtemp(prefix="nrl-gym-", dir="/tmp")  # short: Ray sockets
        self.log_path = Path(self._ray_dir) / "ng_run.log"
        paths = [str(Path(p)) for p in [*config_paths, TRAINING_MODEL_CONFIG]]
        command = [
            str(venv / "bin" / "ng_run"),
            f"+config_paths=[{','.join(paths)}]",
            f"+policy_base_url={endpoint.base_url}",
            f"+policy_api_key={endpoint.api_key or 'none'}",
            f"+policy_model_name={endpoint.model}",
            f"+uv_venv_dir={server_venvs(venv)}",
            "+skip_venv_if_present=true",
            "++head_server.host=127.0.0.1",
            f"++head_server.port={port}",
        ]
        env = {
            **os.environ,
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
            "RAY_TMPDIR": self._ray_dir,
        }
        for var in ("RAY_ADDRESS", "PYTHONPATH", "PYTHONHOME"):  # not the nrl cluster's
            env.pop(var, None)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command,
                cwd=site,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.head_url = f"http://127.0.0.1:{port}"
        self._wait_ready(timeout_s)

    def join(self, head_url: str, *, timeout_s: float) -> None:
        """Use the servers of a running head server."""
        self.head_url = head_url.rstrip("/")
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise NrlError(
                    f"NeMo Gym's ng_run exited with code {self.process.returncode}; see "
                    f"{self.log_path}"
                )
            try:
                listed = httpx.get(f"{self.head_url}/server_instances", timeout=5).json()
                urls = {i["config_path"]: i["url"] for i in listed}
                if urls and all(_healthy(url) for url in urls.values()):
                    self.instances = urls
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(1.0)
        self.stop()
        raise NrlError(
            f"NeMo Gym's servers were not ready within agent.nemo_gym.startup_timeout_s="
            f"{timeout_s:g}s" + (f"; see {self.log_path}" if self.log_path else "")
        )

    def url_of(self, name: str) -> str:
        try:
            return self.instances[name]
        except KeyError:
            known = ", ".join(sorted(self.instances)) or "none"
            raise KeyError(
                f"no NeMo Gym server instance named {name!r} (running: {known})"
            ) from None

    def stop(self) -> None:
        """Stop every process ``start`` began (the whole session); idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if process is not None:
            # Children that outlived ng_run (the servers, Gym's Ray) are in its session.
            _kill_session(process.pid)
        if self._ray_dir is not None:
            shutil.rmtree(self._ray_dir, ignore_errors=True)
            self._ray_dir = None


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code < 500
    except httpx.HTTPError:
        return False


def _kill_session(sid: int) -> None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
