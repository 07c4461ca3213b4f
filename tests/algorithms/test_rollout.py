"""Rollouts keep token ids end to end (nrl_core.algorithms.rollout), with a real tiny model."""

from __future__ import annotations

import pytest
import torch

from nrl_core.algorithms.rollout import ChatCodec, episodes_to_batch, rollout, start_episodes
from nrl_core.data import Sample
from nrl_core.environments import EnvironmentActor
from nrl_core.interfaces import ComponentContext, SamplingParams
from nrl_core.testing.environments import CountdownEnvironment, FlakyEnvironment


class InProcessPool:
    """The EnvironmentPool's step contract over one EnvironmentActor, without Ray."""

    def __init__(self, actor: EnvironmentActor) -> None:
        self.actor = actor

    def step(self, tasks, conversations, metadata):
        return self.actor.step((conversations, metadata))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def test_multi_turn_sequence_is_exactly_the_generated_and_fed_ids(model_and_tokenizer):
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer, system_prompt="Answer with a number.")
    pool = InProcessPool(EnvironmentActor(CountdownEnvironment, None, ComponentContext(None)))
    samples = [
        Sample([{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b))
        for a, b in [(1, 2), (3, 4)]
    ]
    episodes = start_episodes(samples, codec, repeats=2)
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    params = SamplingParams(
        max_new_tokens=8, temperature=1.0, seed=3, stop_token_ids=(tokenizer.eos_token_id,)
    )
    rollout(episodes, generator.generate, pool, codec, params, max_turns=5, max_total_length=512)

    for episode in episodes:
        assert episode.done and episode.turns == 3  # the environment ends after 3 responses
        prompt_ids = episode.token_ids[: episode.prompt_length]
        assert prompt_ids == codec.encode_prompt(episode.messages[:2])  # system + user
        later = episode.messages[2:]
        assert [m["role"] for m in later] == ["assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in later[1::2]] == ["2 more", "1 more"]
        # The training sequence is the prompt plus exactly the ids of each later message.
        assert episode.token_ids == prompt_ids + [i for m in later for i in m["token_ids"]]
        # The loss mask is 1 on generated ids only.
        expected_mask = [0.0] * len(prompt_ids)
        for message in later:
            expected_mask += [1.0 if message["role"] == "assistant" else 0.0] * len(
                message["token_ids"]
            )
        assert episode.loss_mask == expected_mask
        # Observation ids are the chat-template glue for the new turn, never a re-encoding
        # of the conversation: decoding them gives the observation and the next prompt.
        observation_text = tokenizer.decode(later[1]["token_ids"])
        assert "2 more" in observation_text and observation_text.endswith("<|assistant|>")
        # After the first turn, the environment's stop string "\n" ends each response.
        for message in later[2::2]:
            text = codec.decode(message["token_ids"])
            assert "\n" not in text[:-1]
        # Generation logprobs sit on generated positions only.
        assert all(
            lp == 0.0
            for lp, m in zip(episode.gen_logprobs, episode.loss_mask, strict=True)
            if m == 0.0
        )
        assert episode.metadata["remaining"] == 0 and len(episode.metadata["seen"]) == 3

    batch = episodes_to_batch(episodes, torch.tensor([1.0, -1.0, 0.5, 0.0]), tokenizer.pad_token_id)
    for row, episode in enumerate(episodes):
        n = len(episode.token_ids)
        assert batch["input_ids"][row, :n].tolist() == episode.token_ids
        assert int(batch["lengths"][row]) == n
        assert batch["loss_mask"][row, n:].sum() == 0
    assert torch.equal(batch["advantages"][1], -batch["loss_mask"][1])


def test_sequence_budget_truncates_and_marks_the_episode(model_and_tokenizer):
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    pool = InProcessPool(EnvironmentActor(CountdownEnvironment, None, ComponentContext(None)))
    episodes = start_episodes([Sample([{"role": "user", "content": "go"}], answer="1")], codec, 1)
    budget = episodes[0].prompt_length + 5
    rollout(
        episodes,
        TorchGenerator(model=model, tokenizer=tokenizer).generate,
        pool,
        codec,
        SamplingParams(max_new_tokens=20, seed=0, stop_token_ids=()),
        max_turns=4,
        max_total_length=budget,
    )
    assert episodes[0].truncated and episodes[0].done
    assert len(episodes[0].token_ids) <= budget
    assert episodes[0].finish_reason == "length"


def test_environment_errors_cost_only_the_failing_samples():
    actor = EnvironmentActor(
        "nrl_core.testing.environments:FlakyEnvironment", None, ComponentContext(None)
    )
    conversations = [[{"role": "assistant", "content": text}] for text in ("4", "3", "5", "x")]
    metadata = [{"answer": a} for a in ("4", "3", "6", "8")]
    results = actor.step((conversations, metadata))
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert [r.error is not None for r in results] == [False, True, False, False]
    assert "odd answer 3" in results[1].error and "environments.py" in results[1].error
    assert isinstance(actor.env, FlakyEnvironment)
