"""Config and output translation for SGLang 0.5.23, without SGLang installed.

The result dicts below mirror what SGLang 0.5.23's ``Engine.generate(input_ids=...,
return_logprob=True)`` returns: ``output_ids`` and ``meta_info`` with ``output_token_logprobs``
(``(logprob, token_id, None)`` triples, ``TokenizerManager.detokenize_logprob_tokens``) and
``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``, ``schedule_batch.FINISH_*``).
"""

from __future__ import annotations

import pytest
from nrl_sglang.config import SglangConfig
from nrl_sglang.translate import (
    TOP_K_ALL,
    engine_kwargs,
    per_request_dicts,
    sampling_dict,
    to_generation_output,
)

from nrl_core.interfaces import SamplingParams


def test_sampling_dict_maps_every_field():
    params = SamplingParams(
        max_new_tokens=9, temperature=0.5, top_p=0.8, top_k=4, stop_token_ids=(2,), seed=1
    )
    d = sampling_dict(params, ["\\n"], seed=1)
    assert d["max_new_tokens"] == 9 and d["temperature"] == 0.5
    assert d["top_p"] == 0.8 and d["top_k"] == 4 and d["n"] == 1
    assert d["stop_token_ids"] == [2] and d["stop"] == ["\\n"]
    assert d["sampling_seed"] == 1 and d["no_stop_trim"] is True


def test_top_k_zero_means_all_and_defaults_are_omitted():
    d = sampling_dict(SamplingParams(top_k=0))
    assert d["top_k"] == TOP_K_ALL
    assert "stop" not in d and "stop_token_ids" not in d and "sampling_seed" not in d


def test_per_request_seeds_and_stops():
    ds = per_request_dicts(SamplingParams(seed=3), 2, [["a"], None], seed_offset=10)
    assert [d["sampling_seed"] for d in ds] == [13, 14]
    assert ds[0]["stop"] == ["a"] and "stop" not in ds[1]


def test_engine_kwargs():
    kw = engine_kwargs(SglangConfig(tensor_parallel_size=2, context_length=512), "m", seed=4)
    assert kw["model_path"] == "m" and kw["tp_size"] == 2 and kw["context_length"] == 512
    assert kw["enable_memory_saver"] is True and kw["random_seed"] == 4
    assert engine_kwargs(SglangConfig(colocated=False), "m", seed=0)["enable_memory_saver"] is False


def _result(ids, lps, kind):
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": kind},
            "output_token_logprobs": [(lp, t, None) for t, lp in zip(ids, lps, strict=True)],
        },
    }


def test_to_generation_output():
    out = to_generation_output(
        [_result([4, 2], [-0.5, -0.25], "stop"), _result([9], [-2.0], "length")]
    )
    assert out.token_ids == [[4, 2], [9]]
    assert out.logprobs == [[-0.5, -0.25], [-2.0]]
    assert out.finish_reasons == ["stop", "length"]


def test_to_generation_output_rejects_abort_and_mismatched_ids():
    with pytest.raises(RuntimeError, match="abort"):
        to_generation_output([_result([4], [-0.5], "abort")])
    bad = _result([4], [-0.5], "stop")
    bad["meta_info"]["output_token_logprobs"] = [(-0.5, 5, None)]
    with pytest.raises(RuntimeError, match="do not match"):
        to_generation_output([bad])


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, 0.6),  # colocated: the policy keeps its training state on the GPU
        ({"colocated": False}, 0.85),  # GPU review 3 m7: a dedicated GPU is the engine's
        ({"colocated": False, "mem_fraction_static": 0.5}, 0.5),  # the user's value wins
        ({"mem_fraction_static": 0.75}, 0.75),
    ],
)
def test_mem_fraction_static_default_depends_on_colocation(options, expected):
    assert engine_kwargs(SglangConfig(**options), "m", seed=0)["mem_fraction_static"] == expected
