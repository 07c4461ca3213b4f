"""Asynchronous GRPO (``grpo.async``) on separate torch engines, through the real CLI, and the
producer's age bound against a scripted trainer."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from nrl_core.algorithms.async_grpo import (
    GroupProducer,
    RolloutProducer,
    StuckEngineError,
    WeightGate,
)
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
    # Every logged training sample records the versions of the weights that generated its
    # tokens (torch engines: one call, one version), within the age bound of its step.
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    train = [s for s in samples if s["split"] == "train"]
    assert train
    for sample in train:
        runs = sample["weight_versions"]
        assert len(runs) == 1 and runs[0][1] >= 1, runs
        assert 0 <= (sample["step"] - 1) - runs[0][0] <= 1


@pytest.mark.slow
def test_groups_stream_one_call_each_across_two_engines(tmp_path):
    """Streaming at its finest grain through the real CLI: one prompt per generate call, two
    torch engines with a call in flight each, age bound 1; every step trains a full batch
    within the bound and its samples carry their tokens' versions."""
    run_nrl(
        tmp_path,
        "generation.colocated=false",
        "generation.num_engines=2",
        "grpo.max_num_steps=4",
        "grpo.async.enabled=true",
        "grpo.async.max_trajectory_age_steps=1",
        "grpo.async.groups_per_call=1",
    )
    trained = [r for r in metrics(tmp_path) if "async/trajectory_age_max" in r]
    assert len(trained) == 4
    assert all(0 <= r["async/trajectory_age_max"] <= 1 for r in trained)
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    for sample in (s for s in samples if s["split"] == "train"):
        assert all(0 <= (sample["step"] - 1) - v <= 1 for v, _ in sample["weight_versions"])


@pytest.mark.slow
def test_in_flight_refits_run_through_the_cli(tmp_path):
    """``grpo.async.in_flight_weight_updates=true`` on two torch engines, one prompt per call,
    age bound 1: every step trains a full batch within the bound, and every sample's tokens
    carry versions that never go back (a refit that lands mid-call only moves them forward),
    from its call's start version (within the bound) to at most the trainer's ``step - 1``."""
    run_nrl(
        tmp_path,
        "generation.colocated=false",
        "generation.num_engines=2",
        "grpo.max_num_steps=4",
        "grpo.async.enabled=true",
        "grpo.async.max_trajectory_age_steps=1",
        "grpo.async.groups_per_call=1",
        "grpo.async.in_flight_weight_updates=true",
    )
    trained = [r for r in metrics(tmp_path) if "async/trajectory_age_max" in r]
    assert len(trained) == 4
    assert all(0 <= r["async/trajectory_age_max"] <= 1 for r in trained)
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    mixed = 0
    for sample in (s for s in samples if s["split"] == "train"):
        versions = [v for v, _ in sample["weight_versions"]]
        assert versions == sorted(set(versions)), sample["weight_versions"]
        assert 0 <= (sample["step"] - 1) - versions[0] <= 1
        assert versions[-1] <= sample["step"] - 1
        mixed += len(versions) > 1
    print(f"samples with tokens of two versions: {mixed}")


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


def _group_producer(roll, gate, stream, **kwargs):
    def draw(count: int) -> list[int]:
        first = stream.position
        stream.position += count
        return list(range(first, first + count))

    options = {"first_step": 1, "last_step": 20, "max_buffer": 2, "groups_per_step": 3}
    return GroupProducer(draw, roll, gate, stream, **{**options, **kwargs})


def test_a_long_group_does_not_hold_back_groups_that_finished():
    """One group per call, three calls at once, age bound 1: prompt 0's call hangs, and
    step 1 trains on three later prompts meanwhile; prompt 0, done later, trains at step 2 (age 1)
    with the next prompts, in prompt order."""
    gate = WeightGate(lambda: None, lambda: 0.0, concurrent=True)
    stream = _Stream()
    release = threading.Event()

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[int]]:
        if drawn == [0]:
            assert release.wait(10)
        return [[prompt] for prompt in drawn]

    producer = _group_producer(
        roll, gate, stream, max_age=1, groups_per_call=1, calls_in_flight=3, wait_timeout_s=10
    )
    try:
        gate.ensure(0)
        first = producer.take(1)
        indices = [g.index for g in first.groups]
        # Whichever three finished first (the calls race), never prompt 0, in prompt order.
        assert 0 not in indices and indices == sorted(indices)
        assert [g.episodes for g in first.groups] == [[i] for i in indices]
        assert not release.is_set()  # taken while prompt 0 was still generating
        release.set()
        deadline = time.monotonic() + 10
        while 0 not in producer.waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.ensure(1)
        second = producer.take(2)
        indices = [g.index for g in second.groups]
        assert indices[0] == 0 and indices == sorted(indices)
        assert (2 - 1) - second.groups[0].version == 1  # prompt 0: generated at version 0
        assert second.dropped == 0
    finally:
        release.set()
        producer.stop()


def test_with_age_zero_a_step_is_its_own_prompts_in_order_after_the_refit():
    """Age 0: every call of step k starts on the weights of step k - 1, and step k trains on
    exactly prompts 3(k-1) .. 3k-1 in order, however the calls finish."""
    gate = WeightGate(lambda: None, lambda: 0.0, concurrent=True)
    stream = _Stream()
    calls: list[tuple[int, int | None]] = []

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[int]]:
        calls.append((step, gate.version))
        time.sleep(0.02 if offset == 0 else 0.0)  # the first call of a step is the long one
        return [[prompt] for prompt in drawn]

    producer = _group_producer(
        roll, gate, stream, max_age=0, groups_per_call=1, calls_in_flight=3, last_step=5
    )
    try:
        for step in range(1, 6):
            gate.ensure(step - 1)
            taken = producer.take(step)
            assert [g.index for g in taken.groups] == [3 * (step - 1) + i for i in range(3)]
            assert all(g.version == step - 1 for g in taken.groups)
    finally:
        producer.stop()
    assert all(version == step - 1 for step, version in calls)


def test_a_stuck_engine_is_one_named_error_not_a_hang():
    """A generate call that never returns: the trainer's wait for rollouts and a refit's wait
    for the call in flight both end after the bound with StuckEngineError."""
    gate = WeightGate(lambda: release.wait(30), lambda: 0.0, concurrent=True, wait_timeout_s=0.3)
    stream = _Stream()
    release = threading.Event()

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[int]]:
        gate.generate()
        return [[prompt] for prompt in drawn]

    producer = _group_producer(roll, gate, stream, max_age=1, groups_per_call=3, wait_timeout_s=0.3)
    try:
        gate.ensure(0)
        started = time.monotonic()
        with pytest.raises(StuckEngineError, match=r"waited for the rollouts of step 1 for 0\.3 s"):
            producer.take(1)
        with pytest.raises(StuckEngineError, match=r"a refit waited 0\.3 s"):
            gate.ensure(1)
        producer.stop()  # the trainer's way out: returns although the call never does
        assert time.monotonic() - started < 10
    finally:
        release.set()
        producer.stop()


def test_group_discard_rewinds_the_stream_to_the_oldest_waiting_call():
    gate = WeightGate(lambda: None, lambda: 0.0)
    stream = _Stream()
    producer = _group_producer(
        lambda step, offset, drawn: [[p] for p in drawn],
        gate,
        stream,
        max_age=3,
        max_buffer=1,
        groups_per_call=3,
        wait_timeout_s=10,
    )
    try:
        gate.ensure(0)
        assert [g.index for g in producer.take(1).groups] == [0, 1, 2]
        deadline = time.monotonic() + 10
        while producer.buffered < 3 and time.monotonic() < deadline:  # step 2's call
            time.sleep(0.01)
        with producer.paused():
            assert producer.discard(next_step=2) == 3
            assert stream.position == 3  # where the call of step 2 began
        gate.ensure(1)  # discard forgot the engines' version: nothing starts before a refit
        assert [g.episodes for g in producer.take(2).groups] == [[3], [4], [5]]
    finally:
        producer.stop()


def test_the_gate_tags_every_generated_token_with_the_version_that_made_it():
    """Versions per token: the gate's version at the call (a refit waits for the call, so it
    is the call's only version); an engine's own versions (an in-flight refit) are kept."""
    from nrl_core.interfaces import GenerationOutput

    def generate(prompts, params=None, stops=None):
        return GenerationOutput(
            [[7] * len(p) for p in prompts],
            [[0.0] * len(p) for p in prompts],
            ["stop"] * len(prompts),
        )

    gate = WeightGate(generate, lambda: 0.0)
    assert gate.generate([[1], [1, 2]]).weight_versions is None  # no refit yet: unknown
    gate.ensure(4)
    assert gate.generate([[1], [1, 2]]).weight_versions == [[4], [4, 4]]
    own = GenerationOutput([[7, 7]], [[0.0, 0.0]], ["stop"], weight_versions=[[4, 5]])
    assert WeightGate(lambda *a: own, lambda: 0.0).generate().weight_versions == [[4, 5]]
    parts = [gate.generate([[1]]), GenerationOutput([[7]], [[0.0]], ["stop"])]
    assert GenerationOutput.concat(parts).weight_versions is None  # not every part knows
    assert GenerationOutput.concat(parts[:1] * 2).weight_versions == [[4], [4]]


@pytest.mark.parametrize("in_flight", [False, True])
def test_an_in_flight_refit_does_not_wait_for_the_call(in_flight):
    """With ``in_flight`` a refit runs while a generate call is in flight and is handed the
    new version (the engines announce it to their tokens); new calls still wait for it.
    Without, the refit waits for the call: here, one that never returns, so it gives up after
    the bound with StuckEngineError."""
    release, started = threading.Event(), threading.Event()
    refits: list = []

    def generate(*args):
        started.set()
        release.wait(30)
        return None

    def refit(*version):
        refits.append(version)
        return 0.0

    gate = WeightGate(generate, refit, concurrent=True, wait_timeout_s=0.5)
    gate.in_flight = in_flight
    gate.ensure(0)
    call = threading.Thread(target=gate.generate)
    call.start()
    assert started.wait(10)
    try:
        if in_flight:
            assert gate.ensure(1) == 0.0
            assert refits == [(0,), (1,)] and gate.version == 1
        else:
            with pytest.raises(StuckEngineError, match="a refit waited"):
                gate.ensure(1)
            assert refits == [()] and gate.version == 0
    finally:
        release.set()
        call.join(10)
