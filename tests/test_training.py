"""The core's training step pieces that need no model: metric reduction and micro batches
(the step itself runs through real workers in the conformance kit and the plugin tests)."""

from __future__ import annotations

import pytest
import torch

from nrl_core.data import Batch
from nrl_core.training import reduce_metrics, split_micro_batches, valid_token_mask


def test_reduce_metrics_sums_except_max_and_min():
    parts = [
        {"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5},
        {"loss": 0.5, "ratio_max": 3.0, "ratio_min": 0.7, "kl": 0.1},
    ]
    assert reduce_metrics(parts) == {"loss": 1.5, "ratio_max": 3.0, "ratio_min": 0.5, "kl": 0.1}


def test_declared_reductions_win_over_the_name():
    parts = [{"peak": 2.0, "width": 1.0, "floor_max": 4.0}, {"peak": 5.0, "width": 3.0}]
    declared = {"peak": "max", "width": "mean", "floor_max": "sum"}
    assert reduce_metrics(parts, declared) == {"peak": 5.0, "width": 2.0, "floor_max": 4.0}
    with pytest.raises(ValueError, match="median"):
        reduce_metrics(parts, {"peak": "median"})


def test_clipped_pg_declares_its_extremes():
    from nrl_core.losses.clipped_pg import ClippedPGLoss
    from nrl_core.training import declared_reductions, metric_reduction

    declared = declared_reductions(ClippedPGLoss())
    assert {k: metric_reduction(k, declared) for k in declared} == {
        "ratio_max": "max",
        "ratio_min": "min",
        "gen_logprob_error_max": "max",
    }


def test_several_optimizer_steps_average_sums_and_keep_extremes():
    from nrl_core.training import combine_optimizer_steps

    steps = [
        {"loss": 1.0, "ratio_max": 1.2, "lr": 0.1, "grad_norm": 2.0},
        {"loss": 3.0, "ratio_max": 1.5, "lr": 0.2, "grad_norm": 4.0},
    ]
    assert combine_optimizer_steps(steps, {"ratio_max": "max"}) == {
        "loss": 2.0,
        "ratio_max": 1.5,
        "lr": 0.2,
        "grad_norm": 3.0,
    }


def _batch(lengths: list[int]) -> Batch:
    width = max(lengths)
    return Batch(
        {
            "input_ids": torch.arange(len(lengths))[:, None].expand(-1, width).clone(),
            "lengths": torch.tensor(lengths),
        }
    )


def test_micro_batches_by_count_keep_order():
    parts = split_micro_batches(_batch([3, 5, 2, 7, 4]), size=2)
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 1], [2, 3], [4]]


def test_micro_batches_by_token_budget_pack_longest_first_within_the_budget():
    lengths = [3, 9, 2, 7, 4, 12]
    parts = split_micro_batches(_batch(lengths), size=2, token_budget=12)
    rows = [p["input_ids"][:, 0].tolist() for p in parts]
    # Every sample exactly once; no micro batch over budget unless a single sample is.
    assert sorted(r for part in rows for r in part) == list(range(len(lengths)))
    for part in rows:
        tokens = sum(lengths[r] for r in part)
        assert tokens <= 12 or len(part) == 1
    assert rows[0] == [5]  # the longest (12 tokens) alone
    assert len(parts) < len(lengths)  # short samples were packed together


def test_empty_shard_has_no_micro_batch():
    assert split_micro_batches(_batch([3]).slice(0, 0), size=4) == []


def test_valid_token_mask_follows_lengths():
    mask = valid_token_mask(_batch([2, 4]), 4)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]


class _AtLoss:
    """A loss that asks for the policy's logprobs at ``batch["ids"]`` and sums them."""

    needs_reference = needs_prev_logprobs = False
    logprobs_at_key = "ids"

    def __call__(self, logprobs, batch, stats):
        return batch["logprobs_at"].sum(), {}


class _Worker:
    """One rank that scores ``ids`` with fixed logprobs (-inf past each row's length)."""

    def __init__(self, pass_at: bool = True) -> None:
        self.pass_at = pass_at
        self.seen: list[torch.Tensor] = []

    def forward_backward(self, micro_batch, loss):
        ids = loss.logprobs_at_ids
        at = torch.full(ids.shape, -1.0)
        at[0, 3:] = float("-inf")  # padding of the shorter row
        value = loss(torch.zeros(ids.shape[:2]), at) if self.pass_at else loss(torch.zeros(1, 1))
        self.seen.append(value)

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0}


def test_a_loss_gets_the_logprobs_at_its_ids_with_padding_zeroed():
    from nrl_core.interfaces import GlobalBatchStats
    from nrl_core.training import train_on_rank

    batch = Batch(
        {
            "input_ids": torch.zeros(2, 4, dtype=torch.long),
            "lengths": torch.tensor([3, 4]),
            "ids": torch.zeros(2, 4, 2, dtype=torch.long),
        }
    )
    worker = _Worker()
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=1, max_sequence_length=4)
    result = train_on_rank(worker, [batch], 1, _AtLoss(), stats, 1.0)
    # 2 ids at positions 0-2 of row 0 and 0-3 of row 1 hold -1; row 0's position 3 (-inf, past
    # its length) is zeroed with `where`, not multiplied (0 * -inf would be NaN).
    assert float(worker.seen[0]) == -2.0 * (3 + 4)
    assert result.micro_batch_metrics[0]["loss"] == -14.0

    with pytest.raises(RuntimeError, match="needs the policy's logprobs at batch\\['ids'\\]"):
        train_on_rank(_Worker(pass_at=False), [batch], 1, _AtLoss(), stats, 1.0)


class _Stage:
    """One pipeline stage that takes all micro batches at once: the last stage calls every
    closure (the loss exists there only), an earlier one none."""

    def __init__(self, last: bool) -> None:
        self.last = last
        self.calls: list[int] = []

    def forward_backward(self, micro_batch, loss):
        raise AssertionError("a worker with forward_backward_micro_batches gets them all at once")

    def forward_backward_micro_batches(self, items):
        self.calls.append(len(items))
        if self.last:
            for micro_batch, loss in items:
                loss(torch.zeros(micro_batch["input_ids"].shape))
        return self.last

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0}


@pytest.mark.parametrize("last", [True, False])
def test_a_pipeline_worker_gets_every_micro_batch_in_one_call(last):
    from nrl_core.interfaces import GlobalBatchStats
    from nrl_core.testing.batches import TokenMeanNLL, make_batch
    from nrl_core.training import train_on_rank

    micro_batches = list(make_batch(6, seed=0).micro_batches(2))
    stats = GlobalBatchStats(valid_tokens=10, valid_sequences=6, max_sequence_length=16)
    worker = _Stage(last)
    # 4 passes for 3 real micro batches: the filler goes into the same call.
    result = train_on_rank(worker, micro_batches, 4, TokenMeanNLL(), stats, 1.0)
    assert worker.calls == [4]
    # Metrics of the real micro batches from the stage that computed the loss, none from others.
    assert len(result.micro_batch_metrics) == (3 if last else 0)


def _scores(micro_batch) -> torch.Tensor:
    """Logprobs that depend on each token (``-id / 1000``), padded or packed alike."""
    packed = not isinstance(micro_batch, Batch)
    return (micro_batch.input_ids if packed else micro_batch["input_ids"]).float() / -1000


class _Scorer:
    """One ``compute_logprobs`` call per micro batch; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def compute_logprobs(self, micro_batch, *, reference=False):
        self.calls.append(1)
        return _scores(micro_batch)


class _ScheduleScorer(_Scorer):
    """The same logprobs, all micro batches of a call at once (as a pipeline schedule)."""

    def compute_logprobs(self, micro_batch, *, reference=False):
        raise AssertionError("a worker with compute_logprobs_micro_batches gets them all at once")

    def compute_logprobs_micro_batches(self, micro_batches, *, reference=False):
        self.calls.append(len(micro_batches))
        return [_scores(mb) for mb in micro_batches]


@pytest.mark.parametrize("packed", [False, True])
def test_a_pipeline_worker_gets_every_logprob_micro_batch_in_one_call(packed):
    """M2 (gpu-review-3): 3 chunks plus a filler go to ``compute_logprobs_micro_batches`` in one
    call, and the logprobs are those of one ``compute_logprobs`` call per chunk."""
    from nrl_core.testing.batches import make_batch
    from nrl_core.training import logprobs_on_rank

    batch = make_batch(6, seed=1)
    chunks = list(batch.micro_batches(2))
    width = batch["input_ids"].shape[1]
    one_by_one, all_at_once = _Scorer(), _ScheduleScorer()
    want = logprobs_on_rank(one_by_one, chunks, 4, width, reference=False, packed=packed)
    got = logprobs_on_rank(all_at_once, chunks, 4, width, reference=True, packed=packed)
    assert one_by_one.calls == [1, 1, 1, 1]
    # One call (the filler is the 4th micro batch), the 1/-1000 -scores kept per real token.
    assert all_at_once.calls == [4]
    assert got.shape == (6, width)
    assert got.abs().sum() > 0
    assert torch.equal(got, want)
