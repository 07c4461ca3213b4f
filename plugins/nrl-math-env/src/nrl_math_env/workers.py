"""A pool of verifier processes that score responses, each call under a hard time limit.

Why processes: a verifier can hang on a pathological expression (``9^{9^{9^{9}}}`` makes
sympy compute a huge integer power in C, where no signal or thread can interrupt it), and
signal-based timeouts only work in a main thread, which Ray actor methods may not run in.
The only robust limit is to kill the process that is stuck and start a fresh one.

Each worker is a plain ``python -m nrl_math_env.workers <module:function>`` subprocess that
reads one JSON request per line on stdin and writes one JSON reply per line. Plain
subprocesses (not ``multiprocessing``) avoid forking a multi-threaded Ray worker and re-running
its ``__main__``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from nrl_core.errors import NrlError

_START_TIMEOUT_S = 120.0
"""How long a worker may take to import its verifier before the pool gives up."""


class VerifierStartError(NrlError):
    """A verifier worker could not start (its function does not import, for example)."""


class VerifierCrashError(NrlError):
    """The verifier's process died on every one of many samples in a row: it is broken."""


class Verdict(NamedTuple):
    """The outcome of one verification."""

    reward: float
    status: str
    """``ok``; ``timeout`` (killed at the time limit); ``error`` (the function raised);
    ``crashed`` (the worker died). Every status but ``ok`` has reward 0."""
    error: str | None = None


class _Worker:
    """One verifier subprocess and the request it is working on."""

    def __init__(self, fn: str) -> None:
        # The worker sees the same modules as this process (Ray working_dir, test folders).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nrl_math_env.workers", fn],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + _START_TIMEOUT_S

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, task: int, response: str, answer: Any, timeout_s: float) -> None:
        request = json.dumps({"response": response, "answer": answer}, default=str)
        self.proc.stdin.write(request.encode() + b"\n")
        self.proc.stdin.flush()
        self.task, self.deadline = task, time.monotonic() + timeout_s

    def receive(self) -> dict[str, Any] | None:
        """The worker's next reply, or ``None`` when it died."""
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def kill(self) -> None:
        """Kill the process (a no-op when it has ended) and release its pipes."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class VerifierPool:
    """Runs ``fn(response, answer) -> float`` in ``num_workers`` processes, ``timeout_s`` each.

    Args:
        fn: ``"module:function"`` of the verifier; imported in the workers only.
        num_workers: processes working in parallel.
        timeout_s: wall-time limit of one call, counted from when a ready worker receives it;
            the worker is killed and replaced when it runs over.
    """

    def __init__(self, fn: str, num_workers: int, timeout_s: float) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        # Crashes in a row, with no reply between them; at max_crashes_in_a_row the verifier
        # is broken (each crash costs a fresh process and its imports: a whole batch of them
        # took 85-112 s a step, scoring nothing).
        self.crashes_in_a_row = 0
        self.max_crashes_in_a_row = max(4, 2 * num_workers)
        self._workers = [_Worker(fn) for _ in range(num_workers)]
        # Waiting here makes a verifier that cannot import fail when the environment is built,
        # not at the first step.
        while not all(w.ready for w in self._workers):
            self._poll([])

    def map(self, items: Sequence[tuple[str, Any]]) -> list[Verdict]:
        """Score ``(response, answer)`` pairs; returns one :class:`Verdict` per pair, in order."""
        results: list[Verdict | None] = [None] * len(items)
        queue = deque(range(len(items)))
        while queue or any(w.task is not None for w in self._workers):
            for i, worker in enumerate(self._workers):
                if worker.ready and worker.task is None and worker.proc.poll() is not None:
                    worker.kill()  # died while idle: replace it, no verdict is lost
                    self._workers[i] = _Worker(self.fn)
                elif worker.ready and worker.task is None and queue:
                    task = queue.popleft()
                    worker.send(task, *items[task], timeout_s=self.timeout_s)
            self._poll(results)
        return results  # type: ignore[return-value]

    def _poll(self, results: list[Verdict | None]) -> None:
        """Wait for the first reply or deadline among the starting and busy workers; handle
        every reply and expired deadline."""
        waiting = [w for w in self._workers if not w.ready or w.task is not None]
        wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
        readable, _, _ = select.select(waiting, [], [], wait_s)
        for worker in waiting:
            if worker in readable:
                self._settle(worker, worker.receive(), results)
            elif time.monotonic() >= worker.deadline:
                self._settle(worker, {"status": "timeout"}, results)

    def _settle(self, worker: _Worker, reply: dict | None, results: list[Verdict | None]) -> None:
        """Record ``worker``'s reply (``None``: it died) and replace the worker if it is gone."""
        if not worker.ready:
            if reply is None or "fatal" in reply or reply.get("status") == "timeout":
                self.close()
                why = (reply or {}).get("fatal") or "it exited or hung while starting"
                raise VerifierStartError(
                    f"verifier worker for {self.fn!r} failed to start: {why}; check "
                    "env.math.verify_fn and that nrl-math-env[verify] is installed"
                )
            worker.ready = True
            return
        task, worker.task = worker.task, None
        if reply is None:
            worker.kill()
            code = worker.proc.returncode
            self.crashes_in_a_row += 1
            if self.crashes_in_a_row >= self.max_crashes_in_a_row:
                self.close()
                raise VerifierCrashError(
                    f"the verifier {self.fn!r} crashed on {self.crashes_in_a_row} samples in a "
                    f"row (its process exited with code {code} while scoring): fix the verify "
                    "function (a crash is a process exit: os._exit, a segfault, out of memory)"
                )
            results[task] = Verdict(0.0, "crashed", f"the verifier process exited with code {code}")
            self._workers[self._workers.index(worker)] = _Worker(self.fn)
            return
        self.crashes_in_a_row = 0
        if reply.get("status") == "timeout":
            results[task] = Verdict(0.0, "timeout", f"over env.math.timeout_s={self.timeout_s}")
            worker.kill()
            self._workers[self._workers.index(worker)] = _Worker(self.fn)
        elif "error" in reply:
            results[task] = Verdict(0.0, "error", reply["error"])
        else:
            results[task] = Verdict(float(reply["reward"]), "ok")

    def close(self) -> None:
        """Kill every worker; the pool cannot be used afterwards."""
        for worker in getattr(self, "_workers", []):
            worker.kill()
        self._workers = []

    def __del__(self) -> None:
        self.close()


def _serve(fn_target: str) -> None:
    """The worker's main loop: one JSON request per stdin line, one JSON reply per line."""
    _die_with_parent()
    # The replies get a private copy of stdout; fd 1 then points at stderr, so that whatever
    # the verifier prints can never corrupt the protocol.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        from nrl_core.registry import resolve_target

        fn = resolve_target(fn_target, what="env.math.verify_fn")
    except Exception as exc:
        replies.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    replies.write('{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"reward": float(fn(request["response"], request["answer"]))}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        replies.write(json.dumps(reply) + "\n")


def _die_with_parent() -> None:
    # A worker stuck in C code would outlive a killed Ray actor; ask Linux to kill it with its
    # parent (PR_SET_PDEATHSIG). Elsewhere, the worker ends when its stdin closes.
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    _serve(sys.argv[1])
