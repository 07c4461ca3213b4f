"""Loading the policy on 2 real gloo ranks (spawned processes): the Hugging Face checkpoint is
read from disk by one rank only (GPU review 3, M1: it used to be read, in float32, by every
rank), and every rank still ends with exactly the checkpoint's weights, for the policy and the
frozen reference, replicated or FSDP2-sharded."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from _helpers import build_counting_reads
from nrl_dtensor.config import DTensorConfig
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

LAYOUTS = {
    "replicate": DTensorConfig(),
    "shard-blocks": DTensorConfig(data_parallel="shard", fsdp_units="blocks"),
    # A reward model: a fresh scalar head (not in the checkpoint), drawn once on the reader.
    "shard-scalar-head": DTensorConfig(data_parallel="shard", head="scalar"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_rank_reads_the_checkpoint_and_every_rank_holds_it(tiny_path, tmp_path, layout):
    options = LAYOUTS[layout]
    mp.spawn(
        build_counting_reads,
        args=(_free_port(), str(tiny_path), options, str(tmp_path)),
        nprocs=2,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["sharded"] for r in results] == [layout != "replicate"] * 2
    # Rank 0 reads (policy and reference once each); rank 1 never opens the file.
    assert [r["policy_reads"] > 0 for r in results] == [True, False]
    assert [r["reference_reads"] > 0 for r in results] == [True, False]
    saved = load_file(str(tiny_path / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    expected_buffers = dict(AutoModelForCausalLM.from_pretrained(tiny_path).named_buffers())
    if layout == "shard-scalar-head":
        # The head replaces lm_head; its draw is the single-process worker's (seed 0).
        del saved["lm_head.weight"]
        hidden = saved["model.embed_tokens.weight"].shape[1]
        saved["score.weight"] = torch.empty(1, hidden).normal_(
            0.0, 1.0 / (hidden + 1) ** 0.5, generator=torch.Generator().manual_seed(0)
        )
    for result in results:
        for weights in (result["weights"], result["reference"]):
            assert set(saved) <= set(weights)
            for name, tensor in saved.items():
                assert torch.equal(weights[name], tensor.float()), name
        # Non-persistent buffers (rotary frequencies) are real, not meta or garbage.
        assert result["buffers"].keys() == expected_buffers.keys()
        for name, buffer in result["buffers"].items():
            assert torch.equal(buffer, expected_buffers[name]), name
