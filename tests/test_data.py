"""nrl_core.data: batches."""

from __future__ import annotations

import torch

from nrl_core.data import Batch


def test_concat_pads_the_token_dimension_of_3d_tensors():
    """``[B, T, K]`` tensors (a teacher's top-k) are padded along T, like ``[B, T]`` ones."""
    short = Batch({"ids": torch.ones(1, 2), "topk": torch.ones(1, 2, 3)})
    long = Batch({"ids": torch.ones(1, 4), "topk": torch.ones(1, 4, 3)})
    joined = Batch.concat([short, long])
    assert joined["ids"].shape == (2, 4)
    assert joined["topk"].shape == (2, 4, 3)
    assert joined["topk"][0, 2:].eq(0).all() and joined["topk"][0, :2].eq(1).all()
