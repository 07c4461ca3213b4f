"""TorchGenerator on a plain Hugging Face model in one process, and the tiny model builder."""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.generation import TorchGenerator

from nrl_core.interfaces import SamplingParams


@pytest.fixture(scope="module")
def generator(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    return TorchGenerator(model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path))


PROMPTS = [[1, 5, 20, 21, 22], [1, 5, 30], [1, 5, 31, 32, 33, 34, 35]]


def test_tiny_tokenizer_and_chat_template(tiny_path):
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny import resolve_model_name, tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_path)
    # Every digit and operator is one token; decoding round-trips.
    ids = tok.encode("12+7=19\n(3*4)-5 ab", add_special_tokens=False)
    assert len(ids) == len("12+7=19\n(3*4)-5 ab")
    assert tok.decode(ids) == "12+7=19\n(3*4)-5 ab"
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "12+7="}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|bos|><|system|>Be exact.<|eos|><|user|>12+7=<|eos|><|assistant|>"
    assert resolve_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert tiny_model_path(tiny_path.parent) == tiny_path  # cached, not rebuilt


def test_greedy_is_deterministic_and_matches_hf_generate(generator):
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    out = generator.generate(PROMPTS, params)
    assert out.finish_reasons == ["length"] * 3 and all(len(t) == 10 for t in out.token_ids)
    assert generator.generate(PROMPTS, params).token_ids == out.token_ids
    for prompt, tokens in zip(PROMPTS, out.token_ids, strict=True):
        hf = generator.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert hf[0, len(prompt) :].tolist() == tokens
    # top-k 1 and a tiny top-p reduce sampling to greedy.
    assert (
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=10, top_k=1, seed=0)).token_ids
        == out.token_ids
    )
    assert (
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=10, top_p=1e-6, seed=0)).token_ids
        == out.token_ids
    )


def test_sampling_is_reproducible_with_a_seed(generator):
    out = [
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=s)).token_ids
        for s in (1, 1, 2)
    ]
    assert out[0] == out[1]
    assert out[0] != out[2]


def test_stop_tokens_and_stop_strings(generator):
    tok = generator.tokenizer
    greedy = generator.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    # Stop on the token greedy generation produced at step 3 of the first prompt.
    stop_id = greedy.token_ids[0][3]
    out = generator.generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_id,))
    )
    first = greedy.token_ids[0].index(stop_id)
    assert out.token_ids[0] == greedy.token_ids[0][: first + 1] and out.finish_reasons[0] == "stop"
    assert out.logprobs[0] == pytest.approx(greedy.logprobs[0][: first + 1])
    # A per-sample stop string made of the text of steps 4-5 of the second prompt.
    target = next(i for i in range(12) if tok.decode(greedy.token_ids[1][i : i + 2]).strip())
    stop = tok.decode(greedy.token_ids[1][target : target + 2])
    out = generator.generate(
        PROMPTS,
        SamplingParams(max_new_tokens=12, temperature=0.0),
        stop_strings=[None, [stop], None],
    )
    text = tok.decode(out.token_ids[1])
    assert out.finish_reasons[1] == "stop" and text.endswith(stop)
    assert out.token_ids[1] == greedy.token_ids[1][: len(out.token_ids[1])]
    assert stop not in tok.decode(out.token_ids[1][:-1])
    assert out.token_ids[0] == greedy.token_ids[0] and out.finish_reasons[0] == "length"


@pytest.mark.parametrize("prompts", [[PROMPTS[0]] * 4, PROMPTS], ids=["same-length", "padded"])
def test_sampling_equals_hf_generate_and_the_dynamic_cache_bit_for_bit(tiny_path, prompts):
    """Temperature 1 without top-k/top-p, one seed: the preallocated KV cache, the model's
    own DynamicCache (``preallocate_cache=False``) and HF ``generate`` (its DynamicCache,
    multinomial on the seeded global stream) draw the same tokens, with bit-equal logprobs
    (HF's: log_softmax of its scores), left-padded prompts included."""
    from nrl_dtensor.config import TorchGenerationConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    ours = TorchGenerator(
        TorchGenerationConfig(stop_at_eos=False), model=model, tokenizer=tokenizer
    )
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    pre = ours.generate(prompts, params)
    ours.preallocate_cache = False
    dynamic = ours.generate(prompts, params)
    assert pre.token_ids == dynamic.token_ids and pre.logprobs == dynamic.logprobs

    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    torch.manual_seed(7)  # HF samples from the global stream; ours from a Generator seeded 7
    with torch.inference_mode():
        hf = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=24,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = hf.sequences[:, batch["input_ids"].shape[1] :]
    assert tokens.tolist() == pre.token_ids
    logprobs = torch.stack(hf.scores, 1).log_softmax(-1).gather(-1, tokens[..., None])
    assert logprobs.squeeze(-1).tolist() == pre.logprobs
    assert len(set(map(tuple, pre.token_ids))) > 1  # really sampled: the rows differ
