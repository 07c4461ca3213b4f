"""Asynchronous GRPO: separate engines generate the next steps' rollouts while the trainer
trains (``grpo.async``).

Three pieces, all in the driver:

* :class:`WeightGate` stands between the generation backend and everyone who calls it. It
  keeps refits apart from ``generate`` calls (and, unless ``concurrent``, the calls apart from
  one another), and knows which weights the engines hold (the *version*: the number of
  optimizer steps in them). A refit waits for the calls in flight, which therefore finish on
  the old weights; so the version read when a call starts is the version of every token it
  generates (the gate records it per token: ``GenerationOutput.weight_versions``). With
  in-flight refits (``grpo.async.in_flight_weight_updates``) it does not wait: the engines
  land the weights between decode steps and record each token's version themselves.
* :class:`GroupProducer` (the default) streams finished *groups* to the trainer, which
  trains a step as soon as it holds ``num_prompts_per_step`` of them (see its docstring).
* :class:`RolloutProducer` (with DAPO dynamic sampling) is a background thread that runs the trainer's own ``collect`` for
  step after step. It starts the batch of step ``k`` only when the engines hold weights of
  step ``k - 1 - max_trajectory_age_steps`` or newer and fewer than ``max_buffer_size``
  batches wait; finished batches wait in a buffer keyed by step. With
  ``max_trajectory_age_steps=0`` it can start batch ``k`` only after the refit that ends step
  ``k - 1``, which is exactly the synchronous loop.

The trainer takes batch ``k`` at step ``k``; a batch or group older than the bound there (a
long-tailed group, a partial rollout continued later; for whole batches it cannot happen by
construction) is trained with its old tokens masked or IS-weighted (``grpo.async.over_age``),
or, with ``over_age=drop``, dropped, counted in ``async/dropped_stale``, and generated again.

Checkpoints: the buffer is **discarded**, not saved. The checkpoint records the data stream
where the oldest discarded batch began, so a resumed run draws the same prompts again and
generates them with the resumed weights; the producer restarts after the save in the running
job too. The synchronous case (age 0) never has a batch waiting at a checkpoint, so its
resume stays exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from nrl_core.distributed.errors import EngineReplacedError
from nrl_core.errors import NrlError

STOP_JOIN_S = 5.0
"""How long stopping a producer waits for its threads: the run's error line (a stuck engine)
must not wait for a call that will never return."""


class WeightGate:
    """``generate`` and ``refit`` of a generation backend, kept apart, with the version of the
    weights the engines hold (``None`` until the first refit) and the seconds spent
    generating (for the engines' idle fraction).

    ``holds_weights`` says whether the engines still hold their last refit's weights
    (:attr:`nrl_core.generation.GenerationEngines.holds_weights`: False once colocated engines
    slept with their weights dropped); when it is False, :meth:`ensure` refits even for the
    version it recorded. Default: always (generation inside the policy workers).

    ``concurrent``: generate calls may overlap one another (a refit still excludes them all);
    only for backends that are safe to call from several threads (separate engines, which
    serialise what they must themselves). ``wait_timeout_s``: the longest a refit waits for
    the calls in flight (> 0; None: no bound) before it raises :class:`StuckEngineError`.

    ``in_flight`` (``grpo.async.in_flight_weight_updates``): a refit does not wait for the
    calls in flight (new calls still wait for it); ``refit`` is then called with the new
    version, which the engines record per token from the decode step where it lands (their
    ``GenerationOutput.weight_versions``, which the gate keeps)."""

    def __init__(
        self,
        generate: Callable[..., Any],
        refit: Callable[[], float],
        holds_weights: Callable[[], bool] = lambda: True,
        *,
        concurrent: bool = False,
        wait_timeout_s: float | None = None,
    ) -> None:
        self._generate = generate
        self._refit = refit
        self._holds_weights = holds_weights
        self.concurrent = concurrent
        self.wait_timeout_s = wait_timeout_s
        self.in_flight = False
        self._cv = threading.Condition()
        self._in_flight = 0
        self._refitting = False
        self.version: int | None = None
        self.busy_s = 0.0
        self.on_change: Callable[[], None] = lambda: None

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait on the gate's condition (held) for ``predicate``, at most ``wait_timeout_s``."""
        if not self._cv.wait_for(predicate, timeout=self.wait_timeout_s):
            raise StuckEngineError(
                f"{what} waited {self.wait_timeout_s:g} s for the generation engines ("
                f"{self._in_flight} generate calls in flight, refit running: {self._refitting}) "
                "and they did not return: a generation engine is stuck (raise "
                "grpo.async.wait_timeout_s if its calls are this slow)"
            )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._cv:
            if self.concurrent:
                self._wait(lambda: not self._refitting, "generate")
            else:
                self._wait(lambda: not self._refitting and self._in_flight == 0, "generate")
            self._in_flight += 1
            version = self.version  # no refit until this call returns: its only version
        started = time.perf_counter()
        try:
            return _tag_versions(self._generate(*args, **kwargs), version)
        finally:
            with self._cv:
                self._in_flight -= 1
                self.busy_s += time.perf_counter() - started
                self._cv.notify_all()

    def ensure(self, version: int) -> float:
        """Refit the engines to the policy's current weights, which hold ``version`` optimizer
        steps, unless they already do; returns the refit's seconds (0 when none ran). The
        refit waits for the generate calls in flight, which finish on the old weights."""
        if self.version == version and self._holds_weights():
            return 0.0
        with self._cv:
            self._wait(lambda: not self._refitting, "a refit")
            self._refitting = True
            try:
                if not self.in_flight:
                    self._wait(lambda: self._in_flight == 0, "a refit")
            except BaseException:
                self._refitting = False
                self._cv.notify_all()
                raise
        try:
            seconds = self._refit(version) if self.in_flight else self._refit()
            self.version = version
        finally:
            with self._cv:
                self._refitting = False
                self._cv.notify_all()
        self.on_change()
        return seconds

    def ready(self) -> bool:
        """Whether the engines hold weights to generate with (False after a sleep that dropped
        them, or once a dead engine was replaced, until the next :meth:`ensure`)."""
        return self._holds_weights()

    def invalidate(self) -> None:
        """Forget the version: the next :meth:`ensure` refits whatever the engines hold."""
        self.version = None


def _tag_versions(output: Any, version: int | None) -> Any:
    """``output`` with :attr:`~nrl_core.interfaces.GenerationOutput.weight_versions` set to
    ``version`` for every token, unless the engine recorded them (or no version is known)."""
    if version is None or getattr(output, "weight_versions", False) is not None:
        return output
    versions = [[version] * len(ids) for ids in output.token_ids]
    return attrs.evolve(output, weight_versions=versions)


class StuckEngineError(NrlError):
    """A bounded wait of the asynchronous loop ran out (``grpo.async.wait_timeout_s``)."""


@attrs.define
class Produced:
    """One step's rollouts from the producer."""

    step: int
    data: Any
    """The trainer's ``StepData``, or None when dynamic sampling found no signal."""
    version: int
    """The weights' version when the batch started (the oldest any of its calls used)."""
    stream_state: dict
    """The data stream's state before the batch drew its prompts."""
    seconds: float
    """How long generating the batch took."""


class _Producer:
    """What both producers share: the lock, the threads, pausing, stopping and bounded waits.
    A subclass sets ``_cv``, ``_threads``, ``_paused``, ``_stopped``, ``_error`` and
    ``wait_timeout_s`` and says what is in flight (:meth:`_in_flight_count`)."""

    _cv: threading.Condition
    _threads: list[threading.Thread]
    _paused: bool
    _stopped: bool
    _error: BaseException | None
    wait_timeout_s: float | None

    def _in_flight_count(self) -> int:
        """Batches or groups being generated now (lock held)."""
        raise NotImplementedError

    _gate: WeightGate
    requeued = 0
    """Groups (batches, for :class:`RolloutProducer`) whose generate call failed because an
    engine died and was replaced (``grpo.async.replace_dead_engines``), generated again."""

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _refit_replaced(self, step: int) -> None:
        """The trainer's side (lock held once): when a replaced engine left the engines
        without weights, refit them to the trainer's (step ``step - 1``: between the step's
        refit and its training) so the failed calls can run again; the lock is let go
        meanwhile (the refit waits for the calls in flight, which take it to finish)."""
        if self._gate.ready():
            return
        self._cv.release()
        try:
            self._gate.ensure(step - 1)
        finally:
            self._cv.acquire()

    def _bounded_wait(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait (lock held) for ``predicate`` or a producer failure, at most the timeout."""
        _bounded_wait(self, predicate, what, self._threads, self._in_flight_count)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Let the generation in flight finish, start nothing new meanwhile."""
        with self._cv:
            self._paused = True
            try:
                self._bounded_wait(
                    lambda: self._in_flight_count() == 0,
                    "paused the producer (validation, checkpoint)",
                )
            except BaseException:
                self._paused = False
                raise
        try:
            yield
        finally:
            with self._cv:
                self._paused = False
                self._cv.notify_all()

    def stop(self) -> None:
        """Start nothing more; wait a few seconds for the threads (idle ones end at once; one
        stuck in a generate call is a daemon and ends with the process)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        deadline = time.monotonic() + STOP_JOIN_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class RolloutProducer(_Producer):
    """The background rollout thread (see the module docstring).

    Args:
        collect: the trainer's ``collect(step)``; may raise ``no_signal``.
        no_signal: the exception type meaning "no group with reward variance".
        gate: the :class:`WeightGate` all generation goes through.
        stream: the training data stream (``state()`` / ``load_state()``).
        first_step, last_step: the steps to produce.
        max_age: ``grpo.async.max_trajectory_age_steps``.
        max_buffer: ``grpo.async.max_buffer_size``.
        wait_timeout_s: the longest :meth:`take` and :meth:`paused` wait (None: no bound).
    """

    def __init__(
        self,
        collect: Callable[[int], Any],
        no_signal: type[BaseException],
        gate: WeightGate,
        stream: Any,
        *,
        first_step: int,
        last_step: int,
        max_age: int,
        max_buffer: int,
        wait_timeout_s: float | None = None,
    ) -> None:
        self._collect = collect
        self.wait_timeout_s = wait_timeout_s
        self._no_signal = no_signal
        self._gate = gate
        self._stream = stream
        self._last_step = last_step
        self.max_age = max_age
        self._max_buffer = max_buffer
        self._cv = threading.Condition()
        self._ready: dict[int, Produced] = {}
        self._next = first_step
        self._redo: list[int] = []
        self._busy = False
        self._paused = False
        self._stopped = False
        self._error: BaseException | None = None
        gate.on_change = self._wake
        self._threads = [threading.Thread(target=self._run, name="nrl-rollouts", daemon=True)]
        self._threads[0].start()

    # -- the producer thread --------------------------------------------------------------------

    def _in_flight_count(self) -> int:
        return int(self._busy)

    def _startable(self) -> int | None:
        """The step to produce next, if the age bound and the buffer allow it now."""
        if self._stopped or self._paused:
            return None
        step = self._redo[0] if self._redo else self._next
        version = self._gate.version
        if step > self._last_step or version is None or len(self._ready) >= self._max_buffer:
            return None
        if not self._gate.ready():  # a replaced engine waits for its refit
            return None
        return step if version >= step - 1 - self.max_age else None

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stopped or self._startable() is not None)
                    if self._stopped:
                        return
                    step = self._startable()
                    assert step is not None
                    redone = bool(self._redo) and self._redo[0] == step
                    if redone:
                        self._redo.pop(0)
                    else:
                        self._next += 1
                    version = self._gate.version
                    state = self._stream.state()
                    self._busy = True
                started = time.perf_counter()
                try:
                    data = self._collect(step)
                except self._no_signal:
                    data = None
                except EngineReplacedError:
                    # An engine died mid-batch and was replaced: the same prompts again,
                    # once the trainer refitted it (see _refit_replaced).
                    with self._cv:
                        self._stream.load_state(state)
                        if redone:
                            self._redo.insert(0, step)
                        else:
                            self._next -= 1
                        self.requeued += 1
                        self._busy = False
                        self._cv.notify_all()
                    continue
                produced = Produced(step, data, version, state, time.perf_counter() - started)
                with self._cv:
                    self._busy = False
                    self._ready[step] = produced
                    self._cv.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self._cv:
                self._error = exc
                self._busy = False
                self._cv.notify_all()

    # -- the trainer's side -------------------------------------------------------------------

    def take(self, step: int) -> Produced:
        """Wait for the batch of ``step``; a failure of the producer is raised here."""
        with self._cv:
            while step not in self._ready:
                self._refit_replaced(step)
                self._bounded_wait(
                    lambda: step in self._ready or not self._gate.ready(),
                    f"waited for the batch of step {step}",
                )
            produced = self._ready.pop(step)
            self._cv.notify_all()  # room in the buffer
            return produced

    def regenerate(self, step: int) -> None:
        """Produce ``step`` again, before anything else (its batch was too old)."""
        with self._cv:
            self._redo.append(step)
            self._cv.notify_all()

    @property
    def buffered(self) -> int:
        """Finished batches waiting for the trainer."""
        with self._cv:
            return len(self._ready)

    def discard(self, next_step: int) -> int:
        """Drop every finished batch (call while :meth:`paused`) and rewind the data stream to
        where the oldest of them began, so that production restarts at ``next_step`` with the
        same prompts. Returns how many batches were dropped."""
        with self._cv:
            dropped = sorted(self._ready.values(), key=lambda p: p.step)
            if dropped:
                self._stream.load_state(dropped[0].stream_state)
            self._ready.clear()
            self._redo.clear()
            self._next = next_step
            # As in a run resumed here: nothing is generated before the next refit.
            self._gate.invalidate()
            return len(dropped)


@attrs.define
class Group:
    """One prompt's finished group from the :class:`GroupProducer`."""

    index: int
    """The prompt's place in the order the producer drew prompts (since it last started)."""
    episodes: Any
    """The group's rolled-out episodes (whatever ``roll`` returned for it)."""
    version: int
    """The weights' version when the first call that generated it started (the oldest)."""
    seconds: float
    """How long its calls took (all of them, for a partial rollout)."""
    step: int = 0
    """The step its prompt was drawn for."""
    calls: int = 1
    """How many generate calls it took (> 1: a partial rollout, continued in later calls)."""


@attrs.define
class TakenGroups:
    """One step's groups from :meth:`GroupProducer.take`, ordered by prompt index."""

    groups: list[Group]
    dropped: int
    """Groups found older than the age bound and dropped on the way (counted, regenerated;
    only with ``drop_stale``)."""


class GroupProducer(_Producer):
    """Sample-level streaming (``grpo.async``): background threads generate *groups* and hand
    each finished one to the trainer, which trains a step as soon as it has
    ``groups_per_step`` of them, whichever calls they came from; a call of long samples holds
    back no group of a call that finished before it.

    Prompts are drawn in order, ``groups_per_call`` at a time (a call never spans two steps):
    the prompt of slot ``j`` (its place among the groups still to train) is meant for step
    ``first_step + j // groups_per_step``, and its call starts only once the engines hold
    weights of that step ``- 1 - max_age`` or newer (admission, as :class:`RolloutProducer`
    does for batches) and fewer than ``max_buffer * groups_per_step`` groups are waiting or
    in flight. The trainer takes the oldest finished groups first; a group that finished so
    late that it is older than the bound is handed over all the same (the trainer masks or
    IS-weights its old tokens: ``grpo.async.over_age``), or, with ``drop_stale``, dropped
    (counted in :attr:`TakenGroups.dropped`) and its slot drawn again.

    Partial rollouts (``resume`` given): a group whose samples are not all ``finished`` after
    a call waits, off the buffer, for a later call that continues it (``resume``, before any
    new prompt is drawn; admission does not apply, it was admitted when drawn) and is handed
    to the trainer only once every sample finished. With ``max_age=0`` every call of
    step ``k`` starts after the refit that ends step ``k - 1`` and the step is exactly its own
    prompts in prompt order; with ``groups_per_call = groups_per_step`` that is one call per
    step, the synchronous loop's.

    Args:
        draw: ``draw(count)`` takes the next ``count`` prompts from the data stream (called
            in prompt order, under the producer's lock).
        roll: ``roll(step, offset, drawn)`` generates one call's groups (one per drawn
            prompt, in order) for ``step``; ``offset`` is the first one's place in its step
            (for the call's seed).
        gate, stream: as for :class:`RolloutProducer`.
        groups_per_step: ``grpo.num_prompts_per_step``.
        groups_per_call: prompts per generate call (1 to ``groups_per_step``).
        calls_in_flight: generate calls the producer keeps running at once (>= 1; they
            overlap only when the gate is ``concurrent``).
        wait_timeout_s: the longest :meth:`take` and :meth:`paused` wait (None: no bound).
        drop_stale: drop groups older than the bound in :meth:`take` (``over_age=drop``).
        resume: ``resume(step, calls, groups)`` continues unfinished groups (their episodes,
            in place) in one generate call; ``step`` is the first group's, ``calls`` the
            calls it took so far (for the call's seed). None: no partial rollouts.
        finished: ``finished(episodes)`` says whether a group's samples are all done
            (default: always).
    """

    def __init__(
        self,
        draw: Callable[[int], Any],
        roll: Callable[[int, int, Any], list],
        gate: WeightGate,
        stream: Any,
        *,
        first_step: int,
        last_step: int,
        max_age: int,
        max_buffer: int,
        groups_per_step: int,
        groups_per_call: int,
        calls_in_flight: int = 1,
        wait_timeout_s: float | None = None,
        drop_stale: bool = True,
        resume: Callable[[int, int, list], Any] | None = None,
        finished: Callable[[Any], bool] = lambda episodes: True,
    ) -> None:
        if not 1 <= groups_per_call <= groups_per_step:
            raise ValueError(f"groups_per_call {groups_per_call} not in 1..{groups_per_step}")
        self._draw = draw
        self._roll = roll
        self._gate = gate
        self._stream = stream
        self._last_step = last_step
        self.max_age = max_age
        self._per_step = groups_per_step
        self._per_call = groups_per_call
        self._max_groups = max_buffer * groups_per_step
        self.wait_timeout_s = wait_timeout_s
        self.drop_stale = drop_stale
        self._resume = resume
        self._finished = finished
        self._cv = threading.Condition()
        self._ready: list[Group] = []
        self._pending: list[Group] = []  # unfinished groups waiting to be continued
        self._resuming: list[Group] = []  # unfinished groups being continued now
        # Calls that failed on a replaced engine, (step, offset, drawn, first index), to run
        # again (same prompts) once the engines are refitted.
        self._retry: list[tuple[int, int, Any, int]] = []
        self._states: dict[int, dict] = {}  # first index of a call in the buffer -> stream state
        self._first_step = first_step
        self._slot = 0  # the next prompt's slot among the groups still to train
        self._index = 0  # the next prompt's index
        self._in_flight = 0  # groups being generated
        self._paused = False
        self._stopped = False
        self._error: BaseException | None = None
        gate.on_change = self._wake
        self._threads = [
            threading.Thread(target=self._run, name=f"nrl-groups-{i}", daemon=True)
            for i in range(calls_in_flight)
        ]
        for thread in self._threads:
            thread.start()

    def _in_flight_count(self) -> int:
        return self._in_flight

    def _startable(self) -> tuple[int, int, int] | None:
        """``(step, offset, count)`` of the next call, if admission and the buffer allow it."""
        if self._stopped or self._paused or self._error is not None:
            return None
        step = self._first_step + self._slot // self._per_step
        offset = self._slot % self._per_step
        count = min(self._per_call, self._per_step - offset)
        version = self._gate.version
        if step > self._last_step or version is None or not self._gate.ready():
            return None
        # Groups being continued count once, in flight.
        waiting = len(self._ready) + len(self._pending) + self._in_flight + self._retrying()
        if waiting + count > self._max_groups:
            return None
        return (step, offset, count) if version >= step - 1 - self.max_age else None

    def _resumable(self) -> bool:
        """Whether an unfinished group waits to be continued and may be now (lock held)."""
        return bool(self._pending) and self._may_call()

    def _may_call(self) -> bool:
        """Whether a call may start now, admission aside (lock held)."""
        if self._stopped or self._paused or self._error is not None:
            return False
        return self._gate.ready()

    def _retrying(self) -> int:
        """Groups of failed calls waiting to run again (lock held)."""
        return sum(len(drawn) for _, _, drawn, _ in self._retry)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(
                        lambda: (
                            self._stopped
                            or (bool(self._retry) and self._may_call())
                            or self._resumable()
                            or self._startable() is not None
                        )
                    )
                    if self._stopped:
                        return
                    if self._retry and self._may_call():  # the oldest prompts first
                        resumed = []
                        step, offset, drawn, first = self._retry.pop(0)
                        count = len(drawn)
                        version = self._gate.version
                        assert version is not None
                        state = self._states[first]
                        self._in_flight += count
                    elif self._resumable():  # unfinished groups first: they hold their steps
                        resumed = self._pending[: self._per_call]
                        del self._pending[: len(resumed)]
                        self._resuming.extend(resumed)
                        self._in_flight += len(resumed)
                    else:
                        resumed = []
                        start = self._startable()
                        assert start is not None
                        step, offset, count = start
                        first, version = self._index, self._gate.version
                        assert version is not None
                        state = self._stream.state()
                        drawn = self._draw(count)
                        self._slot += count
                        self._index += count
                        self._in_flight += count
                if resumed:
                    self._continue(resumed)
                    continue
                started = time.perf_counter()
                try:
                    rolled = self._roll(step, offset, drawn)
                except EngineReplacedError:
                    # An engine died in this call and was replaced: the same prompts again
                    # once the trainer refitted it (take: _refit_replaced).
                    with self._cv:
                        self._in_flight -= count
                        self._states[first] = state
                        self._retry.append((step, offset, drawn, first))
                        self.requeued += count
                        self._cv.notify_all()
                    continue
                except BaseException:
                    with self._cv:
                        self._in_flight -= count
                        self._cv.notify_all()
                    raise
                seconds = time.perf_counter() - started
                # Out of flight and into the buffer at once: a pause that sees nothing in
                # flight must see these groups (a discard drops them).
                with self._cv:
                    self._in_flight -= count
                    self._states[first] = state
                    self._place(
                        Group(first + i, episodes, version, seconds, step)
                        for i, episodes in enumerate(rolled)
                    )
                    self._cv.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _place(self, groups: Iterator[Group] | list[Group]) -> None:
        """Finished groups to the buffer, unfinished ones to wait for a later call (lock
        held)."""
        for group in groups:
            if self._resume is not None and not self._finished(group.episodes):
                self._pending.append(group)
            else:
                self._ready.append(group)

    def _continue(self, groups: list[Group]) -> None:
        """One call continuing the unfinished ``groups`` (taken off ``_pending``)."""
        assert self._resume is not None
        started = time.perf_counter()
        try:
            self._resume(groups[0].step, groups[0].calls, [g.episodes for g in groups])
        except EngineReplacedError:
            # Continued again (from what they hold) after the refit: back to _pending below.
            with self._cv:
                self.requeued += len(groups)
        finally:
            seconds = time.perf_counter() - started
            # Out of flight and back among the waiting groups at once (see _run).
            with self._cv:
                self._in_flight -= len(groups)
                gone = {id(g) for g in groups}
                self._resuming = [g for g in self._resuming if id(g) not in gone]
                for group in groups:
                    group.calls += 1
                    group.seconds += seconds
                self._place(groups)
                self._cv.notify_all()

    def _oldest_state(self) -> int | None:
        """The first index of the call of the oldest group not yet trained (lock held)."""
        waiting = [g.index for g in (*self._ready, *self._pending, *self._resuming)]
        waiting += [first for *_, first in self._retry]
        if not waiting:
            return None
        oldest = min(waiting)
        return max(i for i in self._states if i <= oldest)

    def take(self, step: int) -> TakenGroups:
        """Wait for ``groups_per_step`` finished groups for ``step`` (the weights of
        ``step - 1`` train them), the oldest prompts first; with ``drop_stale``, drop the
        ones older than the bound on the way."""
        dropped = 0
        with self._cv:
            while True:
                self._ready.sort(key=lambda g: g.index)
                stale = [
                    g
                    for g in self._ready
                    if self.drop_stale and (step - 1) - g.version > self.max_age
                ]
                if stale:
                    dropped += len(stale)
                    gone = {id(g) for g in stale}
                    self._ready = [g for g in self._ready if id(g) not in gone]
                    self._slot -= len(stale)  # their slots are drawn again
                    self._cv.notify_all()
                if len(self._ready) >= self._per_step:
                    break
                self._refit_replaced(step)
                self._bounded_wait(
                    lambda: (
                        len(self._ready) >= self._per_step
                        or self._error is not None
                        or not self._gate.ready()
                    ),
                    f"waited for the rollouts of step {step}",
                )
                if self._error is not None:
                    raise self._error
            taken = self._ready[: self._per_step]
            del self._ready[: self._per_step]
            # Keep the stream state of the call of the oldest group still waiting (discard);
            # calls in flight add theirs when they finish.
            keep = self._oldest_state()
            if keep is not None:
                self._states = {i: st for i, st in self._states.items() if i >= keep}
            else:
                self._states.clear()
            self._slot -= self._per_step
            self._first_step = step + 1
            self._cv.notify_all()  # room in the buffer
            return TakenGroups(taken, dropped)

    @property
    def buffered(self) -> int:
        """Finished groups waiting for the trainer."""
        with self._cv:
            return len(self._ready)

    def waiting(self) -> list[int]:
        """The prompt indices of the finished groups waiting for the trainer, in order."""
        with self._cv:
            return sorted(g.index for g in self._ready)

    def discard(self, next_step: int) -> int:
        """Drop every finished and unfinished group (call while :meth:`paused`) and rewind the
        data stream to where the call of the oldest of them began, so that production
        restarts at ``next_step`` from there (groups of that call that were trained already
        are drawn again). Returns how many groups were dropped."""
        with self._cv:
            dropped = len(self._ready) + len(self._pending) + self._retrying()
            first = self._oldest_state()
            if first is not None:
                self._stream.load_state(self._states[first])
            self._ready.clear()
            self._pending.clear()
            self._retry.clear()
            self._states.clear()
            self._first_step, self._slot = next_step, 0
            self._gate.invalidate()
            return dropped


def _bounded_wait(
    producer: Any,
    predicate: Callable[[], bool],
    what: str,
    threads: list[threading.Thread],
    in_flight: Callable[[], int],
) -> None:
    """Wait on ``producer._cv`` (held) for ``predicate``; raise the producer's failure, a
    producer that died, or :class:`StuckEngineError` after ``producer.wait_timeout_s``."""
    timeout = producer.wait_timeout_s
    deadline = None if timeout is None else time.monotonic() + timeout
    while not predicate():
        if producer._error is not None:
            raise producer._error
        if not any(t.is_alive() for t in threads):
            raise NrlError(f"the rollout producer stopped while the trainer {what}")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise StuckEngineError(
                f"the trainer {what} for {timeout:g} s and no rollout came ({in_flight()} "
                "generate calls or groups in flight): a generation engine is stuck (raise "
                "grpo.async.wait_timeout_s if its calls are this slow)"
            )
        producer._cv.wait(timeout=1.0 if left is None else min(1.0, left))
