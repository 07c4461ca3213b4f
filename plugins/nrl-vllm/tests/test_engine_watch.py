"""How a dead engine-core process ended, read without racing vLLM's own monitor (which polls
the same child at the same moment; the poll that loses the race reads no exit code)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

from nrl_vllm.worker import _exit_code


def _sleep() -> None:
    time.sleep(60)


def _exit_3() -> None:
    os._exit(3)


def test_a_killed_child_reads_as_its_signal():
    proc = multiprocessing.get_context("spawn").Process(target=_sleep)
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    wait([proc.sentinel])
    assert _exit_code(proc) == -signal.SIGKILL


def test_a_killed_child_reads_as_its_signal_while_another_thread_polls_it():
    """vLLM's monitor thread polls (and so reaps) the same child as the watcher reads it. With
    the watcher's former ``join(); exitcode``, 19 of 300 such reads gave None (measured); a
    hundred tries make that failure near certain."""
    context = multiprocessing.get_context("fork")  # fast to start; the child only sleeps
    for _ in range(100):
        proc = context.Process(target=_sleep)
        proc.start()
        os.kill(proc.pid, signal.SIGKILL)
        wait([proc.sentinel])
        poller = threading.Thread(target=lambda p=proc: (p.exitcode, p.is_alive()))
        poller.start()
        assert _exit_code(proc) == -signal.SIGKILL
        poller.join()


def test_an_exit_code_reads_as_itself():
    proc = multiprocessing.get_context("spawn").Process(target=_exit_3)
    proc.start()
    wait([proc.sentinel])
    assert _exit_code(proc) == 3
