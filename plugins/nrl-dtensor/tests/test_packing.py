"""Sequence packing in the dtensor policy: packed and padded training give the same losses,
gradients and logprobs, for every loss, and packed samples never see each other.

The reference is the padded path (``policy.sequence_packing=false``, count micro batches); the
packed runs vary the bin budget (default, small, one sample per bin) and the micro batch size.
Tolerances: float32 on CPU, rel <= 1e-5 (observed differences are ~1e-7: the kernels sum in a
different order on a packed row than on a padded one).
"""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch
from nrl_dtensor.config import DTensorConfig

from nrl_core.data import Batch
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.losses.clipped_pg import ClippedPGLoss
from nrl_core.losses.config import ClippedPGConfig, DistillationLossConfig
from nrl_core.losses.distillation import DistillationLoss
from nrl_core.losses.nll import NLLLoss
from nrl_core.losses.preference import DPOLoss
from nrl_core.packing import PackedSequences
from nrl_core.policy import Policy
from nrl_core.testing.batches import make_batch

RTOL = 1e-5
TOPK = 4


def make_config(path, *, packing, mbs=4, budget=None, max_len=512):
    from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig

    policy = PolicyConfig(
        model_name=str(path),
        train_micro_batch_size=mbs,
        micro_batch_token_budget=budget,
        logprob_batch_size=4,
        max_total_sequence_length=max_len,
        sequence_packing=packing,
        # Plain SGD, no clipping: the update is the gradient, compared exactly below.
        max_grad_norm=0.0,
        optimizer=OptimizerConfig(name="sgd", lr=1.0),
    )
    return GRPOConfig(seed=0, policy=policy, generation=GenerationConfig(temperature=1.0))


class RecordingWorker:
    """Builds the real single-process worker and records what reaches it: whether micro
    batches came packed, and the gradients each optimizer step applied."""

    def __init__(self, config, options=None):
        from nrl_dtensor.worker import DTensorPolicyWorker

        from nrl_core.interfaces import ComponentContext

        ctx = ComponentContext(config=config, rank=0, world_size=1, seed=config.seed)
        self.worker = DTensorPolicyWorker(options or DTensorConfig(), ctx)
        self.kinds: list[str] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        worker = self.worker
        forward_backward, compute_logprobs, step = (
            worker.forward_backward,
            worker.compute_logprobs,
            worker.optimizer_step,
        )

        def record(micro_batch):
            self.kinds.append("packed" if isinstance(micro_batch, PackedSequences) else "padded")

        def fb(micro_batch, loss):
            record(micro_batch)
            return forward_backward(micro_batch, loss)

        def lp(micro_batch, **kwargs):
            record(micro_batch)
            return compute_logprobs(micro_batch, **kwargs)

        def optimizer_step():
            self.grads.append(
                {n: p.grad.detach().clone() for n, p in worker.model.named_parameters()}
            )
            return step()

        worker.forward_backward, worker.compute_logprobs = fb, lp
        worker.optimizer_step = optimizer_step

    def policy(self, config) -> Policy:
        return Policy.from_config(InProcessGroup(self.worker), config.policy)


def long_tailed_batch(num: int, seed: int, pairs: bool = False) -> Batch:
    """Lengths from 4 to 60 tokens, with the keys every loss below reads (``pairs``: rows
    ``2i``, ``2i + 1`` are a DPO pair)."""
    batch = make_batch(num, seed=seed, min_len=4, max_len=60)
    g = torch.Generator().manual_seed(seed + 100)
    width = batch["input_ids"].shape[1]
    mask = batch["loss_mask"]
    batch["advantages"] = torch.randn(num, generator=g)[:, None].expand(num, width).clone()
    # Stand-ins for old/reference/generation logprobs a little off the policy's, so ratios
    # differ from 1 and clipping, the KL term and the IS correction all act.
    for key in ("prev_logprobs", "ref_logprobs", "gen_logprobs"):
        batch[key] = (-2.0 + 0.3 * torch.randn(num, width, generator=g)) * mask
    ids = torch.randint(7, 100, (num, width, TOPK), generator=g)
    batch["teacher_topk_ids"] = ids * mask.long()[:, :, None]
    batch["teacher_topk_logprobs"] = torch.log_softmax(
        torch.randn(num, width, TOPK, generator=g), -1
    ) * mask[:, :, None] + torch.log(torch.tensor(0.9))
    if pairs:
        assert num % 2 == 0
    return batch


LOSSES = {
    "clipped_pg-token_mean": lambda: ClippedPGLoss(
        ClippedPGConfig(aggregation="token_mean", kl_coef=0.05)
    ),
    "clipped_pg-seq_mean_token_mean": lambda: ClippedPGLoss(
        ClippedPGConfig(aggregation="seq_mean_token_mean", kl_coef=0.05)
    ),
    "clipped_pg-seq_mean_token_sum_norm": lambda: ClippedPGLoss(
        ClippedPGConfig(aggregation="seq_mean_token_sum_norm", kl_coef=0.05)
    ),
    "clipped_pg-gspo": lambda: ClippedPGLoss(
        ClippedPGConfig(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
    ),
    "nll": NLLLoss,
    "dpo": DPOLoss,
    "distillation": lambda: DistillationLoss(DistillationLossConfig(kl_type="mixed")),
}


def run(path, batch, loss, **config_kwargs):
    """Logprobs before, the step's metrics and gradients, and logprobs after one step."""
    config = make_config(path, **config_kwargs)
    recorder = RecordingWorker(config)
    policy = recorder.policy(config)
    before = policy.get_logprobs(batch)
    metrics = policy.train(batch, loss)
    after = policy.get_logprobs(batch)
    return before, metrics, recorder.grads[0], after, recorder.kinds


def assert_same(got, expected, loss_name):
    before, metrics, grads, after, kinds = got
    e_before, e_metrics, e_grads, e_after, e_kinds = expected
    assert set(kinds) == {"packed"} and set(e_kinds) == {"padded"}
    torch.testing.assert_close(before, e_before, rtol=RTOL, atol=1e-6)
    assert metrics.keys() == e_metrics.keys()
    for key, value in e_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-7), (loss_name, key)
    flat = torch.cat([g.flatten() for g in grads.values()])
    e_flat = torch.cat([e_grads[n].flatten() for n in grads])
    assert e_flat.norm() > 0
    assert float((flat - e_flat).norm() / e_flat.norm()) <= RTOL, loss_name
    torch.testing.assert_close(after, e_after, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("loss_name", LOSSES)
def test_packed_training_matches_padded_for_every_loss(tiny_path, loss_name):
    batch = long_tailed_batch(8, seed=3, pairs=loss_name == "dpo")
    expected = run(tiny_path, batch, LOSSES[loss_name](), packing=False)
    # Default bins (4 x 512 tokens: one bin) and small ones (several bins, pairs kept whole).
    for budget in (None, 90):
        got = run(tiny_path, batch, LOSSES[loss_name](), packing=True, budget=budget)
        assert_same(got, expected, f"{loss_name} budget={budget}")


@pytest.mark.parametrize(("mbs", "budget"), [(1, None), (2, 40), (8, 1)])
def test_packed_matches_padded_over_micro_batch_and_budget_variations(tiny_path, mbs, budget):
    batch = long_tailed_batch(8, seed=5)
    loss = LOSSES["clipped_pg-token_mean"]
    # The padded reference with the same split options (token budget: the longest-first split).
    expected = run(tiny_path, batch, loss(), packing=False, mbs=mbs, budget=budget)
    got = run(tiny_path, batch, loss(), packing=True, mbs=mbs, budget=budget)
    assert_same(got, expected, f"mbs={mbs} budget={budget}")


def test_auto_packs_on_dtensor_and_false_does_not(tiny_path):
    for mode, packed in (("auto", True), (True, True), (False, False)):
        config = make_config(tiny_path, packing=mode)
        recorder = RecordingWorker(config)
        policy = recorder.policy(config)
        assert policy.packing is packed
        policy.get_logprobs(make_batch(3, seed=0))
        assert set(recorder.kinds) == {"packed" if packed else "padded"}


def test_no_attention_across_packed_samples(tiny_path):
    """A 3-token and a 300-token sample in one bin: changing either one's tokens leaves the
    other's logprobs as they were, and both match their padded logprobs."""
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(7, 100, (300,), generator=g)
    short_ids = torch.randint(7, 100, (3,), generator=g)

    def batch_of(short, long):
        ids = torch.zeros((2, 300), dtype=torch.long)
        ids[0, :3], ids[1] = short, long
        return Batch({"input_ids": ids, "lengths": torch.tensor([3, 300])})

    config = make_config(tiny_path, packing=True, max_len=512)
    recorder = RecordingWorker(config)
    policy = recorder.policy(config)
    base = policy.get_logprobs(batch_of(short_ids, long_ids))
    # One bin: the long sample first (first-fit decreasing), the short one after it, where a
    # leak from the long one would show.
    assert recorder.kinds == ["packed"]

    changed_long = long_ids.clone()
    changed_long[:-1] = torch.randint(7, 100, (299,), generator=g)
    got = policy.get_logprobs(batch_of(short_ids, changed_long))
    torch.testing.assert_close(got[0, :3], base[0, :3], rtol=0, atol=1e-6)
    assert (got[1, 1:300] - base[1, 1:300]).abs().max() > 1e-2  # the change did change it

    changed_short = torch.randint(7, 100, (3,), generator=g)
    got = policy.get_logprobs(batch_of(changed_short, long_ids))
    torch.testing.assert_close(got[1], base[1], rtol=0, atol=1e-6)

    padded = Policy.from_config(
        InProcessGroup(RecordingWorker(config).worker),
        attrs.evolve(config.policy, sequence_packing=False),
    )
    torch.testing.assert_close(
        base, padded.get_logprobs(batch_of(short_ids, long_ids)), rtol=RTOL, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", ["clipped_pg-token_mean", "dpo", "distillation"])
def test_two_ranks_packed_match_one_rank_padded(tiny_path, start_group, loss_name):
    """Two data-parallel ranks (replicated weights, the CPU default) packing bins of 100
    tokens against one rank's padded micro batches."""
    from nrl_core.interfaces import ComponentContext

    batch = long_tailed_batch(8, seed=7, pairs=loss_name == "dpo")
    e_before, e_metrics, e_grads, e_after, _ = run(
        tiny_path, batch, LOSSES[loss_name](), packing=False
    )

    config = make_config(tiny_path, packing=True, budget=100)
    ctx = ComponentContext(config=config, rank=0, world_size=1, seed=config.seed)
    group = start_group("_helpers:InspectableWorker", (DTensorConfig(), ctx))
    policy = Policy.from_config(group, config.policy)
    assert policy.packing
    torch.testing.assert_close(policy.get_logprobs(batch), e_before, rtol=RTOL, atol=1e-6)
    metrics = policy.train(batch, LOSSES[loss_name]())
    for key, value in e_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-7), key
    grads = group.run_all("last_gradients")
    e_flat = torch.cat([g.flatten() for g in e_grads.values()])
    for rank_grads in grads:
        flat = torch.cat([rank_grads[n].flatten() for n in e_grads])
        assert float((flat - e_flat).norm() / e_flat.norm()) <= RTOL
    torch.testing.assert_close(policy.get_logprobs(batch), e_after, rtol=RTOL, atol=1e-6)


def _attention_inputs(device, dtype, lengths=(5, 1, 17, 9)):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, 4, total, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(1, 2, total, 16, generator=g).to(device, dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu.to(device)


def _per_sample_reference(q, k, v, cu):
    """Causal attention of each sample alone, in float32: ``[1, total, heads, dim]``."""
    out = []
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (t[:, :, start:end].float() for t in (q, k, v))
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (ks, vs))
        out.append(
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(
                1, 2
            )
        )
    return torch.cat(out, dim=1)


def test_packed_attention_on_cpu_is_per_sample_causal_attention():
    from types import SimpleNamespace

    from nrl_dtensor.packing import packed_attention

    q, k, v, cu = _attention_inputs("cpu", torch.float32)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    out, _ = packed_attention(module, q, k, v, cu, scaling=16**-0.5)
    torch.testing.assert_close(out, _per_sample_reference(q, k, v, cu), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="sequence_packing=false"):
        packed_attention(module, q, k, v, cu, sliding_window=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen kernel path")
def test_packed_attention_on_gpu_runs_one_varlen_kernel():
    from types import SimpleNamespace

    from nrl_dtensor.packing import packed_attention

    q, k, v, cu = _attention_inputs("cuda", torch.bfloat16)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    out, _ = packed_attention(module, q, k, v, cu, scaling=16**-0.5)
    expected = _per_sample_reference(q, k, v, cu)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_similar_lengths_share_one_attention_call():
    from nrl_core.packing import similar_length_groups

    assert similar_length_groups([61] * 4) == [[0, 1, 2, 3]]
    # 300 and 290 together (padding 3%), the short ones apart from them.
    assert similar_length_groups([3, 300, 290, 4]) == [[1, 2], [3, 0]]


def _varlen_attn_torch_2_11(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    is_causal=False,
    return_aux=None,
    scale=None,
):
    """The signature of torch 2.11's ``varlen_attn`` (the GPU machine's torch): no window_size,
    no enable_gqa. The H100 run of 2026-11-26 failed with TypeError on enable_gqa."""


def _varlen_attn_torch_2_14(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """The signature of the locked torch's ``varlen_attn``."""


@pytest.mark.gpu_sim
def test_varlen_options_follow_the_installed_torchs_signature():
    """Only keywords the installed ``varlen_attn`` takes; grouped-query attention by repeating
    the key/value heads where it cannot (query head h reads key/value head h // repeat, as
    SDPA's enable_gqa does); a sliding window refused by name where it has no window_size."""
    from nrl_dtensor.packing import varlen_options

    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    k_old, v_old, old = varlen_options(_varlen_attn_torch_2_11, q, k, v, 0.5, (-1, 0))
    assert old == {"scale": 0.5, "is_causal": True}
    assert k_old.shape[1] == v_old.shape[1] == 4
    by_hand = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_old.transpose(0, 1), v_old.transpose(0, 1), is_causal=True
    )
    gqa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(by_hand, gqa)
    k_new, _, new = varlen_options(_varlen_attn_torch_2_14, q, k, v, 0.5, (-1, 0))
    assert new == {"scale": 0.5, "window_size": (-1, 0), "enable_gqa": True}
    assert k_new is k
    with pytest.raises(NotImplementedError, match="sequence_packing=false"):
        varlen_options(_varlen_attn_torch_2_11, q, k, v, 0.5, (15, 0))
