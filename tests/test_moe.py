"""The core's router statistics (nrl_core.moe) without a model library: what they count over a
training step's micro batches, and that counting stays on the router's device."""

from __future__ import annotations

import pytest
import torch

from nrl_core.data import Batch
from nrl_core.interfaces import GlobalBatchStats
from nrl_core.moe import RouterStatistics
from nrl_core.packing import PackedSequences
from nrl_core.training import train_on_rank

EXPERTS, TOP_K, HIDDEN = 4, 2, 8


class _TopK(RouterStatistics):
    """A router returning ``[tokens, experts]`` logits; top-k of their softmax."""

    def routing(self, router, args, output):
        probs = torch.softmax(output.float(), dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(TOP_K, dim=-1).indices, 1.0)
        return probs, chosen


class _MoEWorker:
    """One rank of a one-layer 'model': token embeddings through a linear router."""

    supports_sequence_packing = True

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.randn(64, HIDDEN, generator=generator)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=generator))
        self.stats = _TopK([self.router], [EXPERTS])

    def forward_backward(self, micro_batch, loss):
        packed = isinstance(micro_batch, PackedSequences)
        ids = micro_batch.input_ids if packed else micro_batch["input_ids"]
        with self.stats.collecting(micro_batch):
            logits = self.router(self.embed[ids.reshape(-1)])  # batch-major tokens
        loss(logits[:, 0].reshape(ids.shape))

    def optimizer_step(self):
        return {"grad_norm": 0.0, "lr": 1.0, **self.stats.metrics()}


def _loss(logprobs, batch, stats):
    return logprobs.sum(), {}


_loss.needs_reference = _loss.needs_prev_logprobs = False


def _reference(worker: _MoEWorker, micro_batches: list[Batch]) -> dict[str, float]:
    """The statistics of the real tokens alone, computed here from the router weights."""
    tokens = torch.cat(
        [mb["input_ids"][row, :n] for mb in micro_batches for row, n in enumerate(mb["lengths"])]
    )
    with torch.no_grad():
        probs = torch.softmax(worker.router(worker.embed[tokens]), dim=-1).double()
    counts = torch.bincount(probs.topk(TOP_K, dim=-1).indices.reshape(-1), minlength=EXPERTS)
    counts = counts.double()
    return {
        "moe/load_cv": float(counts.std(correction=0) / counts.mean()),
        "moe/max_load": float(counts.max() / counts.mean()),
        "moe/aux_loss": float(EXPERTS * (counts / len(tokens) * probs.mean(0)).sum()),
    }


@pytest.mark.parametrize("packed", [False, True])
def test_filler_micro_batches_count_in_no_router_statistic(packed):
    """Review m3: a rank out of micro batches runs fillers (copies of its first sample) so that
    collectives stay aligned; their tokens are not the step's and must not count in moe/*."""
    ids = torch.arange(30).reshape(3, 10) % 64
    lengths = [torch.tensor([10, 4]), torch.tensor([7])]
    micro_batches = [
        Batch({"input_ids": ids[:2], "lengths": lengths[0]}),
        Batch({"input_ids": ids[2:] * 2 % 64, "lengths": lengths[1]}),
    ]
    worker = _MoEWorker()
    stats = GlobalBatchStats(valid_tokens=21, valid_sequences=3, max_sequence_length=10)
    # 2 real micro batches, 3 filler passes of micro_batches[0]'s first sample.
    result = train_on_rank(worker, micro_batches, 5, _loss, stats, 1.0, packed)
    expected = _reference(worker, micro_batches)
    assert result.step_metrics == pytest.approx(expected, rel=1e-9)
    # The statistics with the fillers counted differ (the test can tell): 21 + 3 x 10 tokens.
    with_fillers = _reference(worker, [*micro_batches, *[micro_batches[0].slice(0, 1)] * 3])
    assert with_fillers["moe/load_cv"] != pytest.approx(expected["moe/load_cv"], rel=1e-6)


def test_counting_never_copies_to_the_host():
    """Review m3: two host copies per MoE layer and micro batch stalled the GPU stream. Sums
    stay on the router's device until metrics() reads them; on the meta device (no data) any
    copy to the host fails."""
    router = torch.nn.Identity()
    stats = _TopK([router], [EXPERTS])
    batch = Batch(
        {"input_ids": torch.zeros(2, 5, dtype=torch.long), "lengths": torch.tensor([5, 3])}
    )
    logits = torch.empty(10, EXPERTS, device="meta")
    with stats.collecting(batch):
        router(logits)
        router(logits)
    assert stats._counts[0].device.type == "meta"
    assert stats._probs[0].device.type == "meta"


# -- router replay (R3, issue 52) ---------------------------------------------------------------


def test_replay_routes_recorded_tokens_as_the_engine_and_counts_agreement():
    """Per (token, layer): the engine's ids where recorded (all k), the router's own elsewhere;
    the agreement compares top-k *sets* (order ignored) over the recorded tokens only."""
    from nrl_core.moe import NOT_RECORDED, RouterReplay

    own = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    # Token 0: same set in another order; 1: other experts; 2: not recorded; 3: half recorded.
    engine = torch.tensor([[1, 0], [0, 1], [NOT_RECORDED] * 2, [3, NOT_RECORDED]])
    routed = engine[None, :, None]  # [B=1, T=4, layers=1, k=2]
    for replay in (True, False):
        state = RouterReplay(1, replay=replay)
        with state.using(routed, count=True):
            chosen = state.choose(0, own)
        expected = torch.tensor([[1, 0], [0, 1], [1, 0], [3, 2]]) if replay else own
        assert torch.equal(chosen, expected)
        assert state.metrics() == {"moe/routing_agreement": 0.5}  # 1 of 2 recorded tokens
        assert state.metrics() == {}  # reset
    # Outside a micro batch with routing, and for logprob passes (count=False): nothing counted.
    state = RouterReplay(1, replay=True)
    assert state.choose(0, own) is own
    with state.using(routed, count=False):
        state.choose(0, own)
    assert state.metrics() == {}


def test_replayed_gate_weights_are_the_engines_with_the_routers_gradient():
    from nrl_core.moe import RouterReplay, replayed_weights

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.0, 3.0]], requires_grad=True)
    own = logits.topk(2, dim=-1).indices
    # The router's own choice: bit-identical to softmax-then-top-k with renormalisation.
    probs = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    expected = probs / probs.sum(-1, keepdim=True)
    assert torch.equal(replayed_weights(logits, own, normalize=True), expected)
    engine_ids = torch.tensor([[1, 2], [3, 2]])
    engine_weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    state = RouterReplay(1, replay=True)
    with state.using(engine_ids[None, :, None], engine_weights[None, :, None], count=False):
        chosen = state.choose(0, own)
        weights = state.gate_weights(0, chosen, replayed_weights(logits, chosen, normalize=True))
    assert torch.equal(weights, engine_weights)
    weights.sum().backward()  # the straight-through term: the router still gets a gradient
    assert logits.grad is not None


def test_an_episode_keeps_the_routing_its_tokens_were_sampled_under():
    """Turn 2's prefill re-routes turn 1's tokens; the episode keeps turn 1's record for them
    and takes turn 2's for what turn 1 left unrecorded (its last token) and the new tokens;
    the batch pads with 'not recorded' and packing keeps each token's routing."""
    from nrl_core.algorithms.rollout import Episode, episodes_to_batch
    from nrl_core.moe import NOT_RECORDED, ROUTED_EXPERTS
    from nrl_core.packing import pack

    episode = Episode(
        group=0, task="t", messages=[], metadata={}, token_ids=[1, 2], prompt_length=2
    )
    episode.append([3, 4], generated=True, logprobs=[-0.1, -0.2])
    # The engine ran tokens 1, 2 (prefill) and 3 (decode), not 4: 3 rows for 4 tokens.
    episode.record_routing(torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]]]))
    assert episode.routed_experts[3].tolist() == [[NOT_RECORDED] * 2]
    episode.append([5], generated=False)
    episode.append([6], generated=True, logprobs=[-0.3])
    episode.record_routing(torch.full((5, 1, 2), 3))  # turn 2: prefill of 5 tokens
    assert episode.routed_experts[:, 0].tolist() == [
        [0, 1],
        [1, 2],
        [2, 3],
        [3, 3],
        [3, 3],
        [-1, -1],
    ]
    short = Episode(group=1, task="t", messages=[], metadata={}, token_ids=[7], prompt_length=1)
    batch = episodes_to_batch([episode, short], torch.zeros(2), pad_token_id=0)
    assert batch[ROUTED_EXPERTS].dtype == torch.int16
    assert batch[ROUTED_EXPERTS].shape == (2, 6, 1, 2)
    assert (batch[ROUTED_EXPERTS][1] == NOT_RECORDED).all()  # no record: the trainer's own
    packed = pack(batch)
    assert packed.routed_experts.shape == (1, 7, 1, 2)
    assert torch.equal(packed.routed_experts[0, :6], batch[ROUTED_EXPERTS][0])
