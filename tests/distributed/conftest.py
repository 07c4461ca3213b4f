"""One real local Ray session shared by the distributed tests (starting Ray takes ~15 s)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"


@pytest.fixture(scope="session")
def worker_env() -> dict[str, str]:
    """Puts ``nrl_test_workers`` on the actors' path (it is not part of an installed package)."""
    return {"PYTHONPATH": str(HERE)}


def processes_matching(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (our own Ray session's processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids) -> list[int]:
    """The PIDs of ``pids`` that still run (zombies count as gone)."""
    result = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            result.append(pid)
    return result


def stop_processes(pids, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: stops only the given processes."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
