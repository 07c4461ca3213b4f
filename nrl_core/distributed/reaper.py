"""Clean up after a driver that dies without stopping its local Ray head (``kill -9``, the
out-of-memory killer).

Ray starts its GCS server and raylet with ``PR_SET_PDEATHSIG``, so they die with the driver;
but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), noticing that
their raylet died without a SIGTERM, then try for 60 s (a fixed timeout in
``ray._private.utils.publish_error_to_driver``) to report it to the GCS that died too, and the
temp folder ``/tmp/nrl-ray-<id>`` stays behind. :class:`~nrl_core.distributed.cluster.LocalCluster`
therefore starts this script as a small watcher process of its own, in its own session (a
Ctrl-C in the terminal does not reach it)::

    python -I -S reaper.py TEMP_DIR [LINK]

While the driver lives, the watcher follows the driver's Ray processes (the children whose
command line names ``TEMP_DIR``, and everything below them) once a second. When the driver is
gone (its parent pid changes, or its stdin closes) without having written ``done``, it kills
those processes and removes ``TEMP_DIR`` and the ``LINK`` symlink to it, unless the driver
wrote ``keep`` (``nrl run -v``: the logs of a failed run stay). After a clean shutdown the
driver does all of that itself and writes ``done``.

Standard library only (it runs with ``-S``, without site-packages); also imported by the
cluster module for :func:`session_processes` and :func:`remove_temp_dir`.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time

POLL_S = 1.0
"""How often the watcher refreshes its list of the driver's Ray processes."""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (with the pid, it names one process: pids are
    reused), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _children(pid: int) -> set[int]:
    """The child processes of ``pid`` (children are recorded per thread)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as file:
                found.update(int(child) for child in file.read().split())
        except FileNotFoundError:
            return _children_by_scan(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return found


def _children_by_scan(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                ppid = int(file.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.add(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def session_processes(driver: int, temp_dir: str, exclude: int | None = None) -> dict[int, int]:
    """``{pid: start time}`` of the Ray processes a driver started for the head whose temp dir
    is ``temp_dir``: its children naming that folder on their command line (GCS, raylet, log
    monitor, dashboard) and all their descendants (agents, workers; these rename themselves
    ``ray::...``, hence the walk down the tree rather than a match on every command line).
    ``exclude``: the watcher, whose command line names the folder too."""
    roots = [pid for pid in _children(driver) if pid != exclude and temp_dir in _cmdline(pid)]
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        start = _start_time(pid)
        if start is None:
            continue
        found[pid] = start
        todo.extend(_children(pid))
    return found


def alive(processes: dict[int, int]) -> dict[int, int]:
    """Those of ``processes`` still running (same pid and start time)."""
    return {pid: start for pid, start in processes.items() if _start_time(pid) == start}


def kill(processes: dict[int, int], grace_s: float = 0.0) -> None:
    """SIGKILL those of ``processes`` that still run (after ``grace_s`` to exit on their own),
    then wait up to 5 s for them to be gone."""
    deadline = time.monotonic() + grace_s
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive(processes):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_temp_dir(temp_dir: str, link: str | None = None, attempts: int = 5) -> bool:
    """Remove ``temp_dir`` and the symlink ``link`` if it points there; True when it is gone.

    Retried: a Ray process that is still exiting may create a file in it meanwhile."""
    for attempt in range(attempts):
        shutil.rmtree(temp_dir, ignore_errors=True)
        if not os.path.lexists(temp_dir):
            break
        time.sleep(0.2 * (attempt + 1))
    if link and os.path.islink(link):
        with contextlib.suppress(OSError):
            if os.path.realpath(link) == os.path.realpath(temp_dir) or not os.path.exists(link):
                os.unlink(link)
    return not os.path.lexists(temp_dir)


def main(argv: list[str]) -> int:
    """Watch the parent (the driver) until it says ``done`` or dies; see the module doc."""
    temp_dir = argv[1]
    link = argv[2] if len(argv) > 2 and argv[2] else None
    driver = os.getppid()
    keep = False
    tracked: dict[int, int] = {}
    next_poll = 0.0
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], POLL_S / 2)
        if ready:
            # Unbuffered reads: a buffered reader could hold "done" while select waits.
            chunk = os.read(stdin, 4096)
            if not chunk:
                break  # EOF: the driver's end of the pipe closed, so the driver is gone
            for command in chunk.split():
                if command == b"done":
                    return 0
                if command in (b"keep", b"remove"):
                    keep = command == b"keep"
        if os.getppid() != driver:
            break
        if time.monotonic() >= next_poll:
            tracked = alive(tracked) | session_processes(driver, temp_dir, os.getpid())
            next_poll = time.monotonic() + POLL_S
    kill(tracked)
    if not keep:
        remove_temp_dir(temp_dir, link)
    return 0


if __name__ == "__main__":
    # The terminal's Ctrl-C goes to the driver; the watcher must outlive it to clean up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main(sys.argv))
