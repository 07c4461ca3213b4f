"""Unpickling with an allow-list, and loading torch.distributed.checkpoint folders with it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from nrl_core.errors import ConfigError
from nrl_core.safe_pickle import (
    UnsafePickleError,
    dcp_load,
    dcp_metadata_allowed,
    load_dcp_metadata,
    restricted_load,
)


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the shape of every pickle exploit."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_global_outside_the_allow_list_is_refused_before_it_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    path = tmp_path / "data.pkl"
    path.write_bytes(pickle.dumps({"x": [_RunsCode(str(marker))]}, protocol=protocol))
    with pytest.raises(UnsafePickleError) as caught:
        restricted_load(path, lambda module, name: False)
    assert not marker.exists()
    assert isinstance(caught.value, ConfigError)  # the CLI's one line, exit code 2
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(path) in message and "io.open" in message


def test_plain_data_and_allowed_globals_load(tmp_path):
    path = tmp_path / "data.pkl"
    value = {"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {3}, "size": torch.Size([2, 3])}
    path.write_bytes(pickle.dumps(value))
    assert restricted_load(path, lambda module, name: (module, name) == ("torch", "Size")) == value
    with pytest.raises(UnsafePickleError, match=r"refers to torch\.Size"):
        restricted_load(path, lambda module, name: False)


def test_a_truncated_pickle_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "data.pkl"
    path.write_bytes(pickle.dumps(list(range(100)))[:-20])
    with pytest.raises(UnsafePickleError, match=r"data\.pkl is not a readable pickle") as caught:
        restricted_load(path, lambda module, name: False)
    assert len(str(caught.value).splitlines()) == 1


def test_the_dcp_allow_list_takes_dtypes_but_not_torch_functions():
    assert dcp_metadata_allowed("torch", "bfloat16")
    assert dcp_metadata_allowed("torch.distributed.checkpoint.metadata", "Metadata")
    for module, name in [
        ("torch", "load"),
        ("torch", "_C"),
        ("os", "system"),
        ("builtins", "eval"),
    ]:
        assert not dcp_metadata_allowed(module, name), (module, name)


def _save(folder, state) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder))


def _state() -> dict:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "h": torch.ones(4, dtype=torch.bfloat16),
        "i": torch.arange(3),
        "groups": [{"lr": 0.25, "betas": (0.9, 0.99), "params": ["w", "h"], "fused": None}],
    }


def test_a_dcp_checkpoint_round_trips_through_the_restricted_reader(tmp_path):
    _save(tmp_path / "ckpt", _state())
    metadata = load_dcp_metadata(tmp_path / "ckpt")
    assert "w" in metadata.state_dict_metadata
    loaded = {
        "w": torch.zeros(2, 3),
        "h": torch.zeros(4, dtype=torch.bfloat16),
        "i": torch.zeros(3, dtype=torch.int64),
        "groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [], "fused": True}],
    }
    dcp_load(loaded, tmp_path / "ckpt")
    expected = _state()
    for key in ("w", "h", "i"):
        assert torch.equal(loaded[key], expected[key]), key
    assert loaded["groups"] == expected["groups"]


def test_a_planted_dcp_metadata_is_refused_without_running(tmp_path):
    _save(tmp_path / "ckpt", _state())
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(UnsafePickleError, match=r"ckpt/\.metadata refers to _?io\.open"):
        dcp_load({"w": torch.zeros(2, 3)}, tmp_path / "ckpt")
    assert not marker.exists()


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    _save(tmp_path / "ckpt", _state())
    metadata = load_dcp_metadata(tmp_path / "ckpt")
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path="../../secret.distcp")
        for index, info in metadata.storage_data.items()
    }
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafePickleError, match=r"outside the checkpoint folder"):
        load_dcp_metadata(tmp_path / "ckpt")


def test_a_planted_value_in_the_data_file_is_refused_without_running(tmp_path):
    """DCP's own planner loads non-tensor values with ``weights_only=False``."""
    marker = tmp_path / "pwned"
    state = _state()
    state["groups"][0]["lr"] = _RunsCode(str(marker))
    _save(tmp_path / "ckpt", state)
    with pytest.raises(UnsafePickleError, match=r"groups\.0\.lr is not plain data"):
        dcp_load(_state(), tmp_path / "ckpt")
    assert not marker.exists()


def test_importing_the_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, nrl_core.safe_pickle; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
