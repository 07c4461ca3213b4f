"""The gather helper: a policy rank's ``push_weights``, with the all-gather over
``torch.distributed`` that the sender needs between ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nrl_core.weight_sync.interface import RefitStats
    from nrl_core.weight_sync.sender import WeightSender


def push_from_rank(
    sender: WeightSender, buckets: Iterable[dict[str, torch.Tensor]], *, rank: int
) -> RefitStats | None:
    """A policy rank's ``push_weights``: send ``buckets`` through ``sender`` from this rank.

    A collective over the policy's default ``torch.distributed`` group (gathering sharded
    tensors into buckets is one, and so is the exchange of every GPU's CUDA IPC handle): call
    on all ranks. Rank 0 talks to the engines and returns the :class:`RefitStats`; the others
    return None.
    """
    import torch.distributed as dist

    def gather(obj: Any) -> list:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return sender.send(buckets, rank=rank, gather_object=gather)
