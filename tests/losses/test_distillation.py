"""The on-policy distillation loss: hand-computed divergences, closed-form gradients, the
aggregation contract (micro batches, data-parallel shards, padding), garbage in masked
positions, the missing-key error, the registration and the loss conformance suite."""

from __future__ import annotations

import math
import subprocess
import sys

import attrs
import pytest
import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats, LossFunction
from nrl_core.losses.config import DistillationLossConfig
from nrl_core.losses.distillation import TAIL_FLOOR, DistillationLoss
from nrl_core.plugins import PluginHost
from nrl_core.testing.conformance import LossConformance, random_batch
from nrl_core.training import reduce_metrics
from tests.losses.helpers import T, global_stats

LOG = math.log
NAN, INF = float("nan"), float("inf")
KL_TYPES = ("reverse", "forward", "mixed")


def logs(*probs: float) -> list[float]:
    return [LOG(p) for p in probs]


def kl(p: list[float], q: list[float]) -> float:
    """Plain-Python KL(p || q) of two explicit distributions."""
    return sum(pi * LOG(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def combine(kl_type: str, reverse: float, forward: float, weight: float = 0.5) -> float:
    return {
        "reverse": reverse,
        "forward": forward,
        "mixed": weight * forward + (1 - weight) * reverse,
    }[kl_type]


# Two positions with K = 2 (so the vocabulary is larger than K and the tail bucket matters):
# the student's and the teacher's probabilities of the teacher's two tokens, tail = the rest.
STUDENT_A, TEACHER_A = [0.6, 0.3], [0.5, 0.3]  # tails 0.1 and 0.2
STUDENT_B, TEACHER_B = [0.2, 0.1], [0.7, 0.25]  # tails 0.7 and 0.05
REVERSE_A = 0.6 * LOG(0.6 / 0.5) + 0.3 * LOG(0.3 / 0.3) + 0.1 * LOG(0.1 / 0.2)
FORWARD_A = 0.5 * LOG(0.5 / 0.6) + 0.3 * LOG(0.3 / 0.3) + 0.2 * LOG(0.2 / 0.1)
REVERSE_B = 0.2 * LOG(0.2 / 0.7) + 0.1 * LOG(0.1 / 0.25) + 0.7 * LOG(0.7 / 0.05)
FORWARD_B = 0.7 * LOG(0.7 / 0.2) + 0.25 * LOG(0.25 / 0.1) + 0.05 * LOG(0.05 / 0.7)
# A third, distinct position (used by a second row).
STUDENT_C, TEACHER_C = [0.1, 0.1], [0.9, 0.05]  # tails 0.8 and 0.05
REVERSE_C = 0.1 * LOG(0.1 / 0.9) + 0.1 * LOG(0.1 / 0.05) + 0.8 * LOG(0.8 / 0.05)
FORWARD_C = 0.9 * LOG(0.9 / 0.1) + 0.05 * LOG(0.05 / 0.1) + 0.05 * LOG(0.05 / 0.8)


def two_by_three(second_row_masked: bool) -> tuple[torch.Tensor, Batch]:
    """Rows ``[prompt, A, B]`` and ``[prompt, C, padding]``; prompt and padding hold garbage.

    With ``second_row_masked`` the second row has ``sample_mask`` 0 (and its padding position
    is a valid-looking token, so only the sample mask drops it).
    """
    garbage = [NAN, -INF]
    student_at = [
        [garbage, logs(*STUDENT_A), logs(*STUDENT_B)],
        [garbage, logs(*STUDENT_C), [INF, NAN] if not second_row_masked else logs(*STUDENT_A)],
    ]
    teacher_at = [
        [[-INF, NAN], logs(*TEACHER_A), logs(*TEACHER_B)],
        [[INF, INF], logs(*TEACHER_C), [NAN, NAN] if not second_row_masked else logs(*TEACHER_B)],
    ]
    tensors = {
        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 0 if not second_row_masked else 1]], dtype=T),
        "teacher_topk_ids": torch.tensor([[[0, 1], [2, 1], [0, 3]], [[0, 1], [1, 2], [3, 0]]]),
        "teacher_topk_logprobs": torch.tensor(teacher_at, dtype=T),
        "logprobs_at": torch.tensor(student_at, dtype=T).requires_grad_(True),
        # teacher logprob - student logprob of the sampled token: 1.0, -0.25 and 2.0.
        "teacher_logprobs": torch.tensor([[NAN, -1.0, -0.5], [INF, -0.5, -0.1]], dtype=T),
    }
    if second_row_masked:
        tensors["sample_mask"] = torch.tensor([1.0, 0.0], dtype=T)
    logprobs = torch.tensor([[INF, -2.0, -0.25], [-INF, -2.5, NAN]], dtype=T).requires_grad_()
    return logprobs, Batch(tensors)


def test_is_a_loss_function_with_documented_options():
    loss = DistillationLoss()
    assert isinstance(loss, LossFunction)
    assert (loss.needs_reference, loss.needs_prev_logprobs) == (False, False)
    assert loss.logprobs_at_key == "teacher_topk_ids"
    assert loss.options == DistillationLossConfig()
    assert (loss.options.kl_type, loss.options.mixed_weight) == ("reverse", 0.5)
    assert loss.options.aggregation == "token_mean"
    for field in attrs.fields(DistillationLossConfig):
        assert field.metadata.get("doc"), f"{field.name} has no documentation"


@pytest.mark.parametrize(
    "bad", [{"kl_type": "js"}, {"mixed_weight": 1.5}, {"mixed_weight": -0.1}, {"aggregation": "x"}]
)
def test_config_rejects_out_of_range_options(bad):
    with pytest.raises((ValueError, TypeError)):
        DistillationLossConfig(**bad)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_token_mean_by_hand_with_a_masked_position_and_a_masked_row(kl_type):
    logprobs, batch = two_by_three(second_row_masked=True)
    stats = global_stats(batch)
    assert stats.valid_tokens == 2
    options = DistillationLossConfig(kl_type=kl_type, mixed_weight=0.25)
    loss, metrics = DistillationLoss(options)(logprobs, batch, stats)
    a = combine(kl_type, REVERSE_A, FORWARD_A, 0.25)
    b = combine(kl_type, REVERSE_B, FORWARD_B, 0.25)
    assert float(loss.detach()) == pytest.approx((a + b) / 2, abs=1e-12)
    assert metrics == {
        "kl_to_teacher": pytest.approx((a + b) / 2, abs=1e-12),
        "reverse_kl": pytest.approx((REVERSE_A + REVERSE_B) / 2, abs=1e-12),
        "forward_kl": pytest.approx((FORWARD_A + FORWARD_B) / 2, abs=1e-12),
        "teacher_topk_mass": pytest.approx((0.8 + 0.95) / 2, abs=1e-12),
        "logprob_gap": pytest.approx((1.0 - 0.25) / 2, abs=1e-12),
        "num_valid_tokens": 2.0,
    }
    loss.backward()
    grad = batch["logprobs_at"].grad
    assert torch.isfinite(grad).all()
    assert (grad[0, 0] == 0).all() and (grad[1] == 0).all()
    assert (grad[0, 1:] != 0).all()
    assert logprobs.grad is None or (logprobs.grad == 0).all()


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize(
    ("aggregation", "normalise"),
    [
        ("token_mean", lambda a, b, c: (a + b + c) / 3),
        ("seq_mean_token_mean", lambda a, b, c: ((a + b) / 2 + c) / 2),
        ("seq_mean_token_sum_norm", lambda a, b, c: (a + b + c) / (2 * 4)),
    ],
)
def test_aggregations_by_hand(kl_type, aggregation, normalise):
    logprobs, batch = two_by_three(second_row_masked=False)
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    options = DistillationLossConfig(kl_type=kl_type, aggregation=aggregation)
    loss, metrics = DistillationLoss(options)(logprobs, batch, stats)
    a, b, c = (
        combine(kl_type, r, f)
        for r, f in ((REVERSE_A, FORWARD_A), (REVERSE_B, FORWARD_B), (REVERSE_C, FORWARD_C))
    )
    assert float(loss.detach()) == pytest.approx(normalise(a, b, c), abs=1e-12)
    # The metric is the token mean whatever the aggregation.
    assert metrics["kl_to_teacher"] == pytest.approx((a + b + c) / 3, abs=1e-12)
    assert metrics["logprob_gap"] == pytest.approx((1.0 - 0.25 + 2.0) / 3, abs=1e-12)
    assert metrics["num_valid_tokens"] == 3.0


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_k_equal_to_the_vocabulary_gives_the_exact_kl(kl_type):
    # V = K = 3: the tails are (numerically) 0 and the coarsened KL is the full KL.
    student, teacher = [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]
    batch = Batch(
        {
            "loss_mask": torch.tensor([[0.0, 1.0]], dtype=T),
            "teacher_topk_ids": torch.tensor([[[0, 1, 2], [0, 1, 2]]]),
            "teacher_topk_logprobs": torch.tensor([[logs(*teacher), logs(*teacher)]], dtype=T),
            "logprobs_at": torch.tensor([[logs(*student), logs(*student)]], dtype=T),
        }
    )
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=1, max_sequence_length=4)
    loss, metrics = DistillationLoss(DistillationLossConfig(kl_type=kl_type))(
        torch.zeros(1, 2, dtype=T), batch, stats
    )
    expected = combine(kl_type, kl(student, teacher), kl(teacher, student))
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    assert metrics["teacher_topk_mass"] == pytest.approx(1.0, abs=1e-12)
    assert "logprob_gap" not in metrics


def test_tail_floor_keeps_the_log_finite():
    # The student's K tokens hold all its mass (tail 0), the teacher's only 0.5: the student's
    # tail is floored at TAIL_FLOOR, so the forward KL is large but finite.
    batch = Batch(
        {
            "loss_mask": torch.tensor([[1.0]], dtype=T),
            "teacher_topk_logprobs": torch.tensor([[logs(0.25, 0.25)]], dtype=T),
            "logprobs_at": torch.tensor([[logs(0.5, 0.5)]], dtype=T),
        }
    )
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=1, max_sequence_length=4)
    _, metrics = DistillationLoss()(torch.zeros(1, 1, dtype=T), batch, stats)
    expected_forward = 2 * 0.25 * LOG(0.25 / 0.5) + 0.5 * LOG(0.5 / TAIL_FLOOR)
    expected_reverse = 2 * 0.5 * LOG(0.5 / 0.25) + TAIL_FLOOR * LOG(TAIL_FLOOR / 0.5)
    assert metrics["forward_kl"] == pytest.approx(expected_forward, rel=1e-9)
    assert metrics["reverse_kl"] == pytest.approx(expected_reverse, rel=1e-9)


def test_forward_kl_treats_a_zero_teacher_probability_as_0_log_0():
    # The teacher's second token has probability 0 (logprob -inf) at a valid position: it
    # contributes 0 to KL(T || S), and the gradient stays finite.
    at = torch.tensor([[logs(0.5, 0.2)]], dtype=T).requires_grad_(True)
    batch = Batch(
        {
            "loss_mask": torch.tensor([[1.0]], dtype=T),
            "teacher_topk_logprobs": torch.tensor([[[LOG(0.6), -INF]]], dtype=T),
            "logprobs_at": at,
        }
    )
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=1, max_sequence_length=4)
    options = DistillationLossConfig(kl_type="forward")
    loss, _ = DistillationLoss(options)(torch.zeros(1, 1, dtype=T), batch, stats)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(
        0.6 * LOG(0.6 / 0.5) + 0.4 * LOG(0.4 / 0.3), abs=1e-12
    )
    # d/db_i [-sum_c p_T(c) log p_S(c)] = -p_T(i) + p_T(tail) p_S(i) / p_S(tail).
    expected = torch.tensor([[[-0.6 + 0.4 * 0.5 / 0.3, 0.4 * 0.2 / 0.3]]], dtype=T)
    torch.testing.assert_close(at.grad, expected, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Gradients with respect to the student's logits


def student_and_teacher(seed: int, rows: int, width: int, vocab: int, k: int, dtype=T):
    """Random student logits ``z`` ``[B, T, V]`` and a batch with the teacher's top-k."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, width, vocab, generator=gen, dtype=dtype) * 1.5
    teacher = torch.log_softmax(
        torch.randn(rows, width, vocab, generator=gen, dtype=dtype) * 1.5, dim=-1
    )
    top_logprobs, top_ids = teacher.topk(k, dim=-1)
    batch = Batch(
        {
            "loss_mask": torch.ones(rows, width, dtype=dtype),
            "teacher_topk_ids": top_ids,
            "teacher_topk_logprobs": top_logprobs,
        }
    )
    return z, teacher, batch


def with_student(batch: Batch, z: torch.Tensor) -> tuple[torch.Tensor, Batch]:
    """What the core does: the policy's logprobs of the sampled tokens and at the top-k ids."""
    log_probs = torch.log_softmax(z, dim=-1)
    tensors = dict(batch.tensors)
    tensors["logprobs_at"] = log_probs.gather(-1, batch["teacher_topk_ids"])
    ids = batch.get("input_ids")
    if ids is None:
        return log_probs[..., 0], Batch(tensors)
    return log_probs.gather(-1, ids[..., None])[..., 0], Batch(tensors)


@pytest.mark.parametrize("kl_type", ["reverse", "forward"])
def test_gradient_with_k_equal_to_the_vocabulary_has_the_closed_form(kl_type):
    vocab = 6
    z, teacher, batch = student_and_teacher(seed=3, rows=2, width=3, vocab=vocab, k=vocab)
    batch["loss_mask"][:, 0] = 0.0  # prompt positions
    z.requires_grad_(True)
    logprobs, full = with_student(batch, z)
    stats = global_stats(full)
    loss, metrics = DistillationLoss(DistillationLossConfig(kl_type=kl_type))(logprobs, full, stats)
    loss.backward()

    log_s = torch.log_softmax(z.detach(), dim=-1)
    p_s, p_t = log_s.exp(), teacher.exp()
    reverse = (p_s * (log_s - teacher)).sum(-1, keepdim=True)
    forward = (p_t * (teacher - log_s)).sum(-1, keepdim=True)
    if kl_type == "forward":
        per_token_grad = p_s - p_t
        per_token = forward
    else:
        per_token_grad = p_s * (log_s - teacher - reverse)
        per_token = reverse
    mask = batch["loss_mask"][..., None]
    expected_grad = per_token_grad * mask / stats.valid_tokens
    torch.testing.assert_close(z.grad, expected_grad, rtol=0, atol=1e-12)
    assert (z.grad[:, 0] == 0).all() and z.grad[:, 1:].abs().min() > 0
    expected_loss = float((per_token * mask).sum() / stats.valid_tokens)
    assert float(loss.detach()) == pytest.approx(expected_loss, abs=1e-12)
    assert metrics["reverse_kl"] == pytest.approx(float((reverse * mask).sum() / 4), abs=1e-12)
    assert metrics["forward_kl"] == pytest.approx(float((forward * mask).sum() / 4), abs=1e-12)


def reference_coarsened_kl(logprobs_at, teacher_topk, kl_type: str, weight: float):
    """The coarsened formula written out directly (tails well above the floor here)."""
    p_s, p_t = logprobs_at.exp(), teacher_topk.exp()
    tail_s = (1 - p_s.sum(-1)).clamp(min=1e-8)
    tail_t = (1 - p_t.sum(-1)).clamp(min=1e-8)
    reverse = (p_s * (logprobs_at - teacher_topk)).sum(-1) + tail_s * (tail_s.log() - tail_t.log())
    forward = (p_t * (teacher_topk - logprobs_at)).sum(-1) + tail_t * (tail_t.log() - tail_s.log())
    return combine(kl_type, reverse, forward, weight)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_gradient_with_k_below_the_vocabulary_matches_a_direct_implementation(kl_type):
    z, _, batch = student_and_teacher(seed=4, rows=2, width=4, vocab=9, k=3)
    batch["loss_mask"][1, 2:] = 0.0
    stats = global_stats(batch)
    options = DistillationLossConfig(kl_type=kl_type, mixed_weight=0.3)

    z1 = z.clone().requires_grad_(True)
    logprobs, full = with_student(batch, z1)
    loss, metrics = DistillationLoss(options)(logprobs, full, stats)
    loss.backward()

    z2 = z.clone().requires_grad_(True)
    _, direct = with_student(batch, z2)
    per_token = reference_coarsened_kl(
        direct["logprobs_at"], batch["teacher_topk_logprobs"], kl_type, 0.3
    )
    expected = (per_token * batch["loss_mask"]).sum() / stats.valid_tokens
    expected.backward()

    tail = 1 - batch["teacher_topk_logprobs"].exp().sum(-1)
    assert tail.min() > 0.01  # the tail bucket carries real mass in this case
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    assert metrics["kl_to_teacher"] == pytest.approx(float(expected.detach()), abs=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)
    assert (z1.grad[1, 2:] == 0).all() and z1.grad[0].abs().sum() > 0


@pytest.mark.parametrize("kl_type", ["reverse", "forward"])
def test_float32_with_full_coverage_matches_the_full_vocabulary_kl(kl_type):
    # With K = V in float32 the tails are rounding noise (~1e-7): negligible.
    vocab = 50
    z, teacher, batch = student_and_teacher(
        seed=5, rows=3, width=4, vocab=vocab, k=vocab, dtype=torch.float32
    )
    logprobs, full = with_student(batch, z)
    stats = global_stats(full)
    loss, _ = DistillationLoss(DistillationLossConfig(kl_type=kl_type))(logprobs, full, stats)
    log_s, log_t = torch.log_softmax(z.double(), dim=-1), teacher.double()
    if kl_type == "reverse":
        exact = (log_s.exp() * (log_s - log_t)).sum(-1).mean()
    else:
        exact = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
    assert float(loss.detach()) == pytest.approx(float(exact), abs=1e-5)


def test_bfloat16_inputs_are_computed_in_float32():
    z, _, batch = student_and_teacher(seed=6, rows=2, width=3, vocab=9, k=3)
    logprobs, full = with_student(batch, z)
    stats = global_stats(full)
    low = Batch(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.tensors.items()}
    )
    loss, metrics = DistillationLoss()(logprobs.to(torch.bfloat16), low, stats)
    assert loss.dtype == torch.float32
    # The same (bf16-rounded) inputs in float64: only float32 rounding separates the two.
    exact, _ = DistillationLoss()(
        logprobs,
        Batch({k: v.to(T) if v.is_floating_point() else v for k, v in low.tensors.items()}),
        stats,
    )
    assert float(loss.detach()) == pytest.approx(float(exact.detach()), rel=1e-5)
    assert metrics["reverse_kl"] == pytest.approx(float(exact.detach()), rel=1e-5)


# --------------------------------------------------------------------------------------------
# The aggregation contract: micro batches, data-parallel shards and padding change nothing


def distillation_batch(seed: int = 0, rows: int = 8, width: int = 10, vocab: int = 11, k: int = 4):
    """Student logits and a right-padded batch: prompts of 1-3 tokens, then generated tokens,
    then padding; row 2 has ``sample_mask`` 0 and the last row has no valid token."""
    z, teacher, batch = student_and_teacher(seed, rows, width, vocab, k)
    gen = torch.Generator().manual_seed(seed + 100)
    loss_mask = torch.zeros(rows, width, dtype=T)
    for i in range(rows):
        prompt = int(torch.randint(1, 4, (1,), generator=gen))
        length = int(torch.randint(prompt + 1, width + 1, (1,), generator=gen))
        loss_mask[i, prompt:length] = 1.0
    loss_mask[rows - 1] = 0.0
    sample_mask = torch.ones(rows, dtype=T)
    sample_mask[2] = 0.0
    input_ids = torch.randint(0, vocab, (rows, width), generator=gen)
    batch["loss_mask"] = loss_mask
    batch["sample_mask"] = sample_mask
    batch["input_ids"] = input_ids
    batch["teacher_logprobs"] = teacher.gather(-1, input_ids[..., None])[..., 0]
    return z, batch


def run_parts(loss_fn, z: torch.Tensor, parts: list[Batch], stats: GlobalBatchStats):
    """Sum of the losses of consecutive row slices ``parts`` (micro batches, or micro batches
    of rank shards), their gradient with respect to the student logits, reduced metrics."""
    z = z.detach().clone().requires_grad_(True)
    total, metrics, start = 0.0, [], 0
    for part in parts:
        width = part["loss_mask"].shape[1]
        logprobs, full = with_student(part, z[start : start + len(part), :width])
        start += len(part)
        loss, part_metrics = loss_fn(logprobs, full, stats)
        loss.backward()
        total += float(loss.detach())
        metrics.append(part_metrics)
    return total, z.grad, reduce_metrics(metrics)


def pad_right(z: torch.Tensor, batch: Batch, extra: int) -> tuple[torch.Tensor, Batch]:
    """``extra`` masked columns: finite student logits (the model's output on padding), garbage
    (NaN, -inf, inf) in every teacher tensor."""
    rows, _, vocab = z.shape
    z = torch.cat([z, torch.randn(rows, extra, vocab, dtype=z.dtype)], dim=1)
    fills = {
        "loss_mask": 0.0,
        "input_ids": 0,
        "teacher_topk_ids": 0,
        "teacher_topk_logprobs": NAN,
        "teacher_logprobs": -INF,
    }
    tensors = {}
    for key, value in batch.tensors.items():
        if value.dim() >= 2:
            shape = (rows, extra, *value.shape[2:])
            value = torch.cat([value, torch.full(shape, fills[key], dtype=value.dtype)], dim=1)
        tensors[key] = value
    tensors["teacher_topk_logprobs"][0, -1, 0] = INF
    return z, Batch(tensors)


def assert_metrics_equal(left: dict[str, float], right: dict[str, float]) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert left[key] == pytest.approx(right[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_ranks_and_padding_change_nothing(kl_type, aggregation):
    z, batch = distillation_batch()
    stats = global_stats(batch)
    loss_fn = DistillationLoss(DistillationLossConfig(kl_type=kl_type, aggregation=aggregation))
    loss, grad, metrics = run_parts(loss_fn, z, [batch], stats)
    assert loss > 0 and grad.abs().sum() > 0
    assert set(metrics) == {
        "kl_to_teacher",
        "reverse_kl",
        "forward_kl",
        "teacher_topk_mass",
        "logprob_gap",
        "num_valid_tokens",
    }
    assert metrics["num_valid_tokens"] == stats.valid_tokens
    # No gradient on prompts, padding, the sample-masked row or the empty row.
    weights = batch["loss_mask"] * batch["sample_mask"][:, None]
    assert (grad[weights == 0] == 0).all()
    assert (grad[weights != 0].abs().sum(-1) > 0).all()

    micro = run_parts(loss_fn, z, list(batch.micro_batches(3)), stats)
    ranks = run_parts(loss_fn, z, [mb for s in batch.shard(2) for mb in s.micro_batches(2)], stats)
    padded_z, padded = pad_right(z, batch, extra=3)
    pad = run_parts(loss_fn, padded_z, list(padded.micro_batches(5)), stats)
    for other_loss, other_grad, other_metrics in (micro, ranks, pad):
        assert other_loss == pytest.approx(loss, rel=1e-12)
        torch.testing.assert_close(other_grad[:, : z.shape[1]], grad, rtol=1e-12, atol=1e-14)
        assert_metrics_equal(other_metrics, metrics)
    assert (pad[1][:, z.shape[1] :] == 0).all()


def test_garbage_in_masked_positions_leaves_value_and_gradient_finite():
    z, batch = distillation_batch(seed=7)
    stats = global_stats(batch)
    logprobs, clean = with_student(batch, z)
    clean_at = clean["logprobs_at"].detach()
    weights = batch["loss_mask"] * batch["sample_mask"][:, None]
    masked = weights == 0
    assert masked.any()

    def dirty(values: torch.Tensor, fills: list[float]) -> torch.Tensor:
        values = values.clone()
        garbage = torch.tensor(fills, dtype=values.dtype)
        values[masked] = garbage[torch.arange(int(masked.sum())) % len(fills)].reshape(
            -1, *([1] * (values.dim() - 2))
        )
        return values

    for kl_type in KL_TYPES:
        results = []
        for at, teacher, lp, tlp in (
            (clean_at, batch["teacher_topk_logprobs"], logprobs, batch["teacher_logprobs"]),
            (
                dirty(clean_at, [NAN, -INF, INF]),
                dirty(batch["teacher_topk_logprobs"], [INF, NAN, -INF]),
                dirty(logprobs.detach(), [INF, NAN]),
                dirty(batch["teacher_logprobs"], [NAN, -INF]),
            ),
        ):
            at = at.clone().requires_grad_(True)
            lp = lp.detach().clone().requires_grad_(True)
            tensors = dict(batch.tensors)
            tensors.update(logprobs_at=at, teacher_topk_logprobs=teacher, teacher_logprobs=tlp)
            loss_fn = DistillationLoss(DistillationLossConfig(kl_type=kl_type, mixed_weight=0.7))
            loss, metrics = loss_fn(lp, Batch(tensors), stats)
            loss.backward()
            assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
            assert torch.isfinite(at.grad).all() and (at.grad[masked] == 0).all()
            assert lp.grad is None or (lp.grad == 0).all()
            results.append((float(loss.detach()), at.grad, metrics))
        (clean_loss, clean_grad, clean_metrics), (dirty_loss, dirty_grad, dirty_metrics) = results
        assert dirty_loss == clean_loss and clean_loss > 0
        assert torch.equal(dirty_grad, clean_grad)
        assert dirty_metrics == clean_metrics


@pytest.mark.parametrize("key", ["teacher_topk_logprobs", "logprobs_at"])
def test_missing_key_is_a_one_line_error(key):
    logprobs, batch = two_by_three(second_row_masked=False)
    stripped = Batch({k: v for k, v in batch.tensors.items() if k != key})
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    with pytest.raises(ValueError, match=f"'{key}'") as error:
        DistillationLoss()(logprobs, stripped, stats)
    message = str(error.value)
    assert "\n" not in message and "nrl run distill" in message


def test_mismatched_shapes_are_an_error():
    logprobs, batch = two_by_three(second_row_masked=False)
    batch["logprobs_at"] = batch["logprobs_at"][..., :1]
    stats = GlobalBatchStats(valid_tokens=3, valid_sequences=2, max_sequence_length=4)
    with pytest.raises(ValueError, match="logprobs_at"):
        DistillationLoss()(logprobs, batch, stats)


# --------------------------------------------------------------------------------------------
# Registration and the loss conformance suite


def test_registered_with_its_config_class():
    host = PluginHost(selection=[])
    host.load_builtins()
    spec = host.registry().get("loss", "distillation")
    assert spec.plugin == "core"
    assert spec.target_str == "nrl_core.losses.distillation:DistillationLoss"
    config_cls = spec.load_config_class()
    assert config_cls is DistillationLossConfig
    loss = spec.load()(config_cls(kl_type="forward"), None)
    assert isinstance(loss, DistillationLoss) and isinstance(loss, LossFunction)
    assert loss.options.kl_type == "forward"


def test_config_loads_without_torch():
    code = (
        "import sys\n"
        "from nrl_core.plugins import PluginHost\n"
        "host = PluginHost(selection=[]); host.load_builtins()\n"
        "host.registry().get('loss', 'distillation').load_config_class()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def conformance_inputs(vocab_size: int = 64, k: int = 4):
    """The suite's random batch plus the teacher's top-k and the student's ``logprobs_at``.

    ``logprobs_at`` is a leaf requiring grad: the suite differentiates with respect to the
    ``[B, T]`` logprobs it passes, but this loss's gradient flows through ``logprobs_at``.
    """
    logprobs, batch = random_batch(vocab_size=vocab_size)
    rows, width = logprobs.shape
    gen = torch.Generator().manual_seed(11)
    student = torch.log_softmax(torch.randn(rows, width, vocab_size, generator=gen, dtype=T), -1)
    teacher = torch.log_softmax(torch.randn(rows, width, vocab_size, generator=gen, dtype=T), -1)
    top_logprobs, top_ids = teacher.topk(k, dim=-1)
    batch["teacher_topk_ids"] = top_ids
    batch["teacher_topk_logprobs"] = top_logprobs
    batch["teacher_logprobs"] = teacher.gather(-1, batch["input_ids"][..., None])[..., 0]
    batch["logprobs_at"] = student.gather(-1, top_ids).requires_grad_(True)
    return logprobs, batch


@pytest.mark.parametrize(
    "options",
    [
        DistillationLossConfig(),
        DistillationLossConfig(kl_type="forward", aggregation="seq_mean_token_mean"),
        DistillationLossConfig(kl_type="mixed", mixed_weight=0.3),
    ],
    ids=["reverse", "forward-seq-mean", "mixed"],
)
class TestDistillationConformance(LossConformance):
    """The loss conformance suite; it measures this loss's gradient through
    ``batch["logprobs_at"]`` (the loss declares ``logprobs_at_key``)."""

    registered_name = "distillation"

    @pytest.fixture
    def loss_fn(self, options):
        return DistillationLoss(options, None)

    @pytest.fixture
    def inputs(self):
        return conformance_inputs()
