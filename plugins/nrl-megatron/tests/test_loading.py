"""Loading the megatron policy on 2 real gloo ranks (spawned): the Hugging Face checkpoint is
read from disk by one rank only (GPU review 3, M1: every rank used to read it in float32), and
both tensor-parallel ranks still hold exactly the checkpoint's weights."""

from __future__ import annotations

from _megatron_helpers import assert_every_rank_streams_the_checkpoint, requires_megatron

from nrl_core.config.schema import GRPOConfig, PolicyConfig
from nrl_core.interfaces import ComponentContext

pytestmark = requires_megatron


def test_one_rank_reads_the_checkpoint_and_both_tp_ranks_hold_it(tiny_path, pool2, start_group):
    from nrl_megatron.config import MegatronConfig

    config = GRPOConfig(seed=0, policy=PolicyConfig(backend="megatron", model_name=str(tiny_path)))
    options = MegatronConfig(tensor_model_parallel_size=2)
    group = start_group(
        pool2,
        "_megatron_helpers:CountingReadsWorker",
        (options, ComponentContext(config=config, seed=0)),
    )
    # Rank 0 opens the checkpoint; rank 1 never does (policy, then the frozen reference).
    assert [n > 0 for n in group.run_all("reads")] == [True, False]
    assert [n > 0 for n in group.run_all("build_reference")] == [True, False]
    assert_every_rank_streams_the_checkpoint(group, tiny_path)
