"""Colocated generation on the Megatron model (``MegatronPolicyWorker.generate``), on CPU.

Tolerances, float32: generation logprobs vs ``get_logprobs`` of the same sequences within 1e-5
absolute (different batch shapes through the same forward); greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import greedy_hf, requires_megatron, sequences_batch
from test_megatron import WORKER, context, make_config, megatron_options

from nrl_core.interfaces import SamplingParams
from nrl_core.policy import Policy

pytestmark = requires_megatron


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 90, (n,), generator=g).tolist() for n in lengths]


def truncate_at(tokens, stop_ids):
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_hugging_face(tp, tiny_path, pool1, pool2, start_group):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_path).eos_token_id
    prompts = prompts_of([3, 7, 5])
    want = [truncate_at(t, {eos}) for t in greedy_hf(str(tiny_path), prompts, 8)]
    pool = pool1 if tp == 1 else pool2
    group = start_group(pool, WORKER, (megatron_options(tp), context(make_config(tiny_path))))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    # One item per data-parallel shard: tensor-parallel peers get the same prompts.
    outs = group.run_sharded("generate", [prompts] * group.dp_size, params)
    out = outs[0]
    assert all(o == out for o in outs)
    assert out.token_ids == want
    assert out.finish_reasons == ["stop" if t[-1] == eos else "length" for t in want]
    # Greedy logprobs are log_softmax(logits) at T=1, what get_logprobs computes at T=1.
    policy = Policy.from_config(group, make_config(tiny_path).policy)
    lp = policy.get_logprobs(sequences_batch(prompts, out.token_ids))
    for i, (p, g) in enumerate(zip(prompts, out.token_ids, strict=True)):
        got = lp[i, len(p) : len(p) + len(g)]
        torch.testing.assert_close(got, torch.tensor(out.logprobs[i]), rtol=0, atol=1e-5)


def test_sampled_logprobs_match_training_logprobs_and_are_seeded(tiny_path, pool1, start_group):
    config = make_config(tiny_path, temperature=0.7)
    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    prompts = prompts_of([4, 9, 2, 6, 3, 5], seed=1)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=5)
    out = group.run_all("generate", prompts, params)[0]
    assert all(1 <= len(t) <= 10 for t in out.token_ids)
    assert [len(t) for t in out.token_ids] == [len(lp) for lp in out.logprobs]
    lp = Policy.from_config(group, config.policy).get_logprobs(
        sequences_batch(prompts, out.token_ids)
    )
    for i, (p, g) in enumerate(zip(prompts, out.token_ids, strict=True)):
        got = lp[i, len(p) : len(p) + len(g)]
        torch.testing.assert_close(got, torch.tensor(out.logprobs[i]), rtol=0, atol=1e-5)
    assert group.run_all("generate", prompts, params)[0] == out  # same seed, same samples
    other = group.run_all("generate", prompts, SamplingParams(10, 0.7, seed=6))[0]
    assert other.token_ids != out.token_ids


def test_stops_and_truncation_are_honoured(tiny_path, pool1, start_group):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    group = start_group(pool1, WORKER, (megatron_options(), context(make_config(tiny_path))))
    prompt = prompts_of([5], seed=2)
    free = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    base = group.run_all("generate", prompt, free)[0]
    tokens = base.token_ids[0]
    if base.finish_reasons[0] == "stop":  # sampled EOS early: nothing left to test against
        pytest.skip("the seeded sample hit EOS early")
    assert len(tokens) == 12 and base.finish_reasons == ["length"]

    # A stop token id: the sample ends at its first occurrence, which it includes.
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    by_id = group.run_all(
        "generate", prompt, SamplingParams(12, 1.0, stop_token_ids=(stop_id,), seed=3)
    )[0]
    assert by_id.token_ids == [tokens[: first + 1]] and by_id.finish_reasons == ["stop"]

    # A stop string (the tiny tokenizer is character level), here given per sample.
    text = next(t for t in map(tokenizer.decode, tokens[6:]) if len(t) == 1)
    by_string = group.run_all("generate", prompt, free, [[text]])[0]
    first = next(i for i, t in enumerate(tokens) if tokenizer.decode([t]) == text)
    assert by_string.token_ids == [tokens[: first + 1]] and by_string.finish_reasons == ["stop"]

    # top_k=1 and a tiny top_p both reduce sampling to the argmax.
    greedy = group.run_all("generate", prompt, SamplingParams(12, 0.0))[0].token_ids
    for params in (
        SamplingParams(12, 1.0, top_k=1, seed=9),
        SamplingParams(12, 1.0, top_p=1e-6, seed=9),
    ):
        assert group.run_all("generate", prompt, params)[0].token_ids == greedy
