"""Asynchronous GRPO (``grpo.async``) on separate torch engines, through the real CLI, and the
producer's age bound against a scripted trainer."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch

from nrl_core.algorithms.async_grpo import (
    GroupProducer,
    RolloutProducer,
    StuckEngineError,
    WeightGate,
)
from nrl_core.algorithms.grpo import GRPOTrainer
from nrl_core.algorithms.rollout import Episode, episodes_to_batch
from nrl_core.config.schema import AsyncSection, GRPOConfig, GRPOSection
from nrl_core.data import VERSION_GAPS
from nrl_core.distributed.errors import EngineReplacedError
from nrl_core.losses.clipped_pg import ClippedPGLoss
from nrl_core.losses.config import ClippedPGConfig
from tests.algorithms.test_grpo_cli import TINY, metrics, run_nrl
from tests.losses.helpers import global_stats, loss_and_grad

ONE_RANK = "policy.num_workers=1"
"""For the asynchronous runs: what they test is the producer, the engines and the weights'
versions, none of which depends on the policy's rank count, and their separate engines keep
the run on Ray all the same (one rank process fewer per run: ~6 CPU-s, docs/testing.md).
A refit from 2 sharded ranks to a separate engine is test_grpo_cli.py's LoRA run's."""
SEPARATE = [
    "generation.colocated=false",
    "generation.num_engines=1",
    "grpo.max_num_steps=4",
    ONE_RANK,
]


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
def test_groups_stream_one_call_each_across_two_engines_with_in_flight_refits(tmp_path):
    """Streaming at its finest grain through the real CLI: one prompt per generate call, two
    torch engines with a call in flight each, age bound 1, and refits that do not wait for the
    calls (``grpo.async.in_flight_weight_updates=true``; one run for both, CI time): every step
    trains a full batch within the bound, and every sample's tokens carry versions that never go
    back (a refit that lands mid-call only moves them forward), from its call's start version
    (within the bound) to at most the trainer's ``step - 1``."""
    run_nrl(
        tmp_path,
        "generation.colocated=false",
        "generation.num_engines=2",
        "grpo.max_num_steps=4",
        ONE_RANK,
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


def _engine_pids(tag: str, rank: int) -> list[int]:
    """Pids of this run's (``NRL_TEST_TAG=tag``) torch engine actor of ``rank``, by its process
    title (``ray::nrl-generation-torch-<rank>``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode().strip()
        except OSError:
            continue
        if f"NRL_TEST_TAG={tag}".encode() in environ and title.startswith(
            f"ray::nrl-generation-torch-{rank}"
        ):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_partial_rollouts_through_the_cli(tmp_path):
    """``grpo.async.max_tokens_per_call=4`` of 12 new tokens: samples longer than 4 tokens are
    continued in later calls; the run finishes, some trained samples were partial (metric and
    samples.jsonl), every one records its age and versions, and nothing was dropped."""
    run_nrl(
        tmp_path,
        *SEPARATE,
        "grpo.max_num_steps=2",
        "generation.max_new_tokens=12",
        "grpo.async.enabled=true",
        "grpo.async.max_tokens_per_call=4",
    )
    trained = [r for r in metrics(tmp_path) if "async/partial_fraction" in r]
    assert len(trained) == 2
    assert any(r["async/partial_fraction"] > 0 for r in trained)
    assert all(r["async/dropped_stale"] == 0 for r in trained)
    assert all(0 <= r["async/age_max"] <= 1 for r in trained)
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    train = [s for s in samples if s["split"] == "train"]
    assert train and any(s["partial"] for s in train)
    for sample in train:
        assert sample["age"] == (sample["step"] - 1) - min(v for v, _ in sample["weight_versions"])


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_the_run_loses_no_group(tmp_path):
    """Issue 51 item 6: ``grpo.async.replace_dead_engines=true`` on two separate torch
    engines; SIGKILL of engine 1's actor after the first trained step: one warning line
    names the engine, a new one takes its place (refitted), the failed calls are generated
    again, and the run exits 0 with every step's batch complete (16 samples each) and
    ``async/engines_replaced`` = 1."""
    tag = uuid.uuid4().hex
    steps = 6
    command = [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q",
        f"logger.log_dir={tmp_path}", "logger.run_name=run",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", *TINY,
        "generation.colocated=false", "generation.num_engines=2", ONE_RANK,
        f"grpo.max_num_steps={steps}", "grpo.val_period=0", "grpo.async.enabled=true",
        "grpo.async.groups_per_call=1", "grpo.async.replace_dead_engines=true",
        "logger.sample_period=1", "logger.num_samples=16",  # every trained sample
    ]  # fmt: skip
    env = {**os.environ, "NRL_ACTOR_ENV": "system", "NRL_TEST_TAG": tag}
    log = (tmp_path / "out.txt").open("w+")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    rows = tmp_path / "run" / "metrics.jsonl"
    killed = []
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            text = rows.read_text() if rows.is_file() else ""
            if '"async/trajectory_age_max"' in text:  # a step trained: the producer is busy
                killed = _engine_pids(tag, 1)
                break
            time.sleep(0.2)
        assert len(killed) == 1, (killed, log.read()[-3000:])
        os.kill(killed[0], signal.SIGKILL)
        assert proc.wait(timeout=600) == 0, log.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    out = log.read()
    trained = [r for r in metrics(tmp_path) if "async/trajectory_age_max" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1)), out[-3000:]
    assert trained[-1]["async/engines_replaced"] == 1, out[-3000:]
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: generation-torch")]
    assert len(warnings) == 1, out[-3000:]
    assert "rank 1 died in" in warnings[0] and f"(pid {killed[0]})" in warnings[0]
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    per_step = [
        sum(s["split"] == "train" and s["step"] == r["step"] for s in samples) for r in trained
    ]
    assert per_step == [16] * steps
    for k in range(1, steps + 1):  # whole groups of 4 samples each, none cut short
        counts: dict[str, int] = {}
        for sample in (s for s in samples if s["split"] == "train" and s["step"] == k):
            key = json.dumps(sample["prompt"])
            counts[key] = counts.get(key, 0) + 1
        assert all(n % 4 == 0 for n in counts.values()), (k, counts)
    print(f"requeued groups: {trained[-1]['async/requeued_groups']:g}")


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


def _rolling_prompt_0_after(release: threading.Event):
    """A producer's ``roll`` that returns each drawn prompt as its group, the call that drew
    prompt 0 only once ``release`` is set (at most 10 s)."""

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[int]]:
        if drawn == [0]:
            assert release.wait(10)
        return [[prompt] for prompt in drawn]

    return roll


def test_a_long_group_does_not_hold_back_groups_that_finished():
    """One group per call, three calls at once, age bound 1: prompt 0's call hangs, and
    step 1 trains on three later prompts meanwhile; prompt 0, done later, trains at step 2 (age 1)
    with the next prompts, in prompt order."""
    gate = WeightGate(lambda: None, lambda: 0.0, concurrent=True)
    stream = _Stream()
    release = threading.Event()
    roll = _rolling_prompt_0_after(release)

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


def test_a_call_that_failed_on_a_replaced_engine_is_generated_again_after_a_refit():
    """``grpo.async.replace_dead_engines``: prompt 1's call fails with
    :class:`EngineReplacedError` (its engine died and was replaced, the engines hold no weights
    now); no call starts until the trainer's ``take`` refitted them to its weights (step 0),
    then the same prompt is generated again: step 1 trains prompts 0, 1, 2, each once, and
    the producer counts one re-queued group."""
    holds = [True]
    refits: list[int] = []

    def refit() -> float:
        refits.append(len(calls))
        holds[0] = True
        return 0.0

    gate = WeightGate(lambda: None, refit, holds_weights=lambda: holds[0])
    calls: list[tuple[list[int], bool]] = []

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[int]]:
        calls.append((list(drawn), holds[0]))
        if drawn == [1] and sum(d == [1] for d, _ in calls) == 1:
            holds[0] = False  # what GenerationEngines does when it replaces an engine
            raise EngineReplacedError("generation-torch rank 1 died; replaced")
        return [[prompt] for prompt in drawn]

    stream = _Stream()
    producer = _group_producer(roll, gate, stream, max_age=0, groups_per_call=1, wait_timeout_s=10)
    try:
        gate.ensure(0)
        taken = producer.take(1)
        assert [g.episodes for g in taken.groups] == [[0], [1], [2]]
        assert [g.index for g in taken.groups] == [0, 1, 2]
        assert producer.requeued == 1
        assert refits == [0, 2]  # the first refit, then take's after the failed call
        assert all(held for _, held in calls)  # no call ran on engines without weights
        assert [d for d, _ in calls] == [[0], [1], [1], [2]]
    finally:
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


@pytest.mark.parametrize("drop_stale", [False, True])
def test_a_group_that_ends_over_age_is_trained_unless_dropping_is_asked(drop_stale):
    """Age bound 1: prompt 0's call (version 0) hangs through steps 1 and 2 and ends when step
    3 trains on version 2 (age 2). By default (``over_age`` mask / train) it is handed to the
    trainer, nothing dropped; with ``drop_stale`` (``over_age=drop``) it is dropped, counted,
    and its slot drawn again."""
    gate = WeightGate(lambda: None, lambda: 0.0, concurrent=True)
    stream = _Stream()
    release = threading.Event()
    roll = _rolling_prompt_0_after(release)

    producer = _group_producer(
        roll,
        gate,
        stream,
        max_age=1,
        groups_per_call=1,
        calls_in_flight=3,
        wait_timeout_s=10,
        drop_stale=drop_stale,
    )
    try:
        for step in (1, 2):
            gate.ensure(step - 1)
            assert 0 not in [g.index for g in producer.take(step).groups]
        release.set()
        deadline = time.monotonic() + 10
        while 0 not in producer.waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.ensure(2)
        third = producer.take(3)
        indices = [g.index for g in third.groups]
        if drop_stale:
            assert third.dropped >= 1 and 0 not in indices  # prompt 0 (and any other of v0)
        else:
            assert third.dropped == 0 and indices[0] == 0
            assert (3 - 1) - third.groups[0].version == 2  # over the bound, trained all the same
    finally:
        release.set()
        producer.stop()


def test_a_partial_group_is_continued_and_handed_over_only_when_finished():
    """Partial rollouts: prompt 0 needs three calls. Its group waits off the buffer while
    step 1 trains on later prompts; the next calls continue it (the weights changed between
    them) before anything new is drawn, and step 2 gets it, finished, with its calls counted
    and its first call's version."""
    gate = WeightGate(lambda: None, lambda: 0.0, concurrent=True)
    stream = _Stream()
    proceed = threading.Event()

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[dict]]:
        return [
            [{"prompt": p, "left": 2 if p == 0 else 0, "versions": [gate.version]}] for p in drawn
        ]

    def resume(step: int, calls: int, groups: list[list[dict]]) -> None:
        assert proceed.wait(10)
        for group in groups:
            for sample in group:
                assert sample["left"] > 0  # only unfinished groups are continued
                sample["left"] -= 1
                sample["versions"].append(gate.version)

    producer = _group_producer(
        roll,
        gate,
        stream,
        max_age=1,
        groups_per_call=3,
        calls_in_flight=2,
        last_step=2,  # nothing drawn for step 3: step 2 must wait for prompt 0
        wait_timeout_s=10,
        resume=resume,
        finished=lambda episodes: all(e["left"] == 0 for e in episodes),
    )
    try:
        gate.ensure(0)
        first = producer.take(1)
        assert [g.index for g in first.groups] == [1, 2, 3]  # prompt 0 is not finished
        assert all(g.calls == 1 for g in first.groups)
        gate.ensure(1)  # new weights while prompt 0 waits to be continued
        proceed.set()
        second = producer.take(2)
        assert [g.index for g in second.groups] == [0, 4, 5]
        zero = second.groups[0]
        assert zero.calls == 3 and zero.version == 0 and zero.episodes[0]["left"] == 0
        assert zero.episodes[0]["versions"][0] == 0 and zero.episodes[0]["versions"][-1] == 1
    finally:
        proceed.set()
        producer.stop()


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


def test_discard_drops_unfinished_groups_too_and_rewinds_to_their_call():
    """A checkpoint while prompt 0 is still being continued (partial) and prompts 1 and 2 wait
    finished: the discard drops all three and rewinds the stream to their call, so the
    resumed production draws prompts 0, 1, 2 again."""
    gate = WeightGate(lambda: None, lambda: 0.0)
    stream = _Stream()
    proceed = threading.Event()

    def roll(step: int, offset: int, drawn: list[int]) -> list[list[dict]]:
        return [[{"prompt": p, "left": 1 if p == 0 else 0}] for p in drawn]

    def resume(step: int, calls: int, groups: list[list[dict]]) -> None:
        time.sleep(0.01)
        if proceed.is_set():
            for group in groups:
                for sample in group:
                    sample["left"] = 0

    producer = _group_producer(
        roll,
        gate,
        stream,
        max_age=3,
        max_buffer=1,
        groups_per_call=3,
        wait_timeout_s=10,
        resume=resume,
        finished=lambda episodes: all(e["left"] == 0 for e in episodes),
    )
    try:
        gate.ensure(0)
        deadline = time.monotonic() + 10
        while producer.waiting() != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert producer.waiting() == [1, 2]  # prompt 0 keeps being continued meanwhile
        with producer.paused():
            assert producer.discard(next_step=1) == 3
            assert stream.position == 0
        proceed.set()
        gate.ensure(0)
        taken = producer.take(1)
        assert [g.episodes[0]["prompt"] for g in taken.groups] == [0, 1, 2]
        assert taken.groups[0].calls == 2  # drawn again, then continued once
    finally:
        proceed.set()
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


def _episode(group: int, versions: list[int], *, partial: bool = False) -> Episode:
    """Two prompt tokens, then four generated ones (generation logprob -1 each)."""
    return Episode(
        group=group,
        task="default",
        messages=[],
        metadata={},
        token_ids=[1, 2, 3, 4, 5, 6],
        prompt_length=2,
        loss_mask=[0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        gen_logprobs=[0.0, 0.0, -1.0, -1.0, -1.0, -1.0],
        weight_versions=versions,
        partial=partial,
    )


@pytest.mark.parametrize("over_age", ["mask", "train"])
def test_over_age_tokens_are_masked_or_trained_through_the_importance_weight(over_age):
    """Step 3 trains on version 2 with age bound 1: a partial sample whose first two tokens
    came from version 0 is trained, not dropped. ``mask``: those two tokens are out of the
    loss (no gradient), its other tokens in; ``train``: every token is in, its gradient scaled
    by the token's IS weight exp(old - gen), as the loss does for every token."""
    async_ = AsyncSection(enabled=True, max_trajectory_age_steps=1, over_age=over_age)
    config = attrs.evolve(GRPOConfig(), grpo=GRPOSection(async_=async_))
    trainer = GRPOTrainer(SimpleNamespace(config=config, gate=None))
    late, young = _episode(0, [0, 0, 1, 2], partial=True), _episode(1, [2, 2, 2, 2])

    found = trainer.mark_staleness(3, [late, young], [0, 2])

    assert (late.age, young.age) == (2, 0)
    assert found["async/age_max"] == 2 and found["async/age_mean"] == 1
    assert found["async/partial_fraction"] == 0.5
    assert found["async/dropped_stale_tokens"] == (2 if over_age == "mask" else 0)
    assert late.response_length == 4  # the episode's own mask (its metrics) is unchanged
    batch = episodes_to_batch([late, young], torch.tensor([1.0, 1.0]), 0)
    trained = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0] if over_age == "mask" else late.loss_mask
    assert batch["loss_mask"][0].tolist() == trained
    assert batch["loss_mask"][1].tolist() == young.loss_mask

    loss_fn = ClippedPGLoss(ClippedPGConfig(is_correction="token_truncate", is_truncate_c=10.0))
    logprobs = torch.full((2, 6), -0.5, requires_grad=True)
    batch["prev_logprobs"] = logprobs.detach().clone()  # the trainer's: ratio 1
    loss, _ = loss_fn(logprobs, batch, global_stats(batch))
    loss.backward()
    tokens = float(batch["loss_mask"].sum())
    weight = math.exp(-0.5 - -1.0)  # exp(old - gen)
    expected = [0.0, 0.0] + [-weight / tokens * m for m in trained[2:]]
    assert torch.allclose(logprobs.grad[0], torch.tensor(expected), atol=1e-6)


def test_mismatch_is_reported_per_version_gap_and_each_sample_keeps_its_is_weights():
    """Step 3 (trainer version 2): the loss, over two micro batches, gives the additive shares
    per version gap, and ``async/gen_logprob_error_gap<k>`` is the mean of exp(|old - gen|)
    over the trained tokens k versions old; masked tokens and tokens of unknown version are
    left out. Each sample's IS weights exp(old - gen) are summarised."""
    config = attrs.evolve(GRPOConfig(), grpo=GRPOSection(async_=AsyncSection(enabled=True)))
    trainer = GRPOTrainer(SimpleNamespace(config=config, gate=None))
    late, young = _episode(0, [0, 1, 1, 2]), _episode(1, [])  # young: versions unknown
    late.loss_excluded = [2]  # the version-0 token, masked
    batch = episodes_to_batch([late, young], torch.tensor([1.0, 1.0]), 0)
    batch[VERSION_GAPS] = trainer.version_gaps(3, [late, young], 6)
    assert batch[VERSION_GAPS].tolist() == [[-1, -1, 2, 1, 1, 0], [-1] * 6]
    old = torch.tensor([[0.0, 0.0, -3.0, -0.5, -1.5, -1.0], [0.0, 0.0, -2.0, -2.0, -2.0, -2.0]])
    batch["prev_logprobs"] = old

    loss_fn = ClippedPGLoss(ClippedPGConfig(is_correction="token_truncate"))
    parts = [batch.slice(0, 1), batch.slice(1, 2)]
    _, _, train = loss_and_grad(loss_fn, old, parts, global_stats(batch))
    found = GRPOTrainer.mismatch_by_version_gap(train)

    # gen is -1 everywhere: |old - gen| is 0.5, 0.5 at gap 1 and 0 at gap 0.
    assert found == pytest.approx(
        {"async/gen_logprob_error_gap1": math.exp(0.5), "async/gen_logprob_error_gap0": 1.0}
    )
    assert not any("_gap" in key for key in train)  # the shares are taken out
    GRPOTrainer.summarise_is_weights(batch, SimpleNamespace(episodes=[late, young]), old)
    assert late.is_weight == pytest.approx(
        {
            "mean": (math.exp(0.5) + math.exp(-0.5) + 1) / 3,
            "min": math.exp(-0.5),
            "max": math.exp(0.5),
        }
    )
    one = math.exp(-1)
    assert young.is_weight == pytest.approx({"mean": one, "min": one, "max": one})


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
