"""Clean up after a driver that dies without stopping its local Ray head (``kill -9``, the
out-of-memory killer), and after every run, the shared memory its processes left.

Ray starts its GCS server and raylet with ``PR_SET_PDEATHSIG``, so they die with the driver;
but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), noticing that
their raylet died without a SIGTERM, then try for 60 s (a fixed timeout in
``ray._private.utils.publish_error_to_driver``) to report it to the GCS that died too, and the
temp folder ``/tmp/nrl-ray-<id>`` stays behind. :class:`~nrl_core.distributed.cluster.LocalCluster`
therefore starts this script as a small watcher process of its own, in its own session (a
Ctrl-C in the terminal does not reach it)::

    python -I -S reaper.py TEMP_DIR [LINK [SEGMENT_PREFIX [owned|borrowed]]]

While the driver lives, the watcher follows the driver's Ray processes (the children whose
command line names ``TEMP_DIR``, and everything below them) once a second, and notes the
shared-memory segments they map (:class:`SegmentLedger`). When the driver is gone (its parent
pid changes, or its stdin closes) without having written ``done``, it kills those processes,
unlinks the run's segments, and removes ``TEMP_DIR`` (unless ``borrowed``: a folder the driver
did not make) and the ``LINK`` symlink to it, unless the driver wrote ``keep`` (``nrl run -v``:
the logs of a failed run stay). After a clean shutdown (or a Ctrl-C / SIGTERM) the driver stops
the processes and the temp folder itself, tells the watcher the segments its processes mapped
last (``seen NAME INODE``) and writes ``done``; the watcher then unlinks the run's segments.

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
    return _with_descendants(roots)


def _with_descendants(
    roots: list[int], spared: set[int] | frozenset[int] = frozenset()
) -> dict[int, int]:
    """``{pid: start time}`` of ``roots`` and every live process below them, none of
    ``spared``."""
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in found or pid in spared:
            continue
        start = _start_time(pid)
        if start is None:
            continue
        found[pid] = start
        todo.extend(_children(pid))
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def processes_naming(temp_dir: str, exclude: int | None = None) -> dict[int, int]:
    """``{pid: start time}`` of every process on this machine whose command line names
    ``temp_dir``, with their descendants: unlike :func:`session_processes`, orphans too (a Ray
    agent whose raylet died of the same Ctrl-C is nobody's child, and can still write its log
    into the folder). Never this process, its ancestors (a command line that passes the folder
    down), nor ``exclude`` (the watcher)."""
    spared = {pid for pid in (exclude,) if pid is not None}
    pid: int | None = os.getpid()
    while pid and pid not in spared:
        spared.add(pid)
        pid = _parent(pid)
    roots = [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and int(entry) not in spared and temp_dir in _cmdline(int(entry))
    ]
    return _with_descendants(roots, spared)


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


# -- shared memory ------------------------------------------------------------------------------

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments live on Linux (``shm_open`` names)."""

FOREIGN_AFTER_S = 10.0
"""A new segment that no process of the run maps within this time is another program's."""


def segment_names(shm_dir: str = SHM_DIR) -> set[str]:
    """The names in ``shm_dir`` now (empty where there is none)."""
    try:
        return set(os.listdir(shm_dir))
    except OSError:
        return set()


def mapped_segments(pids, shm_dir: str = SHM_DIR) -> dict[str, int]:
    """``{name: inode}`` of the segments of ``shm_dir`` that the processes ``pids`` map.

    Matched by inode (``/proc/<pid>/maps``), not by the path there: glibc's ``sem_open`` (named
    semaphores, ``sem.*``: every multiprocessing lock of a spawned process) maps a temporary
    file, links it under the semaphore's name and unlinks the temporary name, so its creator's
    maps say ``/dev/shm/sem.XXXXXX (deleted)`` for a file still linked as ``sem.mp-…``."""
    marker = shm_dir.encode() + b"/"
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as file:
                data = file.read()
        except OSError:
            continue
        if marker not in data:  # most processes map none: skip the line split
            continue
        for line in data.splitlines():
            # address perms offset dev inode pathname (which may hold spaces)
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(marker):
                inodes.add(int(fields[4]))
    found: dict[str, int] = {}
    if inodes:
        for name in segment_names(shm_dir):
            try:
                inode = os.stat(os.path.join(shm_dir, name)).st_ino
            except OSError:
                continue
            if inode in inodes:
                found[name] = inode
    return found


def orphaned_segments(before: set[str], shm_dir: str = SHM_DIR) -> list[str]:
    """The segments of ``shm_dir`` that are not in ``before`` and that no live process maps:
    what a run left behind (a check for test suites: a segment some process still maps is in
    use, not leaked)."""
    new = segment_names(shm_dir) - set(before)
    if not new:
        return []
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return sorted(new - mapped_segments(pids, shm_dir).keys())


class SegmentLedger:
    """The shared-memory segments a run's processes leave in ``/dev/shm``, unlinked by
    :meth:`release` once those processes are dead.

    A process killed mid-work never unlinks what it created: the policy rank that dies inside a
    refit leaves its bucket, a stopped vLLM or SGLang engine its message queues (hundreds of MiB
    each). Two kinds of segment are the run's:

    * nrl's own, named with the run's ``prefix`` (``NRL_SHM_PREFIX``, which the driver sets for
      every process of its Ray head): all of them, however short-lived;
    * any other that appeared after the ledger started and that a process of the run was seen
      mapping (:meth:`observe`, polled while they live and once more just before they are
      stopped; :meth:`record` takes what the driver saw). It is unlinked only if the name still
      names the file seen then (same inode).

    Segments that existed before, or that only other programs map, are never touched.
    """

    def __init__(self, prefix: str | None = None, shm_dir: str = SHM_DIR) -> None:
        self.prefix = prefix or None
        self.shm_dir = shm_dir
        self._before = segment_names(shm_dir)
        self._seen: dict[str, int] = {}
        self._unclaimed: dict[str, float] = {}  # new, unmapped by the run: since when

    def observe(self, pids) -> None:
        """Record the new segments that ``pids`` (the run's processes) map now."""
        now = time.monotonic()
        current = segment_names(self.shm_dir)
        self._unclaimed = {n: t for n, t in self._unclaimed.items() if n in current}
        new = current - self._before - self._seen.keys()
        new = {n for n in new if now - self._unclaimed.setdefault(n, now) < FOREIGN_AFTER_S}
        if new:
            self.record({n: i for n, i in mapped_segments(pids, self.shm_dir).items() if n in new})

    def record(self, mappings: dict[str, int]) -> None:
        """Take segments (``{name: inode}``) seen mapped by the run's processes."""
        for name, inode in mappings.items():
            if name not in self._before:
                self._seen[name] = inode
                self._unclaimed.pop(name, None)

    def release(self) -> list[str]:
        """Unlink the run's segments that are still there; returns their names."""
        removed = []
        for name in sorted(segment_names(self.shm_dir)):
            ours = self.prefix is not None and name.startswith(self.prefix)
            inode = self._seen.get(name)
            if not ours and inode is None:
                continue
            path = os.path.join(self.shm_dir, name)
            try:
                if not ours and os.stat(path).st_ino != inode:
                    continue  # another file by that name since
                os.unlink(path)
            except OSError:
                continue
            removed.append(name)
        return removed


def main(argv: list[str]) -> int:
    """Watch the parent (the driver) until it says ``done`` or dies; see the module doc."""
    temp_dir = argv[1]
    link = argv[2] if len(argv) > 2 and argv[2] else None
    ledger = SegmentLedger(argv[3] if len(argv) > 3 else None)
    owns_temp = len(argv) <= 4 or argv[4] == "owned"
    driver = os.getppid()
    keep = False
    tracked: dict[int, int] = {}
    next_poll = 0.0
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], POLL_S / 2)
        if ready:
            # Unbuffered reads: a buffered reader could hold "done" while select waits.
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # EOF: the driver's end of the pipe closed, so the driver is gone
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                command, *args = line.split() or [b""]
                if command == b"done":
                    # The driver stopped every process of the run (they are dead now).
                    ledger.release()
                    return 0
                if command in (b"keep", b"remove"):
                    keep = command == b"keep"
                elif command == b"seen" and len(args) == 2 and args[1].isdigit():
                    ledger.record({args[0].decode(errors="replace"): int(args[1])})
        if os.getppid() != driver:
            break
        if time.monotonic() >= next_poll:
            tracked = alive(tracked) | session_processes(driver, temp_dir, os.getpid())
            ledger.observe(tracked)
            next_poll = time.monotonic() + POLL_S
    ledger.observe(alive(tracked))  # those still running, before they are stopped
    kill(tracked)
    ledger.release()
    if owns_temp and not keep:
        remove_temp_dir(temp_dir, link)
    return 0


if __name__ == "__main__":
    # The terminal's Ctrl-C goes to the driver; the watcher must outlive it to clean up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main(sys.argv))
