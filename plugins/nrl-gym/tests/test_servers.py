"""Starting NeMo Gym's servers (nrl_gym.servers, nrl_gym.install): what a failed start-up says
and leaves behind, and which venv each configured server gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from nrl_gym.install import server_requirements
from nrl_gym.servers import GymServers, first_error_line

from nrl_core.agents import Endpoint
from nrl_core.errors import NrlError

# Lines of real ng_run logs (nemo-gym 0.7.0): a config path that does not exist, and the
# issue's failure (Gym's own Ray head timing out on a busy machine).
MISSING_CONFIG_LOG = """\
⚠  `ng_run` is deprecated and will be removed in a future release; use `gym env start` instead.
Error: config_paths entry '/nonexistent/gym.yaml' was not found. Looked in:
  - /root/.cache/nrl/nemo-gym-0.7.0-py3.11.7-ray2.60.0/lib/python3.11/site-packages/x.yaml
"""
RAY_TIMEOUT_LOG = """\
NeMo Gym is starting a new Ray cluster...
Traceback (most recent call last):
  File "/venv/lib/python3.13/site-packages/ray/_private/node.py", line 440, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the \
raylet failed to startup or the GCS has become overloaded.
"""
SERVER_IMPORT_LOG = """\
Starting `reasoning_gym` from venv /cache/servers/resources_servers/reasoning_gym/.venv
(reasoning_gym) Traceback (most recent call last):
(reasoning_gym)   File "app.py", line 20, in <module>
(reasoning_gym) ModuleNotFoundError: No module named 'reasoning_gym'
"""


@pytest.mark.parametrize(
    "log, line",
    [
        (MISSING_CONFIG_LOG, "Error: config_paths entry '/nonexistent/gym.yaml' was not found."),
        (RAY_TIMEOUT_LOG, "Exception: The current node timed out during startup."),
        (SERVER_IMPORT_LOG, "(reasoning_gym) ModuleNotFoundError: No module named"),
    ],
)
def test_the_first_real_error_line_of_the_log_is_found(log, line):
    assert first_error_line(log).startswith(line)


def test_a_log_without_an_error_names_none():
    assert first_error_line("Starting `x`\nAll 4 / 4 servers ready!\n") is None


def test_a_server_requirements_are_what_it_adds_to_nemo_gym(tmp_path):
    (tmp_path / "requirements.txt").write_text(
        "-e nemo-gym[dev] @ ../../\n# a comment\n\nreasoning-gym>=0.1.19  # why\ncycler==0.12.1\n"
    )
    assert server_requirements(tmp_path) == ["reasoning-gym>=0.1.19", "cycler==0.12.1"]
    (tmp_path / "requirements.txt").write_text("-e nemo-gym[dev] @ ../../\n")
    assert server_requirements(tmp_path) == []
    assert server_requirements(tmp_path / "absent") == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failed_start_says_why_in_one_line_and_leaves_no_folder(tmp_path):
    """Real ng_run (Gym's venv built on first use) with a config file that does not exist."""
    from nrl_gym.install import gym_venv

    servers = GymServers(keep_log=tmp_path / "nemo_gym.log")
    endpoint = Endpoint(base_url="http://127.0.0.1:9/v1", model="m", api_key=None)
    with pytest.raises(NrlError) as raised:
        servers.start(gym_venv("0.7.0"), ["/nonexistent/gym.yaml"], endpoint, timeout_s=600)
    message = str(raised.value)
    assert "\n" not in message
    assert "config_paths entry '/nonexistent/gym.yaml' was not found" in message, message
    assert str(tmp_path / "nemo_gym.log") in message
    # The servers' session was stopped and the temporary folder removed; the log was kept.
    assert servers.process is None
    assert not Path(servers.log_path).parent.exists()
    assert "was not found" in (tmp_path / "nemo_gym.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_server_with_requirements_gets_a_venv_with_them():
    """reasoning_gym's requirements.txt asks for reasoning-gym: its server directory links to
    a venv that has it (built once, keyed by the requirements); the others to Gym's own."""
    import subprocess

    from nrl_gym.install import gym_venv, server_venvs

    venv = gym_venv("0.7.0")
    root = server_venvs(venv, ["resources_servers/reasoning_gym/configs/reasoning_gym.yaml"])
    own = (root / "resources_servers" / "reasoning_gym" / ".venv").resolve()
    assert own != venv.resolve() and own.name.startswith(f"{venv.name}-req-")
    done = subprocess.run(
        [str(own / "bin" / "python"), "-c", "import reasoning_gym, nemo_gym"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (root / "resources_servers" / "blackjack" / ".venv").resolve() == venv.resolve()
