"""Worker classes that the distributed tests start inside Ray actors.

The tests put this directory on the actors' ``PYTHONPATH`` (``env_vars``) so that these classes
are imported from their target strings inside the actors, as a plugin's classes would be.
"""

from __future__ import annotations

import os
import sys
import time


class AllReduceWorker:
    """Joins a gloo process group from the environment variables the worker group sets."""

    def __init__(self, options=None, context=None):
        import torch.distributed as dist

        self.context = context
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def all_reduce(self, value):
        """Sum ``value + rank`` over all ranks."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(value + self.rank)])
        dist.all_reduce(tensor)
        return tensor.item()

    def env(self):
        """The torch.distributed variables and the context this worker was built with."""
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {k: os.environ.get(k) for k in keys} | {
            "context_rank": getattr(self.context, "rank", None)
        }


class EchoWorker:
    """No torch.distributed: returns what it is given, tagged with its rank."""

    def __init__(self, *args, **kwargs):
        self.rank = int(os.environ["RANK"])
        self.args = args

    def echo(self, item, scale=1):
        return {"rank": self.rank, "item": item, "scale": scale}

    def built_with(self):
        """The arguments this worker was built with."""
        return self.args

    def environ(self, name):
        """The variable ``name`` of this actor's environment (None: unset)."""
        return os.environ.get(name)

    def sum_length(self, items):
        return self.rank, sum(len(x) for x in items)

    def fail(self, rank_to_fail):
        if self.rank == rank_to_fail:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    def die(self, rank_to_die):
        if self.rank == rank_to_die:
            print(f"rank {self.rank} is about to exit", flush=True)
            os._exit(1)
        time.sleep(60)  # the healthy rank would hang; the driver must not wait for it
        return self.rank

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def import_optional(self, module):
        """Whether ``module`` imports here, and the interpreter this actor runs."""
        try:
            __import__(module)
        except ImportError:
            return False, sys.executable
        return True, sys.executable


class SegmentWorker:
    """Leaves shared memory in ``/dev/shm`` the way a process killed mid-work does."""

    def __init__(self, *args, **kwargs):
        self._mapped = []

    def refit_forever(self):
        """A refit whose engines never answer: nrl's bucket segment exists until this process
        is killed, and the ``finally`` that unlinks it never runs."""
        import torch

        from nrl_core.weight_sync.shm import send_shm

        send_shm({"w": torch.ones(256)}, lambda meta, handle: handle, lambda _: time.sleep(3600))

    def queue_and_lock(self, size=1 << 20):
        """What a vLLM engine leaves when it is killed: a segment made as its message queues
        are (multiprocessing's ``psm_`` name, kept mapped) and a named semaphore made as its
        executor's ``shared_worker_lock`` is (a spawn-context lock: ``sem.mp-…``), neither left
        to a resource tracker nor ever unlinked; returns their names in ``/dev/shm``."""
        import multiprocessing
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(create=True, size=size)
        resource_tracker.unregister(shm._name, "shared_memory")
        lock = multiprocessing.get_context("spawn").Lock()
        resource_tracker.unregister(lock._semlock.name, "semaphore")
        self._mapped += [shm, lock]
        return [shm.name, "sem." + lock._semlock.name.lstrip("/")]

    def attach(self, name):
        """Map someone else's segment (it must outlive this run)."""
        from nrl_core.weight_sync.shm import _attach_shm

        self._mapped.append(_attach_shm(name))
        return name


def loaded(worker, *modules: str) -> dict:
    """Run on a worker (a group call's function): which of ``modules`` its process imported,
    and its ``MASTER_ADDR``."""
    return {name: name in sys.modules for name in modules} | {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR")
    }
