"""Asynchronous GRPO: separate engines generate the next steps' rollouts while the trainer
trains (``grpo.async``).

Two pieces, both in the driver:

* :class:`WeightGate` stands between the generation backend and everyone who calls it. It
  serialises ``generate`` calls and refits, and knows which weights the engines hold (the
  *version*: the number of optimizer steps in them). A refit waits for the call in flight,
  which therefore finishes on the old weights; so the version read when a batch starts is the
  oldest version any of its calls used.
* :class:`RolloutProducer` is a background thread that runs the trainer's own ``collect`` for
  step after step. It starts the batch of step ``k`` only when the engines hold weights of
  step ``k - 1 - max_trajectory_age_steps`` or newer and fewer than ``max_buffer_size``
  batches wait; finished batches wait in a buffer keyed by step. With
  ``max_trajectory_age_steps=0`` it can start batch ``k`` only after the refit that ends step
  ``k - 1``, which is exactly the synchronous loop.

The trainer takes batch ``k`` at step ``k``; a batch older than the bound there (it cannot
happen by construction, but a producer that ran ahead would make it so) is dropped, counted in
``async/dropped_stale``, and generated again.

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

from nrl_core.errors import NrlError


class WeightGate:
    """``generate`` and ``refit`` of a generation backend, serialised, with the version of the
    weights the engines hold (``None`` until the first refit) and the seconds spent
    generating (for the engines' idle fraction).

    ``holds_weights`` says whether the engines still hold their last refit's weights
    (:attr:`nrl_core.generation.GenerationEngines.holds_weights`: False once colocated engines
    slept with their weights dropped); when it is False, :meth:`ensure` refits even for the
    version it recorded. Default: always (generation inside the policy workers)."""

    def __init__(
        self,
        generate: Callable[..., Any],
        refit: Callable[[], float],
        holds_weights: Callable[[], bool] = lambda: True,
    ) -> None:
        self._generate = generate
        self._refit = refit
        self._holds_weights = holds_weights
        self._lock = threading.Lock()
        self.version: int | None = None
        self.busy_s = 0.0
        self.on_change: Callable[[], None] = lambda: None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            started = time.perf_counter()
            try:
                return self._generate(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - started

    def ensure(self, version: int) -> float:
        """Refit the engines to the policy's current weights, which hold ``version`` optimizer
        steps, unless they already do; returns the refit's seconds (0 when none ran)."""
        if self.version == version and self._holds_weights():
            return 0.0
        with self._lock:
            seconds = self._refit()
            self.version = version
        self.on_change()
        return seconds

    def invalidate(self) -> None:
        """Forget the version: the next :meth:`ensure` refits whatever the engines hold."""
        self.version = None


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


class RolloutProducer:
    """The background rollout thread (see the module docstring).

    Args:
        collect: the trainer's ``collect(step)``; may raise ``no_signal``.
        no_signal: the exception type meaning "no group with reward variance".
        gate: the :class:`WeightGate` all generation goes through.
        stream: the training data stream (``state()`` / ``load_state()``).
        first_step, last_step: the steps to produce.
        max_age: ``grpo.async.max_trajectory_age_steps``.
        max_buffer: ``grpo.async.max_buffer_size``.
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
    ) -> None:
        self._collect = collect
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
        self._thread = threading.Thread(target=self._run, name="nrl-rollouts", daemon=True)
        self._thread.start()

    # -- the producer thread --------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _startable(self) -> int | None:
        """The step to produce next, if the age bound and the buffer allow it now."""
        if self._stopped or self._paused:
            return None
        step = self._redo[0] if self._redo else self._next
        version = self._gate.version
        if step > self._last_step or version is None or len(self._ready) >= self._max_buffer:
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
                    if self._redo and self._redo[0] == step:
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
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise NrlError("the rollout producer stopped without a batch for this step")
                self._cv.wait(timeout=1.0)
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

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Let the batch in flight finish, start nothing new meanwhile."""
        with self._cv:
            self._paused = True
            self._cv.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self._cv:
                self._paused = False
                self._cv.notify_all()

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

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=600)
