"""The core's sequence packing without a model: bins, pack/unpack, and how the policy facade
decides to pack (the exactness against padded training runs in the dtensor plugin's tests)."""

from __future__ import annotations

import pytest
import torch

from nrl_core.data import Batch
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.errors import NrlError
from nrl_core.packing import PackedSequences, first_fit_decreasing, pack, packing_mode
from nrl_core.policy import Policy
from nrl_core.training import pack_micro_batches


def _batch(lengths: list[int]) -> Batch:
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = 100 * (row + 1) + torch.arange(n)
    return Batch({"input_ids": ids, "lengths": torch.tensor(lengths)})


def test_first_fit_decreasing_fills_the_first_bin_with_room():
    # Longest first: 7 (new bin 0), 5 (new bin 1), 4 (bin 1: 9), 3 (bin 0: 10), 2 (no room:
    # new bin 2), 1 (bin 1: 10).
    assert first_fit_decreasing([3, 7, 2, 5, 4, 1], budget=10) == [[1, 0], [3, 4, 5], [2]]
    # Ties keep the lower index first; a sample over the budget gets a bin of its own.
    assert first_fit_decreasing([4, 12, 4, 4], budget=8) == [[1], [0, 2], [3]]


def test_first_fit_decreasing_keeps_pairs_and_respects_the_budget():
    lengths = [5, 9, 2, 2, 30, 1, 7, 7]
    bins = first_fit_decreasing(lengths, budget=16, group_size=2)
    for rows in bins:
        assert len(rows) % 2 == 0 and all(rows[i] % 2 == 0 for i in range(0, len(rows), 2))
        assert all(rows[i + 1] == rows[i] + 1 for i in range(0, len(rows), 2))
        assert sum(lengths[r] for r in rows) <= 16 or len(rows) == 2
    assert sorted(r for rows in bins for r in rows) == list(range(8))
    with pytest.raises(ValueError, match="units of 2"):
        first_fit_decreasing([1, 2, 3], budget=4, group_size=2)


def test_pack_concatenates_restarts_positions_and_unpacks():
    batch = _batch([3, 1, 4])
    packed = pack(batch)
    assert packed.input_ids.tolist() == [[100, 101, 102, 200, 300, 301, 302, 303]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8] and packed.cu_seqlens.dtype == torch.int32
    assert (packed.max_seqlen, packed.width, packed.rows, packed.lengths) == (4, 4, 3, [3, 1, 4])

    values = packed.input_ids.float().requires_grad_()
    out = packed.unpack(values)
    # Padding and each sample's position 0 (the prediction from the previous sample) hold 0.
    assert out.tolist() == [[0, 101, 102, 0], [0, 0, 0, 0], [0, 301, 302, 303]]
    out.sum().backward()
    assert values.grad.tolist() == [[0, 1, 1, 0, 0, 1, 1, 1]]
    # [B, T, K] values go the other way (a teacher's top-k ids).
    ids = torch.arange(3 * 4 * 2).view(3, 4, 2)
    assert packed.pack(ids)[0, :, 0].tolist() == [0, 2, 4, 8, 16, 18, 20, 22]
    assert packed.unpack(packed.pack(ids))[2, 1:].tolist() == ids[2, 1:].tolist()


def test_pack_micro_batches_returns_bins_and_their_order():
    bins, order = pack_micro_batches(_batch([3, 7, 2, 5]), token_budget=10)
    assert [b["lengths"].tolist() for b in bins] == [[7, 3], [5, 2]]
    assert order == [1, 0, 3, 2]
    assert pack_micro_batches(Batch(), token_budget=10) == ([], [])


class _Worker:
    """One rank that returns each token's id as its logprob, packed or padded."""

    def __init__(self, supports: bool) -> None:
        self.supports_sequence_packing = supports
        self.seen: list[str] = []

    def compute_logprobs(self, micro_batch, *, reference=False):
        packed = isinstance(micro_batch, PackedSequences)
        self.seen.append("packed" if packed else "padded")
        return (micro_batch.input_ids if packed else micro_batch["input_ids"]).float()


@pytest.mark.parametrize(("mode", "supports", "packed"), [
    ("auto", True, True), ("auto", False, False), (True, True, True), (False, True, False),
])  # fmt: skip
def test_policy_packs_where_asked_and_supported_and_keeps_row_order(mode, supports, packed):
    worker = _Worker(supports)
    policy = Policy(
        InProcessGroup(worker),
        max_sequence_length=8,
        train_global_batch_size=4,
        logprob_batch_size=1,
        sequence_packing=mode,
    )
    batch = _batch([3, 7, 2, 5])
    out = policy.get_logprobs(batch)
    assert policy.packing is packed
    assert set(worker.seen) == {"packed" if packed else "padded"}
    # Rows come back in the batch's order, whichever bins they were scored in.
    expected = batch["input_ids"].float() * (torch.arange(7)[None] < batch["lengths"][:, None])
    expected[:, 0] = 0 if packed else expected[:, 0]
    assert torch.equal(out[:, 1:], expected[:, 1:])


def test_packing_true_on_a_backend_without_it_says_what_to_change():
    policy = Policy(
        InProcessGroup(_Worker(False)),
        max_sequence_length=8,
        train_global_batch_size=4,
        sequence_packing=True,
    )
    with pytest.raises(NrlError, match=r"policy\.sequence_packing=auto or false"):
        policy.get_logprobs(_batch([3, 2]))


def test_packing_mode_names():
    assert [packing_mode(v) for v in ("auto", True, False)] == ["auto", "true", "false"]
    with pytest.raises(ValueError, match="auto, true, false"):
        packing_mode("yes")


class _ValueWorker(_Worker):
    """:class:`_Worker` that also trains: its "values" are the token ids (packed or padded)."""

    def forward_backward(self, micro_batch, loss):
        loss(self.compute_logprobs(micro_batch))

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0}


class _FirstPosition:
    """Records what the loss sees at each row's position 0."""

    needs_reference = needs_prev_logprobs = False

    def __init__(self) -> None:
        self.seen: list[float] = []

    def __call__(self, values, batch, stats):
        self.seen += values[:, 0].tolist()
        return values.sum() * 0, {}


def test_a_value_head_keeps_position_0_when_packed():
    """A critic's values (``Policy(values=True)``, what a section with ``value_head`` makes):
    position 0 values the prefix ending at the first token, so packed it is kept, and the
    values (and what the loss reads) equal the padded path's everywhere. Logprobs drop it."""
    from nrl_core.config.schema import CriticConfig, PolicyConfig

    batch = _batch([3, 7, 2, 5])
    batch["loss_mask"] = (torch.arange(7)[None] < batch["lengths"][:, None]).float()
    first = batch["input_ids"][:, 0].float().tolist()
    got = {}
    for mode in (True, False):
        worker = _ValueWorker(True)
        policy = Policy(
            InProcessGroup(worker),
            max_sequence_length=8,
            train_global_batch_size=4,
            logprob_batch_size=1,
            sequence_packing=mode,
            values=True,
        )
        got[mode] = policy.get_logprobs(batch)
        loss = _FirstPosition()
        policy.train(batch, loss)
        assert policy.packing is mode and sorted(loss.seen) == sorted(first), mode
    assert got[True][:, 0].tolist() == first
    assert torch.equal(got[True], got[False])
    section = Policy.from_config(InProcessGroup(_Worker(True)), CriticConfig())
    assert section.values and not Policy.from_config(_Worker, PolicyConfig()).values


class _PairLoss:
    """Refuses micro batches that split a (chosen, rejected) pair, as DPO does."""

    needs_reference = needs_prev_logprobs = False
    rows_per_sample = 2

    def __call__(self, logprobs, batch, stats):
        if logprobs.shape[0] % 2:
            raise ValueError(f"a micro batch of {logprobs.shape[0]} rows splits a pair")
        return logprobs.sum(), {}


class _TrainWorker:
    supports_sequence_packing = True

    def __init__(self) -> None:
        self.rows: list[int] = []

    def forward_backward(self, micro_batch, loss):
        self.rows.append(micro_batch.rows)
        loss(torch.zeros(1, micro_batch.total))

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0}


def test_a_rank_out_of_bins_runs_a_whole_pair_as_filler():
    """Ranks may plan different numbers of bins; the filler pass of the one with fewer must
    hold a whole pair (found by the 2-rank DPO test)."""
    from nrl_core.interfaces import GlobalBatchStats
    from nrl_core.training import train_on_rank

    worker = _TrainWorker()
    stats = GlobalBatchStats(valid_tokens=1, valid_sequences=2, max_sequence_length=4)
    result = train_on_rank(worker, [_batch([3, 4])], 2, _PairLoss(), stats, 1.0, True)
    assert worker.rows == [2, 2] and len(result.micro_batch_metrics) == 1


@pytest.mark.parametrize(
    "lengths",
    [
        [7, 7, 7, 7],  # one equal-length run: a view of the row, no copy
        [9, 9, 9, 5, 17, 1, 9],  # runs, gathered groups and a singleton mixed
        [40, 3, 38, 39, 2],  # similar lengths that are not adjacent in the row
    ],
)
def test_attend_within_samples_is_per_sample_causal_attention(lengths):
    """Values and gradients equal causal attention on each sample alone (GQA 4/2 heads)."""
    import itertools

    from nrl_core.packing import attend_within_samples

    def attend(q, k, v):  # [count, heads, longest, dim] -> [count, longest, heads, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        return out.transpose(1, 2)

    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    out = attend_within_samples(q, k, v, cu, attend)
    want = torch.cat(
        [
            attend(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)))[0]
            for s, e in itertools.pairwise(cu.tolist())
        ]
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # A causal attention over the whole row (samples leaking into each other) differs.
    if len(lengths) > 1:
        leaky = attend(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0]
        assert (leaky - want).abs().max() > 1e-3


class _SizeWorker:
    """One rank that records the tokens of every micro batch it computes on: ``rows x width``
    padded (the trimmed micro batch), ``total`` packed."""

    def __init__(self, supports: bool) -> None:
        self.supports_sequence_packing = supports
        self.tokens: list[int] = []

    def _seen(self, micro_batch) -> torch.Tensor:
        if isinstance(micro_batch, PackedSequences):
            self.tokens.append(micro_batch.total)
            return micro_batch.input_ids.float()
        self.tokens.append(micro_batch["input_ids"].numel())
        return micro_batch["input_ids"].float()

    def compute_logprobs(self, micro_batch, *, reference=False):
        return self._seen(micro_batch)

    def forward_backward(self, micro_batch, loss):
        loss(self._seen(micro_batch))

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0}


def _sum_loss(logprobs, batch, stats):
    return logprobs.sum(), {}


_sum_loss.needs_reference = _sum_loss.needs_prev_logprobs = False


@pytest.mark.parametrize("step", ["logprobs", "train"])
def test_packed_bins_never_exceed_the_padded_peak_of_the_same_data(step):
    """Review m2: bins of ``rows x max_total_sequence_length`` tokens fill up to that worst
    case on every step, while the padded path reaches it only when a sample has the maximum
    length. One long sample and many short ones, max_total_sequence_length far above both: the
    largest packed bin must not hold more tokens than the largest padded micro batch."""
    lengths = [300] + [60] * 31  # skewed: one long response, the rest short
    batch = _batch(lengths)
    batch["loss_mask"] = torch.ones_like(batch["input_ids"])

    def passes(mode: str) -> list[int]:
        worker = _SizeWorker(True)
        policy = Policy(
            InProcessGroup(worker),
            max_sequence_length=1024,
            train_global_batch_size=len(lengths),
            train_micro_batch_size=4,
            logprob_batch_size=4,
            sequence_packing=mode,
        )
        if step == "logprobs":
            policy.get_logprobs(batch)
        else:
            policy.train(batch, _sum_loss)
        assert worker.tokens, "the worker computed nothing"
        return worker.tokens

    padded, packed = passes("false"), passes("true")
    # The padded chunk holding the long sample: 4 rows x 300; packing must not go beyond it
    # (with the old 4 x 1024 budget every sample fits one bin of 300 + 31 x 60 = 2160 tokens).
    assert max(padded) == 4 * max(lengths)
    assert max(packed) <= max(padded)
    # Packing still packs: every token once, in fewer passes than padded chunks.
    assert sum(packed) == sum(lengths) and len(packed) < len(padded)


def test_padded_peak_tokens_is_the_largest_trimmed_chunk():
    from nrl_core.policy import padded_peak_tokens

    shards = [_batch([5, 1, 1, 9, 2]), _batch([3, 3])]
    # Shard 0 in chunks of 2: [5, 1] -> 10, [1, 9] -> 18, [2] -> 2; shard 1: [3, 3] -> 6.
    assert padded_peak_tokens(shards, 2) == 18
    assert padded_peak_tokens(shards, 5) == 45
    assert padded_peak_tokens([Batch()], 4) == 1


def test_attention_of_every_layer_reads_no_boundaries_from_the_device():
    """Review m8: attend_within_samples read cu_seqlens to the host in every layer (a GPU sync
    per layer). A packed micro batch moved to its device carries its boundaries on the host;
    on the meta device (no data) any read of the device tensor fails."""
    import torch.nn.functional as F

    from nrl_core.packing import attend_within_samples

    packed = pack(_batch([5, 3, 5, 2])).to("meta")
    assert packed.cu_seqlens.device.type == "meta"
    calls = []

    def attend(q, k, v):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
            1, 2
        )

    q = torch.empty(packed.total, 4, 8, device="meta")
    kv = torch.empty(packed.total, 2, 8, device="meta")
    for _layer in range(3):
        out = attend_within_samples(q, kv, kv, packed.cu_seqlens, attend)
        assert out.shape == (packed.total, 4, 8)
    assert calls  # the kernel ran, on the samples the host boundaries name
    # A caller holding the host list may pass it; the same split results.
    out = attend_within_samples(q, kv, kv, packed.cu_seqlens, attend, bounds=[0, 5, 8, 13, 15])
    assert out.shape == (15, 4, 8)


def test_host_boundaries_follow_an_in_place_change():
    from nrl_core.packing import host_boundaries

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_boundaries(cu) == [0, 3, 7]
    cu[2] = 9  # a new version of the tensor: read again, not the remembered values
    assert host_boundaries(cu) == [0, 3, 9]
