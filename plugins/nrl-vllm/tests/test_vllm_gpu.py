"""vLLM on a GPU, through the real engine in the plugin's venv. Never run in this repository
(no GPU); run with ``nrl venvs build vllm`` then ``pytest -m gpu plugins/nrl-vllm/tests`` on a
CUDA machine, with ``NRL_TEST_MODEL`` naming a 0.5B-1.5B HF model folder for the refit timing."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def _engine(model_path, **options):
    from nrl_vllm.config import VllmConfig
    from nrl_vllm.worker import VllmGenerationWorker

    from nrl_core.config.schema import RunConfig
    from nrl_core.interfaces import ComponentContext

    config = RunConfig()
    config.policy.model_name = str(model_path)
    opts = VllmConfig(colocated=False, gpu_memory_utilization=0.3, enforce_eager=True, **options)
    return VllmGenerationWorker(opts, ComponentContext(config=config))


def test_generates_token_ids_and_logprobs(tiny_model_path):
    from nrl_core.interfaces import SamplingParams

    engine = _engine(tiny_model_path, dtype="float32")
    try:
        out = engine.generate([[1, 10, 11], [1, 12]], SamplingParams(max_new_tokens=4, seed=0))
        assert [len(t) for t in out.token_ids] == [4, 4]
        assert all(lp <= 0 for row in out.logprobs for lp in row)
    finally:
        engine.shutdown()


def test_refit_changes_outputs_and_logprobs_match_the_trainer(tiny_model_path):
    """After loading perturbed weights, greedy outputs change, and the engine's logprobs agree
    with a float32 torch forward of the same weights within 1e-3 (float32 engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nrl_core.interfaces import SamplingParams

    engine = _engine(tiny_model_path, dtype="float32")
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        before = engine.generate([[1, 10, 11]], params)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        engine.update_weights(iter([dict(model.state_dict())]))
        after = engine.generate([[1, 10, 11]], params)
        assert after.token_ids != before.token_ids
        ids = torch.tensor([[1, 10, 11, *after.token_ids[0]]])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, 2:-1].float(), -1)
        ref = lp.gather(-1, ids[0, 3:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(after.logprobs[0]), ref, atol=1e-3)
    finally:
        engine.shutdown()


def test_refit_time_of_a_real_model():
    if "NRL_TEST_MODEL" not in os.environ:
        pytest.skip("set NRL_TEST_MODEL to a 0.5B-1.5B model folder")
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from nrl_core.weight_sync import iter_buckets

    path = os.environ["NRL_TEST_MODEL"]
    engine = _engine(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        started = time.perf_counter()
        nbytes = engine.update_weights(iter_buckets(model.state_dict().items(), 512 << 20))
        seconds = time.perf_counter() - started
        print(f"refit {nbytes / 1e9:.2f} GB in {seconds:.2f} s")
        assert nbytes > 0
    finally:
        engine.shutdown()
