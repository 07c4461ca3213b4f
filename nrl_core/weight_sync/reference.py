"""A reference endpoint: a CPU Hugging Face model that sends and receives weights, against which
both ends of every transport are tested."""

from __future__ import annotations

from nrl_core.weight_sync.interface import BucketHandle, BucketMeta, RefitStats, WeightSyncError
from nrl_core.weight_sync.packing import iter_buckets, receive_into
from nrl_core.weight_sync.sender import WeightSender


class StateDictEndpoint:
    """A Hugging Face model on CPU that can send its weights (like a policy) and receive
    buckets (like an engine): the reference both ends of a transport are tested against, and a
    template for a new engine's :class:`~nrl_core.interfaces.WeightSync`.

    Built as ``StateDictEndpoint(model_path, seed)``; a non-None ``seed`` re-initialises the
    weights randomly, so two endpoints start different.
    """

    def __init__(self, model_path: str, seed: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        self.updates = 0

    def push_weights(self, sender: WeightSender, bucket_bytes: int) -> RefitStats | None:
        """Send this model's state dict through ``sender`` (as a policy rank 0 would)."""
        items = ((k, v.detach()) for k, v in self.model.state_dict().items())
        return sender.send(iter_buckets(items, bucket_bytes))

    def begin_weight_update(self) -> None:
        self._seen: set[str] = set()

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        state = self.model.state_dict()

        def load(named: list) -> None:
            for name, tensor in named:
                if name not in state:
                    raise WeightSyncError(f"unknown parameter {name!r} in a weight bucket")
                state[name].copy_(tensor)
                self._seen.add(name)

        return receive_into(meta, handle, load)

    def finish_weight_update(self) -> None:
        self.updates += 1

    def digest(self) -> dict[str, str]:
        """sha256 of each tensor's bytes: equal digests mean bit-identical weights."""
        import hashlib

        import torch

        return {
            k: hashlib.sha256(
                v.detach().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for k, v in self.model.state_dict().items()
        }
