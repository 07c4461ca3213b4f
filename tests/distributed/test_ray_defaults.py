"""The Ray settings ``nrl_core.distributed`` makes before any cluster starts (its ``__init__``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_DRIVER = """
import json
import ray  # before anything of nrl's, as a user's script may
from ray._private.worker import _maybe_modify_runtime_env  # what ray.init does to runtime_env

before = _maybe_modify_runtime_env(None, False)
import nrl_core.distributed  # noqa: E402, F401  (what every cluster and CLI path imports)

print("RESULT", json.dumps([before, _maybe_modify_runtime_env(None, False)]))
"""


def _under_uv_run(tmp_path, env_extra=None) -> list[dict]:
    """Run the driver as a child of a process whose command line is ``uv run`` (what Ray's
    hook looks for among the ancestors; ``exec -a`` names it, no uv runs), in ``tmp_path``;
    the driver's runtime_env before and after it imports nrl's distributed package."""
    (tmp_path / "driver.py").write_text(textwrap.dedent(_DRIVER))
    (tmp_path / "run").write_text(f"{sys.executable} driver.py\n")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **(env_extra or {})}
    done = subprocess.run(
        ["bash", "-c", "exec -a uv bash run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def test_a_driver_that_imported_ray_first_starts_no_worker_through_uv_run(tmp_path):
    """A script that imports Ray before nrl, run under ``uv run``: Ray had read its hook's
    setting already (on), so workers would run ``uv run`` in a copy of the working directory
    (minutes to sync a venv there; never Ray under ``uv run --no-sync``: a driver of
    tests/distributed/test_cluster.py hung until its 180 s timeout). nrl turns it off when its
    distributed package is imported: the runtime_env stays as given (none)."""
    before, after = _under_uv_run(tmp_path)
    assert before.get("py_executable", "").startswith("uv run"), before  # the hook was on
    assert before.get("working_dir") == str(tmp_path)
    assert after is None


def test_a_hook_the_user_turned_on_stays_on(tmp_path):
    before, after = _under_uv_run(tmp_path, {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "1"})
    assert after == before and after["py_executable"].startswith("uv run"), after
