"""Helpers for tests of generation engines (any plugin's): a generate call left running while
the test does something to the engines, such as a refit that must land in the call."""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections.abc import Iterator
from typing import Any


class CallInFlight:
    """The generate call of :func:`generate_in_flight`: its result once the ``with`` block
    has ended."""

    output: Any = None
    error: BaseException | None = None


@contextlib.contextmanager
def generate_in_flight(
    engines: Any,
    prompts: Any,
    params: Any,
    *,
    busy: str,
    start_timeout_s: float = 120.0,
    end_timeout_s: float = 600.0,
) -> Iterator[CallInFlight]:
    """Run ``engines.generate(prompts, params)`` in a thread and enter the block once the call
    runs in the engine: once the engine actor's attribute ``busy`` (its count of calls
    running, read in the actor beside the call) is 1 on every engine. Leaving the block waits
    for the call (at most ``end_timeout_s``) and raises what it raised; its output is then the
    yielded object's ``output``.

    ``engines`` is a :class:`~nrl_core.generation.GenerationEngines` started with
    ``in_flight=True`` (an engine that runs one call at a time would not answer the reads
    before the call ends). Fails when the call has not started within ``start_timeout_s``."""
    call = CallInFlight()

    def generate() -> None:
        try:
            call.output = engines.generate(prompts, params)
        except BaseException as exc:  # raised when the block ends, in the test's thread
            call.error = exc

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    running = operator.attrgetter(busy)
    deadline = time.monotonic() + start_timeout_s
    while set(engines.group.run_all(running)) != {1}:
        if time.monotonic() > deadline:
            raise AssertionError(f"the generate call did not start in {start_timeout_s:g} s")
        time.sleep(0.02)
    yield call
    thread.join(end_timeout_s)
    if thread.is_alive():
        raise AssertionError(f"the generate call did not end in {end_timeout_s:g} s")
    if call.error is not None:
        raise call.error
