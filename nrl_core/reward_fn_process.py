"""The process a reward function (``env.reward_fn``) runs in: the user's code kept out of the
process that hosts the environment.

A reward function is the user's own code, and code may end its process: ``sys.exit()``,
``os._exit(3)``, a crash in a C extension, the out-of-memory killer. Called in the environment's
host (on the in-process cluster that host is the ``nrl`` driver itself), any of these ended the
run with that process's exit code and no word; ``sys.exit(0)`` even looked like success. So
each environment worker starts one child process when it is built and keeps it for the run
(one round trip over a socket pair per batch, no process per call), and the function is
imported and called there only. A function that calls ``sys.exit``, or a child that ends,
fails the run in one line naming the function and how its process ended
(:class:`RewardFunctionExit`, exit code 1); an exception still fails only its sample.

What the function prints (Python's ``sys.stdout`` and ``sys.stderr``) is sent to the host and
printed there, so that it lands where the host's own output does (the run log, capped as
:mod:`nrl_core.run_log` says, or the console with ``nrl run -v``).

The host sends the samples as pickles (its own data); the child answers in JSON, so the host
never unpickles anything the user's code wrote. A child whose host is gone exits within
:data:`PARENT_POLL_S`, even while the function is still running. Standard library only.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from multiprocessing.connection import Connection
    from pathlib import Path

# subprocess, socket, pickle and multiprocessing are imported where used: the driver imports
# this module with RewardFnConfig, long before (or without) starting a function's process.

OUTPUT_CHUNK_CHARS = 64 * 1024
"""The child sends what the function printed at the end of each call, or sooner once this
many characters are waiting (so a function that prints a lot never holds it all in memory)."""
PARENT_POLL_S = 0.5
"""How often the child checks that its host process still lives (it exits when not)."""
STOP_WAIT_S = 2.0
"""How long :meth:`RewardFunctionProcess.close` waits for the child to exit before killing it."""


class RewardFunctionExit(NrlError):
    """The reward function ended its process (``sys.exit``, ``os._exit``, a crash, a kill):
    no more samples can be scored, and the run stops in one line naming the function."""


# ---------------------------------------------------------------------------------------------
# The host's side


class RewardFunctionProcess:
    """The child process that imports and calls one reward function.

    Args:
        reference: ``env.reward_fn.path``, ``FILE.py:FUNCTION``.

    Raises:
        ConfigError: the file does not import, or the function cannot take a prompt and a
            completion (as :func:`load_reward_function` words it).
        RewardFunctionExit: the child ended while importing the file.
    """

    def __init__(self, reference: str) -> None:
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        from nrl_core.errors import ConfigError

        self.reference = reference
        self.name = reference
        """``my_reward.py:score``, once the child has imported it."""
        self.fields: tuple[str, ...] | None = None
        """The row fields the function takes by name, or None for all (``**row``)."""
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair()
        # The child sees the modules this process sees (a Ray working_dir, test folders).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with theirs:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    str(theirs.fileno()),
                    str(os.getpid()),
                    reference,
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.conn = Connection(ours.detach())
        # At garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.conn)
        reply = self._receive(f"importing {reference.rpartition(':')[0]}")
        if "config_error" in reply:
            self.close()
            raise ConfigError(reply["config_error"])
        self.name = reply["ready"]
        self.fields = None if reply["fields"] is None else tuple(reply["fields"])

    def score(self, items: list[tuple[str, str, dict]]) -> list[dict[str, Any]]:
        """Call the function on each ``(prompt, completion, row)``; one outcome per item:
        ``{"reward": float}``, ``{"error": "KeyError: ... (file:line)"}`` (it raised, or
        returned NaN or infinity) or ``{"bad": "NoneType None"}`` (it returned no number).

        Raises:
            RewardFunctionExit: the function called ``sys.exit``, or its process ended.
        """
        import pickle

        what = f"scoring {len(items)} sample{'s' if len(items) != 1 else ''}"
        with self._lock:
            try:
                self.conn.send_bytes(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                raise self._ended(what) from None
            reply = self._receive(what)
        if "exit" in reply:
            self.close()
            raise RewardFunctionExit(
                f"reward function {self.name} called sys.exit({reply['exit']}) "
                f"({reply['where']}) while {what}; {_ADVICE} (env.reward_fn.path={self.reference})"
            )
        return reply["rewards"]

    def close(self) -> None:
        """Stop the child (idempotent): it exits when its socket closes; killed if it has not
        within :data:`STOP_WAIT_S` (a function still running)."""
        import subprocess

        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        self.conn.close()
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill(self.proc, self.conn)

    def _receive(self, what: str) -> dict[str, Any]:
        """The child's next answer; what it printed meanwhile is printed here (on this
        process's ``sys.stdout`` / ``sys.stderr`` of the moment: the run log when redirected)."""
        while True:
            try:
                message = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                raise self._ended(what) from None
            if "out" in message:
                sys.stdout.write(message["out"])
            elif "err" in message:
                sys.stderr.write(message["err"])
            else:
                return message

    def _ended(self, what: str) -> RewardFunctionExit:
        """The error for a child that ended (its socket closed) while ``what``."""
        import signal
        import subprocess

        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:  # it closed the socket but lives on: not ours to keep
            _kill(self.proc, self.conn)
            code = self.proc.returncode
        self._finalizer.detach()
        self.conn.close()
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"ended (exit code {code})"
        return RewardFunctionExit(
            f"reward function {self.name}: its process {how} while {what} (os._exit, a crash "
            f"or the out-of-memory killer end it); {_ADVICE} (env.reward_fn.path={self.reference})"
        )


_ADVICE = "a reward function returns a float, or raises an exception to fail one sample"


def _kill(proc: subprocess.Popen, conn: Connection) -> None:
    conn.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------
# Loading the function (in the child; also what the driver's checks share)


def split_reference(reference: str) -> tuple[Path, str]:
    """``("my_reward.py", "score")`` of ``"my_reward.py:score"``, the file made absolute
    (against the current folder: the driver's and, on a local cluster, its actors')."""
    from pathlib import Path

    file, _, function = reference.rpartition(":")
    return Path(file).expanduser().absolute(), function


def load_reward_function(reference: str) -> Callable[..., Any]:
    """Import ``FILE.py`` (as a module of its own, its folder first on ``sys.path`` so that it
    can import its neighbours) and return its ``FUNCTION``; a ``ConfigError`` naming the file
    when that fails."""
    import importlib.util

    from nrl_core.errors import ConfigError

    file, function = split_reference(reference)
    name = f"nrl_reward_fn_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"env.reward_fn.path={reference}: {file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit() at import: the file is broken too
        del sys.modules[name]
        raise ConfigError(
            f"env.reward_fn.path={reference}: importing {file.name} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(
            f"env.reward_fn.path={reference}: {file.name} has no function {function!r}"
        )
    return fn


def accepted_fields(fn: Callable[..., Any], reference: str) -> tuple[str, ...] | None:
    """The row fields ``fn`` takes by name, or ``None`` when it takes ``**row`` (all of them):
    a function written as ``score(prompt, completion, answer)`` gets only ``answer``. A
    function that cannot take a prompt and a completion is a ``ConfigError``."""
    import inspect

    from nrl_core.errors import ConfigError

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or C function: call it with everything
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(
            f"env.reward_fn.path={reference}: {fn.__name__}{inspect.signature(fn)} must take "
            "(prompt, completion, **row)"
        )
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY])


# ---------------------------------------------------------------------------------------------
# The child's side


class _Forward(io.TextIOBase):
    """The child's ``sys.stdout`` / ``sys.stderr``: what the function prints, sent to the host
    as ``{key: text}`` messages."""

    def __init__(self, conn: Connection, key: str, lock: threading.RLock) -> None:
        # One lock for every message: a thread of the function's may print meanwhile, and two
        # messages written at once would interleave on the socket.
        self.conn, self.key, self.lock = conn, key, lock
        self._parts: list[str] = []
        self._size = 0

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self.lock:
            self._parts.append(text)
            self._size += len(text)
            full = self._size >= OUTPUT_CHUNK_CHARS
        if full:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self._parts:
                text, self._parts, self._size = "".join(self._parts), [], 0
                self.conn.send_bytes(json.dumps({self.key: text}).encode())


def _where(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # an exception whose message itself raises
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}"


def _outcome(reward: Any, name: str) -> dict[str, Any]:
    # bool is an int: True/False are rewards 1/0, as in TRL.
    if not isinstance(reward, int | float):
        text = repr(reward)
        return {"bad": f"{type(reward).__name__} {text if len(text) <= 60 else text[:57] + '...'}"}
    try:
        value = float(reward)
    except OverflowError:  # an int too large for a float
        value = float("inf")
    if value != value or value in (float("inf"), float("-inf")):
        # One sample's fault, not the function's: that sample gets 0 and is counted.
        return {"error": f"reward function {name} returned {value}"}
    return {"reward": value}


def _watch_parent(parent: int) -> None:
    """Exit once the host is gone, also while the function runs (it may never return)."""

    import time

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="nrl-reward-fn-parent", daemon=True).start()


def serve(fd: int, parent: int, reference: str) -> None:
    """The child's main loop: import the function, then score each batch the host sends
    (a pickled list of ``(prompt, completion, row)``) until its socket closes."""
    import pickle
    import signal
    from multiprocessing.connection import Connection

    # A Ctrl-C in the terminal reaches this process too; the run handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent)
    conn = Connection(fd)
    lock = threading.RLock()
    out, err = _Forward(conn, "out", lock), _Forward(conn, "err", lock)
    sys.stdout, sys.stderr = out, err

    def send(message: dict[str, Any]) -> None:
        with lock:
            out.flush()
            err.flush()
            conn.send_bytes(json.dumps(message).encode())

    from nrl_core.errors import ConfigError

    try:
        fn = load_reward_function(reference)
        fields = accepted_fields(fn, reference)
    except ConfigError as exc:
        send({"config_error": str(exc)})
        return
    name = f"{split_reference(reference)[0].name}:{getattr(fn, '__name__', None) or reference}"
    send({"ready": name, "fields": None if fields is None else list(fields)})
    while True:
        try:
            items = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        outcomes = []
        for prompt, completion, row in items:
            try:
                reward = fn(prompt, completion, **row)
            except SystemExit as exc:
                send({"exit": "" if exc.code is None else repr(exc.code), "where": _where(exc)})
                return
            except Exception as exc:
                outcomes.append({"error": f"{_describe(exc)} ({_where(exc)})"})
            else:
                outcomes.append(_outcome(reward, name))
            out.flush()
            err.flush()
        send({"rewards": outcomes})


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
