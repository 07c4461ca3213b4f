"""Concurrent requests served by one backend call.

A hundred agents each waiting for their own ``generate`` call would be served one at a time.
Instead, requests arriving within a short window (``server.batch_window_ms``) are grouped by
their sampling settings and each group goes to the backend as ONE batched call, in a worker
thread (the backends' ``generate`` is a blocking Ray call), one call at a time. Requests that
differ only in ``max_tokens`` share a call: it generates up to the largest and each answer is
cut to its own limit, which is the sample it would have been (sampling is left to right).

A request that names its own ``seed`` is served in a call of its own with that seed unchanged,
so that asking twice gives the same answer (in a shared call its draws would depend on the other
rows); the run's own seed (enforced during training) is offset per call instead, so that calls do
not repeat each other's random numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from nrl_core.interfaces import GenerationOutput, SamplingParams

Generate = Callable[
    [Sequence[Sequence[int]], SamplingParams, Sequence[Sequence[str] | None] | None],
    GenerationOutput,
]


SEED_LIMIT = 1 << 63
"""Request seeds lie in ``[0, SEED_LIMIT)``; per-call offsets wrap within it."""


def _fail(pending: Sequence[_Pending], exc: BaseException) -> None:
    """Hand ``exc`` to each request of ``pending`` still waiting (its handler answers it)."""
    for item in pending:
        if not item.future.done():
            item.future.set_exception(exc)


@attrs.frozen
class Completion:
    """One request's answer."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``"stop"`` or ``"length"``."""


@attrs.define
class BatcherStats:
    """What the batcher has served (read by tests and logs)."""

    requests: int = 0
    backend_calls: int = 0
    largest_batch: int = 0


@attrs.define
class _Pending:
    prompt: list[int]
    params: SamplingParams
    stop_strings: list[str] | None
    future: asyncio.Future
    alone: bool = False


class RequestBatcher:
    """Collects requests for ``window_s`` seconds (at most ``max_batch`` per call) and serves
    them through ``generate``.

    Args:
        generate: the backend (:class:`nrl_core.interfaces.GenerationWorker` signature).
        window_s: how long to wait for more requests once one arrived.
        max_batch: most requests in one backend call.
    """

    def __init__(self, generate: Generate, *, window_s: float, max_batch: int) -> None:
        self.generate = generate
        self.window_s = window_s
        self.max_batch = max_batch
        self.stats = BatcherStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None  # held: an unreferenced task may be collected
        self._calls = 0
        self.in_flight = 0
        """Requests submitted and not yet answered."""
        self.last_answered = float("-inf")
        """``time.monotonic()`` when a request was last answered (or failed)."""

    def quiet_s(self) -> float:
        """Seconds since a request was last answered; 0 while one is in flight (the endpoint
        is busy). Read from other threads: how long an agent has not used the model."""
        return 0.0 if self.in_flight else time.monotonic() - self.last_answered

    async def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        stop_strings: Sequence[str] | None,
        *,
        reproducible: bool = False,
    ) -> Completion:
        """Queue one prompt; returns its completion once its batch is generated. With
        ``reproducible`` (a request's own seed), it is generated alone with ``params.seed``
        as given, so the same request gives the same completion."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._worker is None or self._worker.done():
            # _serve never ends on its own (a failing request fails alone); should it die all
            # the same, the next request starts a new one rather than waiting forever.
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        stops = list(stop_strings) if stop_strings else None
        self.in_flight += 1
        try:
            await self._queue.put(_Pending(list(prompt), params, stops, future, reproducible))
            return await future
        finally:
            self.in_flight -= 1
            self.last_answered = time.monotonic()

    async def _serve(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            deadline = asyncio.get_running_loop().time() + self.window_s
            while len(batch) < self.max_batch:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            groups: dict[Any, list[_Pending]] = {}
            for item in batch:
                try:
                    key = attrs.evolve(item.params, max_new_tokens=0)
                    if item.alone:
                        key = (key, id(item))  # a group of its own
                    groups.setdefault(key, []).append(item)
                except Exception as exc:  # e.g. an unhashable value: this request fails alone
                    _fail([item], exc)
            for group in groups.values():
                try:
                    await self._run(group)
                except Exception as exc:  # the loop outlives any one group
                    _fail(group, exc)

    async def _run(self, group: list[_Pending]) -> None:
        longest = max(p.params.max_new_tokens for p in group)
        params = attrs.evolve(group[0].params, max_new_tokens=longest)
        if params.seed is not None and not group[0].alone:
            # Two calls with one seed would draw the same random numbers for their rows.
            params = attrs.evolve(params, seed=(params.seed + 7919 * self._calls) % SEED_LIMIT)
        self._calls += 1
        try:
            output = await asyncio.to_thread(
                self.generate, [p.prompt for p in group], params, [p.stop_strings for p in group]
            )
        except Exception as exc:  # every waiting request gets the backend's error
            _fail(group, exc)
            return
        self.stats.requests += len(group)
        self.stats.backend_calls += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(group))
        for pending, ids, logprobs, reason in zip(
            group, output.token_ids, output.logprobs, output.finish_reasons, strict=True
        ):
            limit = pending.params.max_new_tokens
            if len(ids) > limit:
                ids, logprobs, reason = ids[:limit], logprobs[:limit], "length"
            if not pending.future.done():
                pending.future.set_result(Completion(list(ids), list(logprobs), reason))
