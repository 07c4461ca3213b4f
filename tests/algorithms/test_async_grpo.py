"""Asynchronous GRPO (``grpo.async``) on separate torch engines, through the real CLI, and the
producer's age bound against a scripted trainer."""

from __future__ import annotations

import math
import threading
import time

import pytest

from nrl_core.algorithms.async_grpo import RolloutProducer, WeightGate
from tests.algorithms.test_grpo_cli import metrics, run_nrl

SEPARATE = ["generation.colocated=false", "generation.num_engines=1", "grpo.max_num_steps=4"]


def _comparable(record: dict) -> dict:
    """A step's metrics without wall-clock ones (timing, throughput, async bookkeeping)."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("timing/", "throughput/", "async/", "refit/gb_per_s"))
    }


@pytest.mark.slow
def test_age_zero_reproduces_the_synchronous_run(tmp_path):
    run_nrl(tmp_path / "sync", *SEPARATE)
    run_nrl(
        tmp_path / "async",
        *SEPARATE,
        "grpo.async.enabled=true",
        "grpo.async.max_trajectory_age_steps=0",
    )
    sync, asynchronous = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [r["step"] for r in sync] == [r["step"] for r in asynchronous] == [0, 1, 2, 3, 4]
    for a, b in zip(sync, asynchronous, strict=True):
        assert _comparable(a) == _comparable(b)
    trained = [r for r in asynchronous if "async/trajectory_age_max" in r]
    assert len(trained) == 4 and all(r["async/trajectory_age_max"] == 0 for r in trained)
    assert all(r["refit/bytes"] > 0 for r in trained)


@pytest.mark.slow
def test_age_one_trains_nothing_older_than_one_step_and_overlaps(tmp_path):
    run_nrl(
        tmp_path,
        *SEPARATE,
        "grpo.max_num_steps=6",
        "grpo.async.enabled=true",
        "grpo.async.max_trajectory_age_steps=1",
        "checkpointing.save_period=3",
    )
    trained = [r for r in metrics(tmp_path) if "async/trajectory_age_max" in r]
    assert len(trained) == 6
    ages = [r["async/trajectory_age_max"] for r in trained]
    assert max(ages) <= 1
    # The producer ran ahead: some batch was generated while the trainer trained.
    assert 1 in ages
    assert all(r["async/dropped_stale"] == 0 for r in trained)
    assert all(0 <= r["async/engine_idle_fraction"] <= 1 for r in trained)
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    assert (tmp_path / "ckpt" / "step_6").is_dir()


def test_async_with_generation_in_the_policy_workers_is_one_line(tmp_path):
    result = run_nrl(tmp_path, "grpo.async.enabled=true", check=False)
    assert result.returncode == 2
    assert "set generation.torch.colocated=false" in result.stderr
    assert "Traceback" not in result.stderr


class _Stream:
    def __init__(self) -> None:
        self.position = 0

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self.position = state["position"]


class _NoSignal(Exception):
    pass


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_the_producer_never_starts_a_batch_older_than_the_bound(max_age):
    """A trainer that refits after every step against a producer that would run ahead: every
    batch's version is within ``max_age`` steps of the step that trains it, the buffer never
    exceeds its bound, and with age 0 every batch holds exactly the previous step's weights."""
    gate = WeightGate(lambda: None, lambda: 0.0)
    stream = _Stream()
    started: list[tuple[int, int | None]] = []

    def collect(step: int) -> int:
        started.append((step, gate.version))
        stream.position += 1
        time.sleep(0.002)
        return step

    producer = RolloutProducer(
        collect, _NoSignal, gate, stream, first_step=1, last_step=12, max_age=max_age, max_buffer=2
    )
    try:
        for step in range(1, 13):
            gate.ensure(step - 1)
            produced = producer.take(step)
            assert produced.data == step
            assert 0 <= (step - 1) - produced.version <= max_age
            if max_age == 0:
                assert produced.version == step - 1
            assert producer.buffered <= 2
            time.sleep(0.005)  # training
    finally:
        producer.stop()
    assert [s for s, _ in started] == list(range(1, 13))


def test_discard_rewinds_the_stream_to_the_oldest_waiting_batch():
    gate = WeightGate(lambda: None, lambda: 0.0)
    stream = _Stream()
    done = threading.Event()

    def collect(step: int) -> int:
        stream.position += 1
        if step == 3:
            done.set()
        return step

    producer = RolloutProducer(
        collect, _NoSignal, gate, stream, first_step=1, last_step=10, max_age=5, max_buffer=3
    )
    try:
        gate.ensure(0)
        assert done.wait(10)
        assert producer.take(1).data == 1  # batches 2 and 3 wait
        with producer.paused():
            assert producer.discard(next_step=2) == 2
            assert stream.position == 1  # where batch 2 began
        gate.ensure(1)  # discard forgot the engines' version: nothing starts before a refit
        assert producer.take(2).data == 2 and stream.position >= 2
    finally:
        producer.stop()
