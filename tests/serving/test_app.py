"""The policy endpoint through the real `openai` client (nrl_core.serving.app / server), serving a
tiny model that was taught to call a tool, with real torch generation."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from nrl_core.config.schema import ServerConfig
from nrl_core.interfaces import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "weather in sf?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "sf"}}\n</tool_call>'
ANSWER = "It is sunny in sf."


@pytest.fixture(scope="module")
def tool_model(tiny_model_path, tmp_path_factory):
    """The tiny model taught to answer QUESTION with a get_weather call, and the call's result
    with ANSWER (through the same prompts the endpoint builds)."""
    from transformers import AutoTokenizer

    from nrl_core.serving.prompts import PromptBuilder
    from nrl_core.testing.tiny import memorize

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    builder = PromptBuilder(tokenizer)
    eos = tokenizer.eos_token_id
    first = builder.build(QUESTION, TOOLS)
    call = [*tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"], eos]
    after_tool = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
                }
            ],
            "prompt_token_ids": first,
            "generation_token_ids": call,
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c"},
    ]
    second = builder.build(after_tool, TOOLS)
    answer = [*tokenizer(ANSWER, add_special_tokens=False)["input_ids"], eos]
    return memorize(
        tiny_model_path, tmp_path_factory.mktemp("tool-model"), [(first, call), (second, answer)]
    )


@pytest.fixture(scope="module")
def server(tool_model):
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.serving.server import PolicyServer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    model = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    server = PolicyServer(
        generator.generate,
        tokenizer,
        model_id="tool-tiny",
        max_model_len=512,
        config=ServerConfig(batch_window_ms=50),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    server.enforce(None)
    return openai.OpenAI(base_url=server.base_url, api_key="unused")


def test_models_lists_the_model_and_its_context(client):
    (model,) = client.models.list().data
    assert model.id == "tool-tiny" and model.model_extra["max_model_len"] == 512


def test_chat_with_tools_gives_a_parsed_tool_call_and_continues_token_exactly(client):
    first = client.chat.completions.create(
        model="tool-tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=128
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "sf"}
    carried = choice.message.model_extra
    assert len(carried["generation_token_ids"]) == len(carried["generation_log_probs"])

    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),  # the token fields go back too
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    second = client.chat.completions.create(
        model="tool-tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=128
    )
    assert second.choices[0].message.content == ANSWER
    sampled = carried["prompt_token_ids"] + carried["generation_token_ids"]
    assert second.choices[0].message.model_extra["prompt_token_ids"][: len(sampled)] == sampled


def test_logprobs_come_as_token_ids(client):
    reply = client.chat.completions.create(
        model="tool-tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    message = reply.choices[0].message.model_extra
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{i}" for i in message["generation_token_ids"]]
    assert [e.logprob for e in entries] == pytest.approx(message["generation_log_probs"])
    assert all(lp <= 0 for lp in message["generation_log_probs"])


def test_three_turns_and_tokenize_start_with_every_earlier_turns_ids(client, server):
    messages: list[dict] = [{"role": "user", "content": "count"}]
    sequences = []
    for turn in range(3):
        tokenized = httpx.post(
            server.base_url.removesuffix("/v1") + "/tokenize", json={"messages": messages}
        ).json()
        reply = client.chat.completions.create(
            model="tool-tiny", messages=messages, max_tokens=5, temperature=1.0, seed=turn
        )
        message = reply.choices[0].message
        prompt = message.model_extra["prompt_token_ids"]
        assert tokenized["tokens"] == prompt  # /tokenize gives the same (spliced) prompt
        for earlier in sequences:
            assert prompt[: len(earlier)] == earlier
        sequences.append(prompt + message.model_extra["generation_token_ids"])
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}"}]
    assert len(sequences[-1]) > len(sequences[0])


def test_sixty_four_concurrent_requests_are_served_in_a_few_batches(server):
    before = (server.batcher.stats.requests, server.batcher.stats.backend_calls)

    async def ask_all():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")
        return await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="tool-tiny",
                    messages=[{"role": "user", "content": f"{i}+{i}="}],
                    max_tokens=4,
                )
                for i in range(64)
            )
        )

    replies = asyncio.run(ask_all())
    assert len(replies) == 64
    assert all(r.choices[0].message.model_extra["generation_token_ids"] for r in replies)
    served = server.batcher.stats.requests - before[0]
    calls = server.batcher.stats.backend_calls - before[1]
    assert served == 64
    assert calls <= 8, f"64 requests took {calls} backend calls"


def test_generate_takes_and_returns_token_ids(server):
    prompt = [1, 5, 24, 25, 2, 6]
    body = {
        "model": "tool-tiny",
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 5, "temperature": 1.0, "logprobs": 1},
    }
    out = httpx.post(server.base_url.removesuffix("/v1") + "/inference/v1/generate", json=body)
    answer = out.json()
    assert out.status_code == 200 and answer["prompt_token_ids"] == prompt
    (choice,) = answer["choices"]
    assert 1 <= len(choice["token_ids"]) <= 5
    assert [c["token"] for c in choice["logprobs"]["content"]] == [
        f"token_id:{i}" for i in choice["token_ids"]
    ]


def test_bad_requests_get_a_400_naming_the_problem(client, server):
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model="tool-tiny", messages=QUESTION, n=2)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="tool-tiny", messages=[])
    raw = httpx.post(server.base_url + "/chat/completions", content=b"{not json")
    assert raw.status_code == 400 and "not JSON" in raw.json()["error"]["message"]


def test_during_training_the_runs_sampling_is_enforced(client, server):
    server.enforce(SamplingParams(max_new_tokens=3, temperature=0.7, top_p=1.0, seed=5))
    with pytest.raises(openai.BadRequestError, match=r"temperature=1.0 differs .* temperature=0.7"):
        client.chat.completions.create(model="tool-tiny", messages=QUESTION, temperature=1.0)
    reply = client.chat.completions.create(model="tool-tiny", messages=QUESTION, max_tokens=50)
    assert len(reply.choices[0].message.model_extra["generation_token_ids"]) <= 3


def test_an_api_key_is_required_when_set(tool_model):
    from transformers import AutoTokenizer

    from nrl_core.serving.server import PolicyServer

    def never(*args):
        raise AssertionError("an unauthorised request reached the backend")

    server = PolicyServer(
        never,
        AutoTokenizer.from_pretrained(tool_model),
        model_id="m",
        max_model_len=64,
        config=ServerConfig(api_key="sesame"),
    )
    url = server.start()
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        assert openai.OpenAI(base_url=url, api_key="sesame").models.list().data[0].id == "m"
    finally:
        server.stop()


# -- token-exact turns over HTTP, with tokenizers where re-rendering the text goes wrong ----------


def _served_bpe_model(tmp_path, template: str, completion_text: str):
    """A tiny Llama over the BPE vocabulary of test_prompts (merge a + b -> "ab"), taught to
    answer "go" with ``completion_text`` ("|" separates pieces encoded on their own)."""
    import torch
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nrl_core.serving.prompts import PromptBuilder
    from nrl_core.serving.server import PolicyServer
    from nrl_core.testing.tiny import memorize
    from nrl_core.testing.tokenizers import bpe_tokenizer, ids_of

    tokenizer = bpe_tokenizer(template)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    prompt = PromptBuilder(tokenizer).build([{"role": "user", "content": "go"}])
    completion = []
    for piece in completion_text.split("|"):
        completion += ids_of(tokenizer, piece)
    completion.append(tokenizer.eos_token_id)
    folder = memorize(tmp_path / "base", tmp_path / "taught", [(prompt, completion)])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    server = PolicyServer(
        generator.generate, tokenizer, model_id="bpe", max_model_len=256, config=ServerConfig()
    )
    server.start()
    return server, completion


def test_sampled_ids_that_retokenise_differently_are_kept_across_turns(tmp_path):
    # The model says "ab" as two tokens, "a" then "b"; the text "ab" encodes to one.
    server, sampled = _served_bpe_model(tmp_path, _plain_template(), "a|b")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        first = client.chat.completions.create(
            model="bpe", messages=[{"role": "user", "content": "go"}], temperature=0
        )
        message = first.choices[0].message
        assert message.content == "ab" and message.model_extra["generation_token_ids"] == sampled
        exact = message.model_extra["prompt_token_ids"] + sampled
        follow_up = {"role": "user", "content": "again"}
        with_ids = [{"role": "user", "content": "go"}, message.model_dump(exclude_none=True)]
        as_text = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ab"}]

        second = client.chat.completions.create(
            model="bpe", messages=[*with_ids, follow_up], temperature=0, max_tokens=2
        )
        assert second.choices[0].message.model_extra["prompt_token_ids"][: len(exact)] == exact
        # Without the token fields the history is re-rendered, and the ids differ.
        plain = client.chat.completions.create(
            model="bpe", messages=[*as_text, follow_up], temperature=0, max_tokens=2
        )
        assert plain.choices[0].message.model_extra["prompt_token_ids"][: len(exact)] != exact
    finally:
        server.stop()


def test_a_think_stripping_template_keeps_the_sampled_reasoning_in_the_next_prompt(tmp_path):
    from nrl_core.testing.tokenizers import THINK_STRIPPING_TEMPLATE

    server, sampled = _served_bpe_model(tmp_path, THINK_STRIPPING_TEMPLATE, "<think>hm</think>ab")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        first = client.chat.completions.create(
            model="bpe", messages=[{"role": "user", "content": "go"}], temperature=0
        )
        message = first.choices[0].message
        assert message.model_extra["generation_token_ids"] == sampled
        exact = message.model_extra["prompt_token_ids"] + sampled
        history = [
            {"role": "user", "content": "go"},
            message.model_dump(exclude_none=True),
            {"role": "user", "content": "ok"},
        ]
        tokenized = httpx.post(
            server.base_url.removesuffix("/v1") + "/tokenize", json={"messages": history}
        ).json()["tokens"]
        # The reasoning the model sampled stays; the template would have dropped it.
        assert tokenized[: len(exact)] == exact
        assert len(tokenized) > len(exact)  # and the new user turn follows it
    finally:
        server.stop()


def _plain_template() -> str:
    from nrl_core.testing.tokenizers import PLAIN_TEMPLATE

    return PLAIN_TEMPLATE
