"""This rank's converted local state dict of a Hugging Face checkpoint, read from disk once.

GPU review 3, M1: every rank used to call ``from_pretrained(path, dtype=float32)``, convert the
whole model and keep its slice (about 1 TB of host memory on one node for Qwen3-30B-A3B). Now
global rank :data:`READER` (0) reads the checkpoint in its own dtype (``dtype="auto"``) and
converts it whole (:func:`~nrl_megatron.convert.hf_to_megatron`: ``fuse_qkv`` needs a layer's
q, k and v together; experts stay views of the stacked tensors); the converted tensors are then
streamed to every rank one at a time (:mod:`nrl_core.distributed.read_once`), and each rank
keeps only its expert-parallel, pipeline and tensor-parallel slice of each, cast to its own
dtype. Peak host memory: the reader holds the checkpoint in its dtype plus the converted
tensors that are new (fused qkv, dense fc1); every other rank its own slices plus one tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from nrl_megatron.convert import ModelShape, hf_to_megatron, shard_for_ep, shard_for_tp
from nrl_megatron.pipeline import local_state

READER = 0
"""The global rank that reads the checkpoint (one read per run's policy group: on one node,
one per host)."""


def load_local_state(
    path: str,
    shape: ModelShape,
    own: Mapping[str, torch.Tensor],
    *,
    te: bool,
    ep_rank: int,
    ep_size: int,
    pp_rank: int,
    pp_size: int,
    tp_rank: int,
    tp_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` as this rank's local Megatron state dict (local names, each
    tensor in the dtype of ``own[name]``, this rank's model's state dict, on the CPU).

    A collective over the default group: call it on every rank together. ``device`` is where
    tensors travel (``cpu`` with gloo, this rank's CUDA device with NCCL)."""
    from nrl_core.distributed.read_once import broadcast_named_tensors

    source = None
    if dist.get_rank() == READER:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        source = hf_to_megatron(hf.state_dict(), shape, te=te)
        del hf  # the converted dict keeps what it needs
    state = {}
    for name, full in broadcast_named_tensors(source, src=READER, device=device):
        # The three slicings of the old whole-model path, applied to one tensor at a time.
        mine = shard_for_ep({name: full}, ep_rank, ep_size, shape)
        mine = local_state(mine, pp_rank, shape.num_layers, pp_size)
        for local_name, tensor in mine.items():
            sliced = shard_for_tp(local_name, tensor, tp_rank, tp_size)
            dtype = own[local_name].dtype if local_name in own else sliced.dtype
            # A copy, so the full tensor is freed before the next one arrives.
            state[local_name] = sliced.to("cpu", dtype, copy=True)
    return state
