"""The dtensor policy as a distillation teacher (top-k logprobs) and student (logprobs at the
teacher's ids, trained with the `distillation` loss), against a plain Hugging Face forward."""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.config import DTensorConfig
from test_dtensor import group_policy, local_policy, make_config

from nrl_core.losses.distillation import DistillationLoss, DistillationLossConfig
from nrl_core.testing.batches import make_batch

pytestmark = pytest.mark.slow


def hf_log_probs(path, batch) -> torch.Tensor:
    """``[B, T - 1, V]`` next-token log-probabilities from a plain ``from_pretrained`` model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def teacher_scores(batch, log_probs, k):
    """What the teacher hands the student, computed from ``log_probs`` by hand."""
    values, ids = log_probs.topk(k, dim=-1)
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["lengths"][:, None]
    valid[:, 0] = False
    pad = (0, 0, 1, 0)
    values = torch.nn.functional.pad(values, pad) * valid[..., None]
    ids = torch.nn.functional.pad(ids, pad) * valid[..., None]
    return values, ids, valid


def test_topk_logprobs_are_the_full_distributions_top_k(tiny_path):
    config = make_config(tiny_path)
    batch = make_batch(6, seed=3)
    expected = hf_log_probs(tiny_path, batch)
    teacher = local_policy(config)
    tokens, values, ids = teacher.get_topk_logprobs(batch, 5)
    want_values, want_ids, valid = teacher_scores(batch, expected, 5)
    assert values.shape == ids.shape == (6, batch["input_ids"].shape[1], 5)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)
    assert torch.equal(ids[valid], want_ids[valid])
    assert (values[~valid] == 0).all() and (ids[~valid] == 0).all()
    # The tokens' own logprobs are get_logprobs' values.
    torch.testing.assert_close(tokens, teacher.get_logprobs(batch), rtol=0, atol=1e-6)
    # k above the vocabulary keeps the whole distribution, each position summing to 1.
    vocab = expected.shape[-1]
    _, full, _ = teacher.get_topk_logprobs(batch, vocab + 50)
    assert full.shape[-1] == vocab
    torch.testing.assert_close(full.exp().sum(-1)[valid], torch.ones(int(valid.sum())))


def test_student_step_minimises_the_exact_kl_on_two_ranks_as_on_one(tiny_path, start_group):
    """The full-vocabulary reverse KL the student trains on equals the KL computed by hand
    from two plain forwards (the teacher: the tiny model; the student: a differently seeded
    one), and 2 ranks take the same step as 1."""
    from nrl_core.testing.tiny import tiny_model_path

    student_path = tiny_model_path(tiny_path.parent, seed=1)
    batch = make_batch(8, seed=5)
    teacher_lp = hf_log_probs(tiny_path, batch)
    student_lp = hf_log_probs(student_path, batch)
    vocab = teacher_lp.shape[-1]
    values, ids, valid = teacher_scores(batch, teacher_lp, vocab)
    batch["teacher_topk_logprobs"], batch["teacher_topk_ids"] = values, ids
    mask = batch["loss_mask"] * valid
    kl = (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)
    expected_kl = float((torch.nn.functional.pad(kl, (1, 0)) * mask).sum() / mask.sum())

    loss = DistillationLoss(DistillationLossConfig(kl_type="reverse"))
    config = make_config(student_path)
    single = local_policy(config).train(batch, loss)
    assert single["loss"] == pytest.approx(expected_kl, rel=1e-4)
    assert single["kl_to_teacher"] == pytest.approx(expected_kl, rel=1e-4)
    assert single["teacher_topk_mass"] == pytest.approx(1.0, abs=1e-5)

    two = group_policy(start_group, config, DTensorConfig()).train(batch, loss)
    assert two["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert two["num_valid_tokens"] == single["num_valid_tokens"] == float(mask.sum())


def test_a_student_step_lowers_the_kl(tiny_path):
    from nrl_core.testing.tiny import tiny_model_path

    student_path = tiny_model_path(tiny_path.parent, seed=1)
    batch = make_batch(8, seed=5)
    values, ids, _ = teacher_scores(batch, hf_log_probs(tiny_path, batch), 8)
    batch["teacher_topk_logprobs"], batch["teacher_topk_ids"] = values, ids
    student = local_policy(make_config(student_path, lr=1e-3))
    loss = DistillationLoss()
    first = student.train(batch, loss)["kl_to_teacher"]
    for _ in range(5):
        last = student.train(batch, loss)["kl_to_teacher"]
    assert last < 0.8 * first
