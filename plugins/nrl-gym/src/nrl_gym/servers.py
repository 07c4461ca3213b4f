"""NeMo Gym's servers, started with its own ``ng_run`` in the Gym venv, or joined.

``ng_run`` starts a head server (which serves the merged config and the list of server
instances) and one process per configured server, all in one new process session, bound to
``agent.nemo_gym.host`` (loopback by default). Gym joins the run's own Ray cluster
(``ray_head_node_address``) rather than starting one of its own. Its log is kept in a
``/tmp/nrl-gym-*`` folder while it runs, removed at stop; a start-up that fails says why in one
line (:func:`first_error_line` of the log) and leaves nothing behind.
"""

from __future__ import annotations

import os
import re
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

_ERROR_LINE = re.compile(
    r"^(?:[\w.]*(?:Error|Exception|Exit|Interrupt)|Traceback|RuntimeError|ConfigError)\b[^\n]*"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GymServers:
    """The server instances of a Gym head server, by instance name (the name rows put in
    ``agent_ref.name``), started by :meth:`start` or joined by :meth:`join`."""

    def __init__(self, keep_log: Path | None = None) -> None:
        self.keep_log = keep_log
        """Where Gym's log is copied when the servers stop (the run folder's
        ``nemo_gym.log``); None: it goes with the temporary folder."""
        self.process: subprocess.Popen | None = None
        self.head_url: str | None = None
        self.instances: dict[str, str] = {}
        self.log_path: Path | None = None
        self._dir: str | None = None

    def start(
        self,
        venv: Path,
        config_paths: list[str],
        endpoint: Any,
        *,
        timeout_s: float,
        ray_address: str | None = None,
        host: str = "127.0.0.1",
        python: str | None = None,
    ) -> None:
        """``ng_run`` the configs plus the training model server pointed at ``endpoint``;
        Gym's processes join the Ray cluster at ``ray_address`` (None: Gym starts one, as
        outside a run) and its servers bind ``host``."""
        site = package_dir(venv)
        links = server_venvs(venv, [*config_paths, TRAINING_MODEL_CONFIG], python)
        port = free_port()
        self._dir = tempfile.mkdtemp(prefix="nrl-gym-", dir="/tmp")
        self.log_path = Path(self._dir) / "ng_run.log"
        paths = [str(Path(p)) for p in [*config_paths, TRAINING_MODEL_CONFIG]]
        command = [
            str(venv / "bin" / "ng_run"),
            f"+config_paths=[{','.join(paths)}]",
            f"+policy_base_url={endpoint.base_url}",
            f"+policy_api_key={endpoint.api_key or 'none'}",
            f"+policy_model_name={endpoint.model}",
            f"+uv_venv_dir={links}",
            "+skip_venv_if_present=true",
            f"++default_host={host}",
            f"++head_server.host={host}",
            f"++head_server.port={port}",
        ]
        env = {
            **os.environ,
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
        }
        for var in ("RAY_ADDRESS", "PYTHONPATH", "PYTHONHOME"):  # not this process's
            env.pop(var, None)
        if ray_address:
            command.append(f"+ray_head_node_address={ray_address}")
            token = env.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").exists()
            if "RAY_AUTH_MODE" not in env and token:
                # A cluster started while a token exists requires it; a driver joining by
                # address sends it only in token mode.
                env["RAY_AUTH_MODE"] = "token"
        else:
            env["RAY_TMPDIR"] = self._dir
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command,
                cwd=site,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.head_url = f"http://{_client_host(host)}:{port}"
        self._wait_ready(timeout_s)

    def join(self, head_url: str, *, timeout_s: float) -> None:
        """Use the servers of a running head server."""
        self.head_url = head_url.rstrip("/")
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                reason = self._log_reason()
                self.stop()
                raise NrlError(f"NeMo Gym's ng_run exited with code {code}{reason}")
            try:
                listed = httpx.get(f"{self.head_url}/server_instances", timeout=5).json()
                urls = {i["config_path"]: i["url"] for i in listed}
                if urls and all(_healthy(url) for url in urls.values()):
                    self.instances = urls
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(1.0)
        reason = self._log_reason()
        self.stop()
        raise NrlError(
            f"NeMo Gym's servers were not ready within agent.nemo_gym.startup_timeout_s="
            f"{timeout_s:g}s{reason}"
        )

    def _log_reason(self) -> str:
        """``: <first error line of ng_run.log>`` (empty without a log or an error in it)."""
        if self.log_path is None:
            return ""
        kept = f"; Gym's log: {self.keep_log}" if self.keep_log is not None else ""
        try:
            line = first_error_line(self.log_path.read_text(errors="replace"))
        except OSError:
            return ""
        return (f": {line}" if line else "") + kept

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
        if self._dir is not None:
            if self.keep_log is not None and self.log_path is not None:
                try:
                    self.keep_log.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(self.log_path, self.keep_log)
                except OSError:
                    pass  # a log we cannot keep must not fail the run's shutdown
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def first_error_line(log: str) -> str | None:
    """The line of ``ng_run``'s log that says what went wrong: the first exception line
    (``SomeError: ...``, ``Exception: ...``) that is not inside a traceback's frames, with the
    server's ``(name)`` prefix kept; else the last line that mentions an error; shortened to
    300 characters."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    for line in lines:
        text = re.sub(r"^\([\w.-]+\) ", "", line)  # Gym prefixes a server's lines with its name
        if _ERROR_LINE.match(text) and not text.startswith("Traceback"):
            return line[:300]
    mentions = [line for line in lines if re.search(r"error|failed", line, re.IGNORECASE)]
    return mentions[-1][:300] if mentions else None


def _client_host(host: str) -> str:
    """Where this process reaches a server bound to ``host`` (a wildcard bind: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


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
