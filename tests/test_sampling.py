"""nrl_core.sampling: greedy, top-k/top-p filtering, the logprob convention, seeded streams and
the sampled distribution, plus that both colocated generators use this one function."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.interfaces import SamplingParams
from nrl_core.sampling import RANK_SEED_STRIDE, sample, seeded_generator


def random_logits(rows=6, vocab=11, seed=0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def reference_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float64 by hand: ``x - log(sum(exp(x)))``."""
    scaled = logits.double() / temperature
    top = scaled.max(dim=-1, keepdim=True).values
    return scaled - (top + (scaled - top).exp().sum(dim=-1, keepdim=True).log())


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def draw(logits_row: list[float], params: SamplingParams, n=20_000, seed=1234) -> torch.Tensor:
    """``n`` independent draws from one row of logits (one batched call, fixed seed)."""
    logits = torch.tensor([logits_row]).expand(n, -1)
    tokens, _ = sample(logits, params, seeded_generator(seed, 0, "cpu"))
    return tokens


def test_greedy_is_argmax_with_the_untempered_logprob_and_draws_nothing():
    logits = random_logits()
    rng = seeded_generator(7, 0, "cpu")
    state = rng.get_state()
    tokens, logprobs = sample(logits, SamplingParams(temperature=0.0), rng)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    expected = reference_logprobs(logits, 1.0).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(rng.get_state(), state)  # greedy consumes no randomness


def test_top_k_1_is_greedy():
    logits = random_logits(rows=32)
    tokens, logprobs = sample(logits, SamplingParams(temperature=0.7, top_k=1), torch.Generator())
    assert torch.equal(tokens, logits.argmax(dim=-1))
    # The logprob is still the tempered, untruncated one (not 0 after renormalising).
    expected = reference_logprobs(logits, 0.7).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-6, rtol=0)
    assert (logprobs < 0).all()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = random_logits(rows=32)
    params = SamplingParams(temperature=1.3, top_p=1e-6)
    for seed in range(5):
        tokens, _ = sample(logits, params, seeded_generator(seed, 0, "cpu"))
        assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_k=4),
        SamplingParams(temperature=0.8, top_p=0.6),
        SamplingParams(temperature=1.5, top_k=5, top_p=0.9),
    ],
    ids=["t1", "t0.5", "t2-topk4", "t0.8-topp0.6", "t1.5-topk5-topp0.9"],
)
def test_logprob_is_log_softmax_of_tempered_logits_at_the_token(params):
    logits = random_logits(rows=64, vocab=13, seed=3).to(torch.bfloat16)
    tokens, logprobs = sample(logits, params, seeded_generator(5, 0, "cpu"))
    assert tokens.shape == logprobs.shape == (64,)
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    full = reference_logprobs(logits.float(), params.temperature)
    expected = full.gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=0)


def test_seeded_streams_are_deterministic_and_differ_per_rank():
    logits = random_logits(rows=64, vocab=50)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40)
    first = sample(logits, params, seeded_generator(11, 2, "cpu"))
    again = sample(logits, params, seeded_generator(11, 2, "cpu"))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # The per-rank offset: rank r of seed s is the plain stream of s + RANK_SEED_STRIDE * r.
    plain = torch.Generator().manual_seed(11 + RANK_SEED_STRIDE * 2)
    assert torch.equal(sample(logits, params, plain)[0], first[0])
    other_rank = sample(logits, params, seeded_generator(11, 3, "cpu"))
    assert not torch.equal(other_rank[0], first[0])
    # A stream advances: a second call from the same generator draws differently.
    rng = seeded_generator(11, 2, "cpu")
    sample(logits, params, rng)
    assert not torch.equal(sample(logits, params, rng)[0], first[0])


def test_draws_follow_the_tempered_softmax():
    row = [2.0, 1.0, 0.5, 0.0, -1.0]
    temperature = 0.8
    tokens = draw(row, SamplingParams(temperature=temperature))
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, dim=-1)
    # 20k draws: the standard error of each frequency is below 0.0036; 0.015 is > 4 sigma.
    torch.testing.assert_close(frequencies(tokens, len(row)), probs, atol=0.015, rtol=0)


def test_draws_follow_the_renormalised_top_k_and_top_p_sets():
    probs = [0.5, 0.3, 0.15, 0.05]
    row = [math.log(p) for p in probs]
    # top-k 3 keeps the three most likely, renormalised.
    got = frequencies(draw(row, SamplingParams(top_k=3)), 4)
    torch.testing.assert_close(
        got, torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95, atol=0.015, rtol=0
    )
    # top-p 0.7: the mass before the 3rd token (0.8) reaches 0.7, so only the first two stay.
    got = frequencies(draw(row, SamplingParams(top_p=0.7)), 4)
    torch.testing.assert_close(
        got, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64), atol=0.015, rtol=0
    )


def test_top_k_is_applied_before_top_p():
    # top-k 2 renormalises to (4/7, 3/7); top-p 0.5 then keeps the first alone. Top-p on the
    # full distribution (mass 0.4 before the 2nd token) would have kept two.
    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    tokens = draw(row, SamplingParams(top_k=2, top_p=0.5), n=2_000)
    assert tokens.eq(0).all()


def test_both_colocated_generators_use_the_core_sampler():
    dtensor = pytest.importorskip("nrl_dtensor.generation")
    assert dtensor.sample is sample and dtensor.seeded_generator is seeded_generator
    megatron = pytest.importorskip("nrl_megatron.generation")
    assert megatron.sample is sample and megatron.seeded_generator is seeded_generator
