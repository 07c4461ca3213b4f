"""The run log, ``<run dir>/nrl.log``: what the driver knows about a failure beyond one line.

The console gets one line per error (``error: policy rank 1 failed in forward_backward: ...``);
the full story of a worker error (the remote traceback, the tail of the worker's Ray log, its
node and pid) is written here by the driver, and the line names this file. Without ``nrl run
-v`` the output of other processes and libraries lands here too instead of on the console
(:func:`log_output`, :class:`RunLogHandler`): what the Ray workers print, the raylet's warnings
and Ray's own INFO lines. A run opens the log in
:class:`~nrl_core.algorithms.runtime.RunSession` and closes it when the run ends.
Commands without a run folder (``nrl convert``) have no run log: their errors keep the detail
in their attributes and name the worker's Ray log instead.

What other processes print is capped (:func:`log_output`): a line keeps its first
:data:`MAX_LINE_BYTES` bytes, and each source (a worker, a Ray process) writes at most about
:data:`MAX_STEP_OUTPUT_BYTES` per training step; past that its lines are dropped, and when the
step ends one line says how much was (``[nrl: output of (...) cut: N bytes over the per-step
cap ...]``). A reward function that printed 4 MiB per call grew ``nrl.log`` to 1 GiB in one
step. ``nrl run -v`` prints all of it on the console instead, uncut.

Standard library only: this module is imported by the worker-group code in the driver, and
costs nothing at ``nrl`` start-up.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

RUN_LOG_FILE = "nrl.log"
"""The run log's name inside the run folder."""
LOGGER_NAME = "nrl_core.run"
"""The :mod:`logging` logger whose records go to the run log (and nowhere else)."""

MAX_LINE_BYTES = 16 * 1024
"""The longest line of captured output the run log keeps, in bytes of UTF-8: the rest of a
longer line is cut, and the line ends in ``[nrl: line cut: N bytes over ...]``."""
MAX_STEP_OUTPUT_BYTES = 256 * 1024
"""The captured output the run log keeps from one source (one worker, one Ray process) per
training step (between two steps' metrics; a command without steps: its whole run), in bytes:
the line that reaches it is the last one written. Up to ``MAX_STEP_OUTPUT_BYTES +
MAX_LINE_BYTES`` and the one line that says what was cut."""

_logger = logging.getLogger(LOGGER_NAME)
# Records stop here: the console shows the one-line error, not a second copy of the detail.
_logger.propagate = False
_logger.setLevel(logging.INFO)
# The run logs opened here, newest last (other code, e.g. pytest, adds handlers of its own).
_open: list[logging.FileHandler] = []
# The per-step caps: bytes written and dropped per source since the step began (Ray forwards
# worker lines from a thread of its own, hence the lock).
_caps_lock = threading.Lock()
_written: dict[str, int] = {}
_dropped: dict[str, int] = {}
_step: list[int | None] = [None]


def open_run_log(run_dir: str | Path) -> Callable[[], None]:
    """Start writing ``<run_dir>/nrl.log`` (appending: a resumed run keeps the earlier runs'
    entries); returns the function that stops writing it."""
    path = Path(run_dir).absolute() / RUN_LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _RunLogFile(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    _logger.addHandler(handler)
    _open.append(handler)
    with _caps_lock:  # a run's caps start with it
        _written.clear()
        _dropped.clear()
        _step[0] = None
    _logger.info("nrl started (pid %d): %s", os.getpid(), " ".join(sys.argv))

    def close() -> None:
        _say_what_was_cut()
        if handler in _open:
            _open.remove(handler)
        _logger.removeHandler(handler)
        handler.close()

    return close


class _RunLogFile(logging.FileHandler):
    """The run log's file handler: a failed write (a full disk) is said once, in one stderr line
    naming the file and why, and the run log stops; :mod:`logging`'s default prints a
    traceback for every record that fails (135 lines on a full disk, none saying so)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self._stop(exc)

    def close(self) -> None:
        try:
            super().close()  # flushes what is buffered: may fail the same way
        except OSError as exc:
            self._stop(exc)

    def _stop(self, exc: OSError) -> None:
        if not self.failed:
            self.failed = True
            print(
                f"warning: cannot write the run log {self.baseFilename} "
                f"({exc.strerror or exc}); it stops here",
                file=sys.stderr,
            )
        if self in _open:
            _open.remove(self)
        _logger.removeHandler(self)


def run_log_path() -> Path | None:
    """The run log being written now, or None outside a run."""
    return Path(_open[-1].baseFilename) if _open else None


def log_failure(summary: str, detail: str) -> Path | None:
    """Write ``summary`` (the error's one line) and ``detail`` (tracebacks, log tails) to the
    run log; returns its path, or None when no run log is open (nothing is written then)."""
    path = run_log_path()
    if path is None:
        return None
    _logger.error("%s\n%s", summary, detail.rstrip())  # FileHandler flushes every record
    return path


def log_output(source: str, lines: Iterable[str]) -> None:
    """Write ``lines`` another process printed (a Ray worker's stdout or stderr, the raylet's
    warnings) to the run log, each after ``source`` (``(nrl-policy-0 pid=123)``), within the
    caps (:data:`MAX_LINE_BYTES`, :data:`MAX_STEP_OUTPUT_BYTES`); dropped when no run log is
    open."""
    if not _open:
        return
    for line in lines:
        _log_line(source, line.rstrip("\n"))


def _log_line(source: str, line: str, cut: int = 0) -> None:
    """One line of ``source``'s output, of which ``cut`` bytes at its end were cut already."""
    data = line.encode("utf-8", "replace")
    size = len(data) + cut  # the line as printed
    if len(data) > MAX_LINE_BYTES:
        cut += len(data) - MAX_LINE_BYTES
        data = data[:MAX_LINE_BYTES]
    if cut or len(data) != len(line):  # cut, or not ASCII: the bytes decide (lone surrogates too)
        line = data.decode("utf-8", "ignore")
    if cut:
        line += f" [nrl: line cut: {cut} bytes over the per-line cap of {MAX_LINE_BYTES}]"
    with _caps_lock:
        written = _written.get(source, 0)
        if written >= MAX_STEP_OUTPUT_BYTES:
            _dropped[source] = _dropped.get(source, 0) + size
            return
        _written[source] = written + len(data)
    _logger.info("%s %s", source, line)


def step_done(step: int) -> None:
    """The run finished ``step`` (its metrics are logged): for each source whose output was cut
    since the step began, one line saying how much; the per-step caps start again. Calls for
    the step already seen (a step logs its validation apart) change nothing."""
    with _caps_lock:
        if _step[0] == step:
            return
        _step[0] = step
    _say_what_was_cut()


def _say_what_was_cut() -> None:
    with _caps_lock:
        dropped = dict(_dropped)
        _dropped.clear()
        _written.clear()
    for source, size in sorted(dropped.items()):
        _logger.warning(
            "[nrl: output of %s cut: %d bytes over the per-step cap of %d bytes "
            "(nrl_core.run_log.MAX_STEP_OUTPUT_BYTES); nrl run -v prints all of it on the "
            "console]",
            source,
            size,
            MAX_STEP_OUTPUT_BYTES,
        )


class RunLogHandler(logging.Handler):
    """A :mod:`logging` handler that writes another library's records (Ray's) to the run log,
    each after its logger's name; dropped when no run log is open."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _open:
            return
        try:
            message = record.getMessage()
        except Exception:
            self.handleError(record)
            return
        _logger.log(record.levelno, "%s: %s", record.name, message)


class RunLogWriter(io.TextIOBase):
    """A text stream whose complete lines go to the run log after ``source`` (dropped when no
    run log is open); carriage-return redraws (progress bars) keep their last state only. For
    output a library prints in this process (``contextlib.redirect_stderr``)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._pending = ""
        self._cut = 0  # bytes cut off the end of the pending line (MAX_LINE_BYTES)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not _open:
            return len(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            line = line.rsplit("\r", 1)[-1]
            if line.strip():
                _log_line(self.source, line, self._cut)
            self._cut = 0
        if len(self._pending) > MAX_LINE_BYTES:
            # A line without its end yet: keep what the run log would, count the rest (a
            # redrawn line, a progress bar, keeps its last state, as written out below).
            states = [state for state in self._pending.split("\r") if state.strip()]
            pending = states[-1] if states else ""
            self._cut += len(pending[MAX_LINE_BYTES:].encode("utf-8", "replace"))
            self._pending = pending[:MAX_LINE_BYTES]
        return len(text)

    def flush(self) -> None:
        line = self._pending.rsplit("\r", 1)[-1]
        if line.strip():
            _log_line(self.source, line, self._cut)
        self._pending, self._cut = "", 0


@contextlib.contextmanager
def output_to_run_log(source: str) -> Iterator[None]:
    """While open, what Python code in this process prints (``sys.stdout``, ``sys.stderr``)
    goes to the run log after ``source`` instead of the console; nothing changes when no run
    log is open (outside a run the console is the only place)."""
    if run_log_path() is None:
        yield
        return
    writer = RunLogWriter(source)
    try:
        with contextlib.redirect_stdout(writer), contextlib.redirect_stderr(writer):
            yield
    finally:
        writer.flush()
