"""Loading a checkpoint never executes code planted in it."""

from __future__ import annotations

import pickle

import pytest
import torch
from test_dtensor import local_worker, make_config


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the shape of every pickle exploit."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_in_the_rank_state_does_not_run(tiny_path, tmp_path):
    worker = local_worker(make_config(tiny_path))
    checkpoint = tmp_path / "ckpt"
    worker.save_checkpoint(str(checkpoint))
    marker = tmp_path / "pwned"
    # Written the way torch writes checkpoints, so that a loader that unpickles would run it.
    torch.save({"scheduler": _RunsCode(str(marker))}, checkpoint / "extra_rank0.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        worker.load_checkpoint(str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran code from it"
