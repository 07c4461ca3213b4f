"""Loading a checkpoint never executes code planted in it."""

from __future__ import annotations

import pickle
import re

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
    from nrl_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"extra_rank0\.pt refers to _?io\.open"):
        worker.load_checkpoint(str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran code from it"


def _plant_metadata(checkpoint, marker) -> None:
    """Replace the DCP ``.metadata`` with a pickle that creates ``marker`` when unpickled, as
    torch's own reader (``pickle.load``) would."""
    with open(checkpoint / ".metadata", "wb") as file:
        pickle.dump(_RunsCode(str(marker)), file)


def test_a_planted_dcp_metadata_does_not_run_and_is_one_line_naming_the_file(tiny_path, tmp_path):
    from nrl_core.errors import ConfigError

    worker = local_worker(make_config(tiny_path))
    checkpoint = tmp_path / "ckpt"
    worker.save_checkpoint(str(checkpoint))
    marker = tmp_path / "pwned"
    _plant_metadata(checkpoint, marker)
    with pytest.raises(ConfigError) as caught:
        worker.load_checkpoint(str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran code from its .metadata"
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert str(checkpoint / ".metadata") in message
    assert re.search(r"refers to _?io\.open", message), message  # _io.open on Python 3.12


def test_a_planted_non_tensor_value_does_not_run(tiny_path, tmp_path):
    """DCP reads non-tensor values (the optimizer's hyper-parameters) with
    ``torch.load(weights_only=False)``; a planted one must be refused, not run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from nrl_core.errors import ConfigError

    worker = local_worker(make_config(tiny_path))
    checkpoint = tmp_path / "ckpt"
    worker.save_checkpoint(str(checkpoint))
    marker = tmp_path / "pwned"
    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    optim_sd["param_groups"][0]["lr"] = _RunsCode(str(marker))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(checkpoint))
    with pytest.raises(ConfigError, match=r"optimizer\.param_groups\.0\.lr is not plain data"):
        worker.load_checkpoint(str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran code from a saved value"


def test_a_checkpoint_written_by_the_worker_still_loads(tiny_path, tmp_path):
    """The allow-list covers what a real dtensor checkpoint uses: a save/load round trip
    gives back the same weights and optimizer state."""
    worker = local_worker(make_config(tiny_path))
    checkpoint = tmp_path / "ckpt"
    worker.save_checkpoint(str(checkpoint))
    saved = {k: v.clone() for k, v in worker.model.state_dict().items()}
    lr = worker.optimizer.param_groups[0]["lr"]
    with torch.no_grad():
        for parameter in worker.model.parameters():
            parameter.add_(1.0)
    worker.optimizer.param_groups[0]["lr"] = 123.0
    worker.load_checkpoint(str(checkpoint))
    for key, value in worker.model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert worker.optimizer.param_groups[0]["lr"] == lr
