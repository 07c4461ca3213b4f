"""The watcher's shared-memory ledger (:class:`nrl_core.distributed.reaper.SegmentLedger`), on
real segments in ``/dev/shm``: what it unlinks after a run, and what it must leave alone.

Here this test process plays the run's process (its pid is what the ledger observes); the whole
path, with Ray's processes stopped by a signal or ``kill -9``, is in ``test_cluster_hygiene.py``.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from nrl_core.distributed.reaper import SegmentLedger, mapped_segments

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (not Linux)")


@pytest.fixture
def segments():
    """Makes segments (mapped by this process) and removes whatever is left of them."""
    made = []

    def make(name=None):
        shm = shared_memory.SharedMemory(create=True, size=4096, name=name)
        made.append(shm)
        return shm

    yield make
    for shm in made:
        shm.close()
        if os.path.exists(f"/dev/shm/{shm.name}"):
            shm.unlink()


def _exists(shm) -> bool:
    return os.path.exists(f"/dev/shm/{shm.name}")


def test_mappings_name_the_segments_a_process_maps_with_their_inodes(segments):
    shm = segments()
    found = mapped_segments([os.getpid()])
    assert found[shm.name] == os.stat(f"/dev/shm/{shm.name}").st_ino


def test_a_named_semaphore_is_found_under_its_name_though_its_maker_maps_another():
    """glibc's sem_open maps a temporary file and links it under the semaphore's name: the
    maker's maps say ``/dev/shm/sem.XXXXXX (deleted)``. Every stopped vLLM engine left such a
    lock (``sem.mp-…``, its multiprocessing executor's ``shared_worker_lock``)."""
    import multiprocessing

    ledger = SegmentLedger()
    lock = multiprocessing.get_context("spawn").Lock()  # named: a spawned child reopens it
    name = "sem." + lock._semlock.name.lstrip("/")
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert f"/dev/shm/{name}" not in maps  # not under its name in its maker's maps
    ledger.observe([os.getpid()])
    try:
        assert ledger.release() == [name]
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        # The lock's own clean-up (when collected) would unlink it a second time.
        from multiprocessing import resource_tracker, util

        for finalizer in list(util._finalizer_registry.values()):
            if finalizer._args == (lock._semlock.name,):
                finalizer.cancel()
        resource_tracker.unregister(lock._semlock.name, "semaphore")


def test_a_segment_the_run_mapped_is_unlinked_and_one_that_existed_before_is_not(segments):
    before = segments()
    ledger = SegmentLedger()
    made = segments()  # like an engine's message queue
    ledger.observe([os.getpid()])
    assert ledger.release() == [made.name]
    assert not _exists(made) and _exists(before)


def test_a_new_segment_no_process_of_the_run_maps_is_left_alone(segments):
    ledger = SegmentLedger()
    theirs = segments()
    ledger.observe([1])  # the run's processes (here: init) do not map it
    assert ledger.release() == [] and _exists(theirs)


def test_the_runs_prefix_finds_segments_never_seen(segments):
    """A refit bucket lives for milliseconds: too short for the watcher's look once a second,
    so nrl's own segments carry the run's prefix instead."""
    prefix = f"nrl-{uuid.uuid4().hex[:8]}-"
    ledger = SegmentLedger(prefix)
    bucket = segments(f"{prefix}bucket")
    other_run = segments(f"nrl-{uuid.uuid4().hex[:8]}-bucket")
    assert ledger.release() == [bucket.name]
    assert not _exists(bucket) and _exists(other_run)


def test_a_name_reused_by_another_file_since_it_was_seen_is_left_alone(segments):
    ledger = SegmentLedger()
    first = segments()
    ledger.observe([os.getpid()])
    first.unlink()
    again = segments(first.name)  # same name, another file (another inode)
    assert ledger.release() == [] and _exists(again)


def test_what_the_driver_saw_last_counts_like_what_the_watcher_saw(segments):
    ledger = SegmentLedger()
    made = segments()
    ledger.record(mapped_segments([os.getpid()]))
    assert ledger.release() == [made.name]
