"""SGLang on a GPU through the real engine (never run in this repository; see
docs/generation-engines.md): ``nrl venvs build sglang`` then ``pytest -m gpu plugins/nrl-sglang``."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_generates_and_refit_changes_outputs(tiny_model_path):
    import torch
    from nrl_sglang.config import SglangConfig
    from nrl_sglang.worker import SglangGenerationWorker
    from transformers import AutoModelForCausalLM

    from nrl_core.config.schema import RunConfig
    from nrl_core.interfaces import ComponentContext, SamplingParams

    config = RunConfig()
    config.policy.model_name = str(tiny_model_path)
    engine = SglangGenerationWorker(
        SglangConfig(colocated=False, mem_fraction_static=0.3, dtype="float32"),
        ComponentContext(config=config),
    )
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        before = engine.generate([[1, 10, 11]], params)
        assert len(before.token_ids[0]) == len(before.logprobs[0]) > 0
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        state = {k: v.cuda() for k, v in model.state_dict().items()}
        engine.update_weights(iter([state]))
        assert engine.generate([[1, 10, 11]], params).token_ids != before.token_ids
    finally:
        engine.shutdown()
