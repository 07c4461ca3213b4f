"""`nrl serve` as users run it: a subprocess serving the tiny model, talked to by the real
`openai` client, stopped by SIGTERM with nothing left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest


@pytest.mark.slow  # starts `nrl serve` (Ray and an engine) in a subprocess
def test_nrl_serve_answers_the_openai_client_and_stops_cleanly():
    # Ray's socket paths must stay short: a folder of our own directly under /tmp.
    tmp_path = Path(tempfile.mkdtemp(prefix="nrl-t-", dir="/tmp"))
    env = {**os.environ, "NRL_ACTOR_ENV": "system", "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "nrl_core.cli", "serve", "--port", "0", "cluster.num_cpus=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url, seen = None, []
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.match(r"serving tiny at (http://127\.0\.0\.1:\d+/v1)", line)
            url = found.group(1) if found else None
        assert url, "".join(seen)[-3000:]
        client = openai.OpenAI(base_url=url, api_key="unused")
        assert client.models.list().data[0].id == "tiny"
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=4
        )
        generated = reply.choices[0].message.model_extra["generation_token_ids"]
        assert 1 <= len(generated) <= 4
    finally:
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM, rest
    # No traceback: the serving thread shuts uvicorn down on its own loop (a socket closed
    # from outside it made SIGTERM print "ValueError: Invalid file descriptor: -1").
    assert "Traceback" not in rest and "Invalid file descriptor" not in rest, rest
    # The run's Ray temp folder (under TMPDIR) was removed at exit.
    assert not list(tmp_path.glob("nrl-ray-*"))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "server.port"),
        (["server.tool_parser=xml"], "server.tool_parser"),
        # Issue 47: the network without a key served anyone, with no word.
        (["--host", "0.0.0.0"], "server.host=0.0.0.0 serves the network and no API key"),
    ],
)
def test_bad_serve_settings_are_one_line_and_exit_2(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "host, api_key, open_on_purpose, refused",
    [
        ("0.0.0.0", None, False, True),
        ("::", None, False, True),
        ("192.168.1.7", "", False, True),  # an empty key checks nothing
        ("my-host.example", None, False, True),  # a name may be any interface
        ("0.0.0.0", "secret", False, False),
        ("0.0.0.0", None, True, False),  # --no-api-key
        ("127.0.0.1", None, False, False),
        ("127.0.0.2", None, False, False),
        ("::1", None, False, False),
        ("localhost", None, False, False),
    ],
)
def test_a_network_host_needs_an_api_key_or_no_api_key(host, api_key, open_on_purpose, refused):
    """Issue 47: `nrl serve --host 0.0.0.0` without a key served the network silently."""
    from nrl_core.cli.serve import check_exposure
    from nrl_core.config.schema import ServerConfig
    from nrl_core.errors import ConfigError

    server = ServerConfig(host=host, api_key=api_key)
    if refused:
        with pytest.raises(ConfigError, match=r"--api-key KEY .* or --no-api-key"):
            check_exposure(server, open_on_purpose=open_on_purpose)
    else:
        check_exposure(server, open_on_purpose=open_on_purpose)
