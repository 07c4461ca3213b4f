"""Sequence packing in the megatron policy (Megatron's THD layout, ``PackedSeqParams``): packed
and padded training give the same losses, metrics, updated weights and logprobs, on 1 rank and
under TP=2 and DP=2, and packed samples never see each other.

On CPU the local spec's core attention is :class:`nrl_megatron.model.SDPAttention`, whose
packed path runs causal SDPA within each sample (Megatron-Core 0.16.1's own local
``DotProductAttention`` asserts ``packed_seq_params is None``); RoPE goes through Megatron's
unfused THD path (``_apply_rotary_pos_emb_thd``), restarting at every boundary. Transformer
Engine's THD kernels need CUDA: see the ``gpu`` test at the end and the megatron stage of
``benchmarks/gpu_acceptance.py``.

Tolerances, float32 on CPU: rel <= 1e-5, as in the dtensor packing tests.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from _megatron_helpers import requires_megatron

from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig
from nrl_core.data import Batch
from nrl_core.interfaces import ComponentContext
from nrl_core.losses.clipped_pg import ClippedPGLoss
from nrl_core.losses.config import ClippedPGConfig
from nrl_core.losses.nll import NLLLoss
from nrl_core.losses.preference import DPOLoss
from nrl_core.policy import Policy
from nrl_core.testing.batches import make_batch

pytestmark = requires_megatron

RTOL = 1e-5
WORKER = "_megatron_helpers:RecordingMegatronWorker"


def make_config(path, *, packing, mbs=4, budget=None, max_len=512):
    policy = PolicyConfig(
        backend="megatron",
        model_name=str(path),
        train_micro_batch_size=mbs,
        micro_batch_token_budget=budget,
        logprob_batch_size=4,
        max_total_sequence_length=max_len,
        sequence_packing=packing,
        # Plain SGD, no clipping: the update is the (averaged) gradient, compared below.
        max_grad_norm=0.0,
        optimizer=OptimizerConfig(name="sgd", lr=1.0),
    )
    return GRPOConfig(seed=0, policy=policy, generation=GenerationConfig(temperature=0.7))


def options(tp=1):
    from nrl_megatron.config import MegatronConfig

    return MegatronConfig(tensor_model_parallel_size=tp)


def long_tailed_batch(num: int, seed: int) -> Batch:
    """Lengths 4-60 with what the losses below read (rows 2i, 2i+1 pair up for DPO)."""
    batch = make_batch(num, seed=seed, min_len=4, max_len=60)
    g = torch.Generator().manual_seed(seed + 100)
    width = batch["input_ids"].shape[1]
    mask = batch["loss_mask"]
    batch["advantages"] = torch.randn(num, generator=g)[:, None].expand(num, width).clone()
    for key in ("prev_logprobs", "ref_logprobs", "gen_logprobs"):
        batch[key] = (-2.0 + 0.3 * torch.randn(num, width, generator=g)) * mask
    return batch


LOSSES = {
    "clipped_pg-token_mean": lambda: ClippedPGLoss(
        ClippedPGConfig(aggregation="token_mean", kl_coef=0.05)
    ),
    "clipped_pg-seq_mean_token_mean": lambda: ClippedPGLoss(
        ClippedPGConfig(aggregation="seq_mean_token_mean", kl_coef=0.05)
    ),
    "clipped_pg-gspo": lambda: ClippedPGLoss(
        ClippedPGConfig(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
    ),
    "nll": NLLLoss,
    "dpo": DPOLoss,
}


def run(pool, start_group, path, batch, loss, *, tp=1, name="policy", **config_kwargs):
    """Logprobs before, the step's metrics, the weights and the logprobs after one step, and
    what the ranks saw (packed or padded)."""
    config = make_config(path, **config_kwargs)
    group = start_group(pool, WORKER, (options(tp), ComponentContext(config=config, seed=0)), name)
    policy = Policy.from_config(group, config.policy)
    before = policy.get_logprobs(batch)
    metrics = policy.train(batch, loss)
    weights = group.run_all("weights")[0]
    after = policy.get_logprobs(batch)
    kinds = {kind for seen in group.run_all("seen") for kind in seen}
    return before, metrics, weights, after, kinds


def assert_same(got, expected, initial, what):
    before, metrics, weights, after, kinds = got
    e_before, e_metrics, e_weights, e_after, e_kinds = expected
    assert kinds == {"packed"} and e_kinds == {"padded"}, what
    torch.testing.assert_close(before, e_before, rtol=RTOL, atol=1e-6)
    assert metrics.keys() == e_metrics.keys()
    for key, value in e_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-7), (what, key)
    # The update (SGD, lr 1: the gradient), packed against padded.
    update = torch.cat([(weights[n] - initial[n]).flatten() for n in initial])
    e_update = torch.cat([(e_weights[n] - initial[n]).flatten() for n in initial])
    assert e_update.norm() > 0
    assert float((update - e_update).norm() / e_update.norm()) <= RTOL, what
    torch.testing.assert_close(after, e_after, rtol=RTOL, atol=1e-6)


@pytest.fixture(scope="module")
def initial(tiny_path):
    from safetensors.torch import load_file

    return load_file(str(tiny_path / "model.safetensors"))


@pytest.mark.parametrize("loss_name", LOSSES)
def test_packed_training_matches_padded_for_every_loss(
    tiny_path, initial, pool1, start_group, loss_name
):
    batch = long_tailed_batch(8, seed=3)
    loss = LOSSES[loss_name]
    expected = run(pool1, start_group, tiny_path, batch, loss(), packing=False, name="padded")
    # Default bins (4 x 512 tokens: one bin) and small ones (several bins, pairs kept whole).
    for budget in (None, 90):
        got = run(
            pool1, start_group, tiny_path, batch, loss(), packing=True, budget=budget,
            name=f"packed{budget}",
        )  # fmt: skip
        assert_same(got, expected, initial, f"{loss_name} budget={budget}")


@pytest.mark.parametrize(("mbs", "budget"), [(1, None), (8, 1)])
def test_packed_matches_padded_over_micro_batch_and_budget_variations(
    tiny_path, initial, pool1, start_group, mbs, budget
):
    batch = long_tailed_batch(8, seed=5)
    loss = LOSSES["clipped_pg-token_mean"]
    kwargs = {"mbs": mbs, "budget": budget}
    expected = run(pool1, start_group, tiny_path, batch, loss(), packing=False, **kwargs)
    got = run(pool1, start_group, tiny_path, batch, loss(), packing=True, name="p", **kwargs)
    assert_same(got, expected, initial, f"mbs={mbs} budget={budget}")


def test_auto_packs_on_megatron_and_false_does_not(tiny_path, pool1, start_group):
    for mode, packed in (("auto", True), (True, True), (False, False)):
        config = make_config(tiny_path, packing=mode)
        context = ComponentContext(config=config, seed=0)
        group = start_group(pool1, WORKER, (options(), context), name=f"auto-{mode}")
        policy = Policy.from_config(group, config.policy)
        assert policy.packing is packed
        policy.get_logprobs(make_batch(3, seed=0))
        assert set(group.run_all("seen")[0]) == {"packed" if packed else "padded"}


def test_no_attention_across_packed_samples(tiny_path, pool1, start_group):
    """A 3-token and a 300-token sample in one bin: changing either one's tokens leaves the
    other's logprobs as they were, and both match their padded logprobs."""
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(7, 100, (300,), generator=g)
    short_ids = torch.randint(7, 100, (3,), generator=g)

    def batch_of(short, long):
        ids = torch.zeros((2, 300), dtype=torch.long)
        ids[0, :3], ids[1] = short, long
        return Batch({"input_ids": ids, "lengths": torch.tensor([3, 300])})

    config = make_config(tiny_path, packing=True)
    context = ComponentContext(config=config, seed=0)
    group = start_group(pool1, WORKER, (options(), context), name="leak")
    policy = Policy.from_config(group, config.policy)
    base = policy.get_logprobs(batch_of(short_ids, long_ids))
    # One bin: the long sample first (first-fit decreasing), the short one after it, where a
    # leak from the long one would show.
    assert group.run_all("seen")[0] == ["packed"]

    changed_long = long_ids.clone()
    changed_long[:-1] = torch.randint(7, 100, (299,), generator=g)
    got = policy.get_logprobs(batch_of(short_ids, changed_long))
    torch.testing.assert_close(got[0, :3], base[0, :3], rtol=0, atol=1e-6)
    assert (got[1, 1:300] - base[1, 1:300]).abs().max() > 1e-2  # the change did change it

    changed_short = torch.randint(7, 100, (3,), generator=g)
    got = policy.get_logprobs(batch_of(changed_short, long_ids))
    torch.testing.assert_close(got[1], base[1], rtol=0, atol=1e-6)

    padded_config = make_config(tiny_path, packing=False)
    padded = Policy.from_config(
        start_group(pool1, WORKER, (options(), ComponentContext(config=padded_config, seed=0))),
        padded_config.policy,
    )
    torch.testing.assert_close(
        base, padded.get_logprobs(batch_of(short_ids, long_ids)), rtol=RTOL, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 1])
@pytest.mark.parametrize("loss_name", ["clipped_pg-token_mean", "dpo"])
def test_two_ranks_packed_match_one_rank_padded(
    tiny_path, initial, pool1, pool2, start_group, tp, loss_name
):
    """TP=2 (both ranks pack the whole batch) or DP=2 (each packs its half into bins of 100
    tokens) against one rank's padded micro batches."""
    batch = long_tailed_batch(8, seed=7)
    loss = LOSSES[loss_name]
    expected = run(pool1, start_group, tiny_path, batch, loss(), packing=False, name="one")
    got = run(pool2, start_group, tiny_path, batch, loss(), tp=tp, packing=True, budget=100)
    assert_same(got, expected, initial, f"tp={tp} {loss_name}")


def test_sdp_attention_packed_path_is_per_sample_causal_attention(pool1, start_group):
    probe = start_group(pool1, "_megatron_helpers:ParallelStateProbe", (), name="attn")
    got, want, leaky = probe.run_all(packed_attention_against_reference)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (leaky - want).abs().max() > 1e-3  # one causal attention over the row differs


def packed_attention_against_reference(_probe):
    """In a rank with ``parallel_state`` up: SDPAttention on a THD row of 4 samples (GQA 4/2
    heads), per-sample causal attention, and causal attention over the whole row."""
    import itertools

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nrl_megatron.model import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16
    )
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self").eval()
    lengths = [5, 1, 17, 9, 9]
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=g)
    k, v = (torch.randn(total, 2, 16, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=17, max_seqlen_kv=17
    )
    got = attention(q, k, v, None, packed_seq_params=params)
    want = []
    for start, end in itertools.pairwise(cu.tolist()):
        qs, ks, vs = (t[start:end, None] for t in (q, k, v))  # [s, b=1, heads, dim]
        want.append(attention(qs, ks, vs, None)[:, 0])
    leaky = attention(q[:, None], k[:, None], v[:, None], None)[:, 0]
    return got, torch.cat(want), leaky


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: Transformer Engine's THD attention (TEDotProductAttention with "
    "PackedSeqParams) has no CPU kernel (gpu_acceptance.py's megatron stage packs on the local "
    "spec: TE is not in the GPU bundle)",
)
def test_transformer_engine_thd_packing_matches_padded(tiny_path, pool1, start_group):
    pytest.importorskip("transformer_engine", reason="Transformer Engine not installed (extra te)")
    from nrl_megatron.config import MegatronConfig

    batch = long_tailed_batch(8, seed=11)
    results = {}
    for packing in (False, True):
        config = make_config(tiny_path, packing=packing)
        config = attrs.evolve(config, policy=attrs.evolve(config.policy, precision="bfloat16"))
        group = start_group(
            pool1,
            WORKER,
            (MegatronConfig(transformer_engine=True), ComponentContext(config=config, seed=0)),
            name=f"te-{packing}",
        )
        policy = Policy.from_config(group, config.policy)
        results[packing] = policy.get_logprobs(batch)
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=5e-2)
