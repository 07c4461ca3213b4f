"""The distributed runtime: Ray clusters, worker groups of actors, per-plugin actor venvs.

Importing this package is cheap; Ray is imported by the submodules that need it
(:mod:`~nrl_core.distributed.cluster`, :mod:`~nrl_core.distributed.worker_group`).
"""

import os

# nrl decides every worker's interpreter (the actor venvs, or the driver's own) and working
# directory (the driver's). Ray's `uv run` hook would instead start workers with `uv run` in a
# copy of the working directory: relative output paths then land in that throw-away copy (the
# checkpoints lost their weights), `uv run --no-sync` drivers get workers without Ray, and each
# run leaves a multi-GB venv behind. Ray reads this when it is first imported, which happens in
# the submodules below this package.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

# Ray's API functions (ray.get, ray.kill, actor calls, ...) start a fresh local Ray instance
# when none is connected. In nrl only the cluster component starts Ray; a call made after it
# stopped Ray (tearing down after Ctrl-C) must fail, not start a second instance.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


def keep_workers_in_the_drivers_environment() -> None:
    """Turn Ray's ``uv run`` hook off in a process that imported Ray before this package.

    The default above reaches Ray only when it is set before Ray's first import; a driver
    script that starts with ``import ray`` then uses nrl (a user's, or a test's), run under
    ``uv run`` (Ray looks for it among all the process's ancestors), got the hook all the
    same: its workers ran ``uv run`` in a copy of the working directory, which synced a venv
    there and built every workspace package or, under ``uv run --no-sync``, never found Ray
    and hung. Ray reads its constant at each ``ray.init``, so setting it once, when this
    package is imported (below), reaches every later ``ray.init``; a
    ``RAY_ENABLE_UV_RUN_RUNTIME_ENV`` that the user set true (as Ray reads it: ``1`` or
    ``true``) keeps the hook on."""
    import sys

    constants = sys.modules.get("ray._private.ray_constants")
    setting = os.environ.get("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if constants is not None and setting.lower() not in ("1", "true"):
        constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


keep_workers_in_the_drivers_environment()
