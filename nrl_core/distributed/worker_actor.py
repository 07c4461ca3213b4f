"""What runs inside each worker group actor: :class:`_WorkerActor` hosts one rank (sets the
``torch.distributed`` variables, builds the component from its target string in the actor's own
interpreter, runs the driver's calls), with the helpers it needs (the loopback store, the venv's
environment, the rank written into the component's context) and :class:`Sharded`, the marker of
a per-shard argument. The driver side is :mod:`nrl_core.distributed.worker_group`."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import ray

from nrl_core.interfaces import ComponentContext


@attrs.frozen
class Sharded:
    """An argument of :meth:`WorkerGroup.run_sharded` given per data-parallel shard, like its
    data: ``items[d]`` goes to the workers of DP shard ``d``."""

    items: Sequence[Any]


def _shard_of(value: Any, dp_rank: int) -> Any:
    return value.items[dp_rank] if isinstance(value, Sharded) else value


# ---------------------------------------------------------------------------------------------
# The actor


class _WorkerActor:
    """Hosts one rank: sets the torch.distributed variables, then builds the worker class.

    The class is imported from its target string here, inside the actor's interpreter (the
    plugin's venv), so the driver never imports the plugin's engine.
    """

    def __init__(self) -> None:
        self.worker: Any = None
        self._store: Any = None

    def describe(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "logs": [_fd_path(1), _fd_path(2)],
        }

    def free_port(self, host: str = "") -> int:
        """A free TCP port on ``host`` (default: on every interface)."""
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]

    def host_store(self, host: str) -> int | None:
        """Serve the group's ``torch.distributed`` store from this actor (rank 0), listening on
        ``host`` only; returns its port, or None where this actor's torch cannot be pointed at
        it (see :func:`_serve_store`)."""
        served = _serve_store(host)
        if served is None:
            return None
        self._store = served[0]  # serves as long as the actor lives
        return served[1]

    def setup(self, target: str, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        from nrl_core.registry import resolve_target

        os.environ.update(env)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        # The lead passes (options, context); the context must carry this worker's rank.
        args = tuple(_with_rank(a, rank, world_size) for a in args)
        kwargs = {k: _with_rank(v, rank, world_size) for k, v in kwargs.items()}
        cls = resolve_target(target, what="worker class")
        self.worker = cls(*args, **kwargs)

    def call(self, method: Method, args: tuple, kwargs: dict) -> Any:
        return _invoke(self.worker, method, args, kwargs)

    def call_sharded(self, method: Method, item: Any, args: tuple, kwargs: dict) -> Any:
        return _invoke(self.worker, method, (item, *args), kwargs)

    def close(self) -> None:
        close = getattr(self.worker, "shutdown", None)
        if callable(close):
            close()
        # Before a rebuild builds the next worker: not two models in memory at once.
        self.worker = None
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


Method = str | Callable[..., Any]
"""What a group call runs on each worker: the name of a worker method, or a function importable
in the actor (the core's per-rank code, e.g. :func:`nrl_core.training.train_on_rank`), called
as ``function(worker, *args)``."""


def _invoke(worker: Any, method: Method, args: tuple, kwargs: dict) -> Any:
    if callable(method):
        return method(worker, *args, **kwargs)
    return getattr(worker, method)(*args, **kwargs)


def _method_name(method: Method) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def check_shard_counts(
    group: str, method: Method, data: Sequence, args: tuple, kwargs: dict, dp_size: int
) -> None:
    """A ``run_sharded`` call gives one item of ``data`` and of every :class:`Sharded` argument
    to each data-parallel shard: refuse any other count in one line naming the group's call."""
    from nrl_core.errors import NrlError

    sharded = [v for v in (*args, *kwargs.values()) if isinstance(v, Sharded)]
    for what in (data, *(v.items for v in sharded)):
        if len(what) != dp_size:
            raise NrlError(
                f"{group}.{_method_name(method)}: got {len(what)} shards for dp_size="
                f"{dp_size}; split the data into exactly dp_size items"
            )


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


LOOPBACK = "127.0.0.1"
"""Where the rendezvous of a group whose ranks all run on the driver's node listens."""


def _serve_store(host: str) -> tuple[Any, int] | None:
    """A ``TCPStore`` server listening on ``host`` only, for ``env://`` rendezvous.

    torch's own rank-0 store listens on every interface whatever ``MASTER_ADDR`` says, without
    authentication. This one is handed a socket bound to ``host``; the ranks then connect to it
    as clients because their environment sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (the
    torchelastic convention for "the agent serves the store at MASTER_ADDR:MASTER_PORT").
    Only where torch limits that convention to exactly that address (``_agent_store_serves``):
    older versions apply it to every store created in the process, which would leave an
    engine's own ``tcp://`` rendezvous waiting for a server nobody runs. None there, and on
    any failure: the group then rendezvous as before. Returns ``(store, port)``.
    """
    try:
        import importlib

        import torch.distributed as dist

        # The module (torch.distributed.rendezvous is also the name of a function).
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
        if not hasattr(rendezvous, "_agent_store_serves") or not dist.is_available():
            return None
        sock = socket.create_server((host, 0))
        port = sock.getsockname()[1]
        # The store takes the socket over (it closes it when it goes), hence detach().
        store = dist.TCPStore(
            host, port, None, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach()
        )
    except Exception:
        return None
    return store, port


def _loopback_env() -> dict[str, str]:
    """Variables that keep a single-node group's own connections on the loopback interface
    (a user's own setting wins)."""
    env: dict[str, str] = {}
    try:
        has_lo = any(name == "lo" for _, name in socket.if_nameindex())
    except OSError:
        has_lo = False
    if has_lo and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pair listeners (else: the hostname's address)
    return env


def venv_environment(python: str) -> dict[str, str]:
    """``VIRTUAL_ENV`` and ``PATH`` for actors running ``python``, when it is a virtualenv's:
    as if the venv were activated. Ray only swaps the interpreter; tools that look for the venv
    or its executables (JIT kernel builds call ``ninja`` from PATH, uv reads VIRTUAL_ENV)
    would otherwise find the driver's. ``${PATH}`` is expanded by Ray on the worker's node."""
    root = Path(python).parent.parent
    if not (root / "pyvenv.cfg").is_file():
        return {}
    return {"VIRTUAL_ENV": str(root), "PATH": f"{root / 'bin'}:${{PATH}}"}


def _with_rank(value: Any, rank: int, world_size: int) -> Any:
    if isinstance(value, ComponentContext):
        return attrs.evolve(value, rank=rank, world_size=world_size)
    return value
