"""The dtensor policy and the torch generation backend against the core conformance suites
(one process, the tiny model, float32 on CPU)."""

from __future__ import annotations

import pytest
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig

from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig
from nrl_core.interfaces import ComponentContext
from nrl_core.testing.conformance import GenerationConformance, PolicyConformance


def _context(model_path) -> ComponentContext:
    policy = PolicyConfig(
        model_name=str(model_path),
        train_micro_batch_size=3,  # uneven micro batches: the step must not depend on them
        logprob_batch_size=3,
        optimizer=OptimizerConfig(lr=1e-2),
    )
    config = GRPOConfig(seed=0, policy=policy, generation=GenerationConfig(temperature=1.0))
    return ComponentContext(config=config, seed=0)


class TestDTensorPolicy(PolicyConformance):
    registered_name = "dtensor"

    @pytest.fixture
    def policy(self, tiny_model_path):
        from nrl_dtensor.worker import DTensorPolicyWorker

        return DTensorPolicyWorker(DTensorConfig(), _context(tiny_model_path))


class TestTorchGeneration(GenerationConformance):
    registered_name = "torch"

    @pytest.fixture(scope="class")
    @classmethod
    def generator(cls, tiny_model_path):
        from nrl_dtensor.engine import TorchEngine

        # Built through the registry's path: TorchEngine(options, context) loads the model.
        return TorchEngine(TorchGenerationConfig(), _context(tiny_model_path))

    @pytest.fixture
    def tokenizer(self, generator):
        return generator.tokenizer

    @pytest.fixture
    def prompts(self, tokenizer):
        chats = [[{"role": "user", "content": t}] for t in ("12+7=", "3+4=", "(3*4)-5=")]
        texts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in chats
        ]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
