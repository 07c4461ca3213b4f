"""The policy endpoint through the real `openai` client (nrl_core.serving.app / server), serving a
tiny model that was taught to call a tool, with real torch generation."""

from __future__ import annotations

import asyncio
import json
import re

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
    yield from _torch_server(tool_model, batch_window_ms=50)


def _torch_server(model_path, batch_window_ms: float):
    """A started endpoint over ``model_path`` with real torch generation; stopped after."""
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.serving.server import PolicyServer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    server = PolicyServer(
        generator.generate,
        tokenizer,
        model_id="tool-tiny",
        max_model_len=512,
        config=ServerConfig(batch_window_ms=batch_window_ms),
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
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in 1\.\.64"):
        client.chat.completions.create(model="tool-tiny", messages=QUESTION, n=0)
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


def _served_bpe_model(tmp_path, template: str, completion_text: str, server_config=None):
    """A tiny Llama over the BPE vocabulary of test_prompts (merge a + b -> "ab"), taught to
    answer "go" with ``completion_text`` ("|" separates pieces encoded on their own)."""
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM

    from nrl_core.serving.prompts import PromptBuilder
    from nrl_core.serving.server import PolicyServer
    from nrl_core.testing.tiny import memorize, tiny_llama_over
    from nrl_core.testing.tokenizers import bpe_tokenizer, ids_of

    tokenizer = bpe_tokenizer(template)
    tiny_llama_over(tokenizer, tmp_path / "base")
    prompt = PromptBuilder(tokenizer).build([{"role": "user", "content": "go"}])
    completion = []
    for piece in completion_text.split("|"):
        completion += ids_of(tokenizer, piece)
    completion.append(tokenizer.eos_token_id)
    folder = memorize(tmp_path / "base", tmp_path / "taught", [(prompt, completion)])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    server = PolicyServer(
        generator.generate,
        tokenizer,
        model_id="bpe",
        max_model_len=256,
        config=server_config or ServerConfig(),
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


def test_the_reasoning_parser_splits_the_text_and_keeps_the_ids(tmp_path):
    """`<think>` went into the content; with server.reasoning_parser it is `reasoning_content`
    (and vLLM >= 0.16's `reasoning`), whole or streamed, and the ids stay as sampled."""
    from nrl_core.testing.tokenizers import THINK_STRIPPING_TEMPLATE

    server, sampled = _served_bpe_model(
        tmp_path,
        THINK_STRIPPING_TEMPLATE,
        "<think>hm</think>ab",
        server_config=ServerConfig(reasoning_parser="deepseek_r1"),
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        go = [{"role": "user", "content": "go"}]
        message = client.chat.completions.create(model="bpe", messages=go, temperature=0)
        message = message.choices[0].message
        assert message.content == "ab"
        assert message.model_extra["reasoning_content"] == "hm"
        assert message.model_extra["reasoning"] == "hm"
        assert message.model_extra["generation_token_ids"] == sampled
        exact = message.model_extra["prompt_token_ids"] + sampled
        history = [*go, message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        tokenized = httpx.post(
            server.base_url.removesuffix("/v1") + "/tokenize", json={"messages": history}
        ).json()["tokens"]
        assert tokenized[: len(exact)] == exact  # the split text still continues the ids

        deltas = [
            c.choices[0].delta
            for c in client.chat.completions.create(
                model="bpe", messages=go, temperature=0, stream=True
            )
        ]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "hm"
        assert "".join(d.content or "" for d in deltas) == "ab"
        assert deltas[-1].model_extra["generation_token_ids"] == sampled
    finally:
        server.stop()


def _plain_template() -> str:
    from nrl_core.testing.tokenizers import PLAIN_TEMPLATE

    return PLAIN_TEMPLATE


# -- hostile requests (issue 40): each refused alone, the server keeps answering -----------------

GOOD = {"model": "tool-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _chat(**changes):
    return json.dumps({**GOOD, **changes}).encode()


def _generate(token_ids=(1, 5, 24), **sampling):
    body = {"token_ids": list(token_ids), "sampling_params": {"max_tokens": 2, **sampling}}
    return json.dumps(body).encode()


HOSTILE = [
    # (route, body, what the 4xx message names)
    ("chat", _chat(seed="abc"), "seed must be an integer"),
    ("chat", _chat(seed=[1]), "seed must be an integer"),
    ("chat", _chat(seed=10**30), "seed must be an integer in 0..2^63-1"),
    ("chat", _chat(seed=-1), "seed must be an integer"),
    ("chat", _chat(temperature="hot"), "temperature must be a finite number"),
    ("chat", _chat(temperature=-1), "temperature must lie in 0..100"),
    ("chat", _chat()[:-1] + b', "temperature": NaN}', "NaN is not JSON"),
    ("chat", _chat()[:-1] + b', "temperature": Infinity}', "Infinity is not JSON"),
    ("chat", _chat()[:-1] + b', "temperature": 1e400}', "temperature must be a finite number"),
    ("chat", _chat(top_p=0), "top_p must lie in (0, 1]"),
    ("chat", _chat(top_p=5), "top_p must lie in (0, 1]"),
    ("chat", _chat(top_k="x"), "top_k must be an integer"),
    ("chat", _chat(top_k=-5), "top_k must be an integer in -1.."),
    ("chat", _chat(messages=[{"role": "wizard", "content": "hi"}]), "is not a chat role"),
    ("chat", _chat(messages=[{"role": "user", "content": None}]), "(user) has no content"),
    ("chat", _chat(messages=[{"role": "user", "content": "hi", "name": 5}]), "name must be"),
    ("chat", _chat(stop=[""]), "non-empty strings"),
    ("chat", _chat(stop=""), "non-empty string"),
    ("chat", _chat(stop=[1]), "list of non-empty strings"),
    ("chat", DEEP, "nested too deeply"),
    ("chat", _chat(messages=[{"role": "user", "content": "x" * 40_000}]), "max_model_len=512"),
    ("generate", _generate(token_ids=[10**9]), "token ids in 0.."),
    ("generate", _generate(token_ids=[-1]), "token ids in 0.."),
    ("generate", _generate(stop_token_ids=["a"]), "stop_token_ids` must hold token ids"),
    ("generate", _generate(stop_token_ids="a"), "stop_token_ids` must be a list"),
    ("generate", _generate(top_k="x"), "sampling_params.top_k must be an integer"),
    ("generate", _generate(seed="abc"), "sampling_params.seed must be an integer"),
    ("generate", _generate(temperature="hot"), "sampling_params.temperature must be"),
    ("tokenize", json.dumps({"prompt": "x" * 5_000_000}).encode(), "max_model_len=512"),
    # Issue 47: a limit no context holds was clamped (200); vLLM refuses it, naming the field.
    ("chat", _chat(max_tokens=10**9), "max_tokens=1000000000 cannot be greater than max_model_len=512"),
    ("chat", _chat(max_tokens=10**12), "max_tokens=1000000000000 cannot be greater than"),
    ("chat", _chat(max_tokens=None, max_completion_tokens=10**9), "max_completion_tokens=1000000000 cannot be"),
    ("generate", _generate(max_tokens=10**12), "sampling_params.max_tokens=1000000000000 cannot be"),
    # Issue 47: a lone surrogate was a plain-text 500 (the tokenizer cannot encode it).
    ("chat", _chat(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content holds a lone surrogate"),
    ("chat", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]), "messages[0].content[0].text holds a lone surrogate"),
    ("chat", _chat(messages=[{"role": "user", "content": "hi", "\udc00": 1}]), "a key of messages[0] holds a lone surrogate"),
    ("chat", _chat(stop=["\ud800"]), "stop[0] holds a lone surrogate"),
    ("tokenize", json.dumps({"prompt": "x\ud800"}).encode(), "prompt holds a lone surrogate"),
    ("generate", _generate(request_id="\udbff"), "sampling_params.request_id holds a lone surrogate"),
]  # fmt: skip


@pytest.fixture(scope="module")
def plain_server(tiny_model_path):
    """The endpoint over the untrained tiny model (real torch generation): enough for requests
    whose answers are not read."""
    yield from _torch_server(tiny_model_path, batch_window_ms=0)


@pytest.fixture
def plain_client(plain_server):
    plain_server.enforce(None)
    return openai.OpenAI(base_url=plain_server.base_url, api_key="unused")


def test_each_hostile_request_fails_alone_and_the_next_good_one_is_answered(plain_server):
    """Issue 40: `"seed": "abc"` killed the request batcher (every later request hung); other
    wrong types and ranges were 500s or accepted. Each is now a 4xx naming the field, and a
    good request right after it is answered."""
    base = plain_server.base_url.removesuffix("/v1")
    routes = {
        "chat": "/v1/chat/completions",
        "generate": "/inference/v1/generate",
        "tokenize": "/tokenize",
    }
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=base, timeout=30) as http:
        for route, body, names in HOSTILE:
            reply = http.post(routes[route], content=body, headers=headers)
            assert 400 <= reply.status_code < 500, (route, body[:80], reply.text[:300])
            message = reply.json()["error"]["message"]
            assert names in message and "\n" not in message, (body[:80], message)
            good = http.post(routes["chat"], content=_chat(), headers=headers)
            assert good.status_code == 200, (body[:80], good.text[:300])


def test_a_surrogate_pair_is_text_and_a_limit_within_max_model_len_is_clamped(plain_server):
    """The refusals above are exact: an escaped surrogate PAIR (an emoji, as json.dumps writes
    it) is text, and a max_tokens up to max_model_len that the prompt leaves no room for is
    clamped to what is left (vLLM's rule), not refused."""
    base = plain_server.base_url.removesuffix("/v1")
    headers = {"content-type": "application/json"}
    emoji = _chat(messages=[{"role": "user", "content": "hi \U0001f600"}])
    assert b"\\ud83d\\ude00" in emoji
    with httpx.Client(base_url=base, timeout=30) as http:
        reply = http.post("/v1/chat/completions", content=emoji, headers=headers)
        assert reply.status_code == 200, reply.text[:300]
        full = http.post(
            "/v1/chat/completions", content=_chat(max_tokens=512, temperature=0), headers=headers
        )
        assert full.status_code == 200, full.text[:300]
        answer = full.json()
        used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        assert used <= 512


def test_a_request_the_backend_fails_on_fails_alone(tiny_model_path):
    """A request whose generation raises gets a 500; the batcher keeps serving the next."""
    from transformers import AutoTokenizer

    from nrl_core.serving.server import PolicyServer

    def generate(prompts, params, stops):
        if params.max_new_tokens == 3:
            raise RuntimeError("the backend refused this one")
        return type(
            "Out", (), {"token_ids": [[5]], "logprobs": [[-0.5]], "finish_reasons": ["stop"]}
        )

    server = PolicyServer(
        generate,
        AutoTokenizer.from_pretrained(tiny_model_path),
        model_id=GOOD["model"],
        max_model_len=64,
        config=ServerConfig(batch_window_ms=0),
    )
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            bad = http.post("/chat/completions", json={**GOOD, "max_tokens": 3})
            assert bad.status_code == 500
            good = http.post("/chat/completions", json=GOOD)
            assert good.status_code == 200, good.text
    finally:
        server.stop()


def test_a_large_body_and_a_slow_client_are_cut_off(tiny_model_path):
    """A body over server.max_request_bytes is a 413 (declared or chunked), a body that does
    not arrive within server.read_timeout_s a 408, and a connection that does not finish its
    request head within it is closed; a good request is served after each."""
    import socket
    import time

    from transformers import AutoTokenizer

    from nrl_core.serving.server import PolicyServer

    served = []

    def generate(prompts, params, stops):
        served.append(prompts)
        return type(
            "Out", (), {"token_ids": [[5]], "logprobs": [[-0.5]], "finish_reasons": ["stop"]}
        )

    config = ServerConfig(batch_window_ms=0, max_request_bytes=4096, read_timeout_s=1.0)
    server = PolicyServer(
        generate,
        AutoTokenizer.from_pretrained(tiny_model_path),
        model_id=GOOD["model"],
        max_model_len=64,
        config=config,
    )
    url = server.start()
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            big = http.post("/chat/completions", content=b"x" * 5000)
            assert big.status_code == 413 and "max_request_bytes=4096" in big.text
            chunked = http.post("/chat/completions", content=iter([b"x" * 3000] * 2))
            assert chunked.status_code == 413
            assert http.post("/chat/completions", json=GOOD).status_code == 200

            # The head never finishes: the connection is closed after read_timeout_s.
            start = time.monotonic()
            with socket.create_connection((host, int(port)), timeout=10) as slow:
                slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                assert slow.recv(100) == b""
            assert time.monotonic() - start < 5
            # The head arrives, the body does not: 408.
            with socket.create_connection((host, int(port)), timeout=10) as slow:
                head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                slow.sendall(head + b"content-type: application/json\r\n\r\n{")
                assert slow.recv(100).startswith(b"HTTP/1.1 408")
            assert http.post("/chat/completions", json=GOOD).status_code == 200
    finally:
        server.stop()


def test_the_batcher_outlives_a_request_it_cannot_serve():
    """Below the app's validation: a request whose settings break the batcher itself (an
    unhashable seed, a seed it cannot add to) fails alone, and the next one is served."""
    from nrl_core.interfaces import GenerationOutput
    from nrl_core.serving.batcher import RequestBatcher

    def generate(prompts, params, stops):
        return GenerationOutput(
            [[7] for _ in prompts], [[-0.1] for _ in prompts], ["stop"] * len(prompts)
        )

    async def scenario():
        batcher = RequestBatcher(generate, window_s=0.0, max_batch=8)
        for bad_seed in (["unhashable"], "abc"):
            bad = SamplingParams(max_new_tokens=2, seed=bad_seed)
            with pytest.raises(TypeError):
                await asyncio.wait_for(batcher.submit([1, 2], bad, None), 10)
            good = await asyncio.wait_for(batcher.submit([1, 2], SamplingParams(2), None), 10)
            assert good.token_ids == [7]

    asyncio.run(scenario())


# -- what clients send (issue 35, item 4): streaming, n, seeds, stop strings, refused fields -----


def test_a_streamed_answer_is_the_answer_in_chunks_with_the_token_fields_last(client):
    """verifiers' default client streams; it was refused (`stream=true is not supported`)."""
    whole = client.chat.completions.create(
        model="tool-tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=128
    )
    chunks = list(
        client.chat.completions.create(
            model="tool-tiny",
            messages=QUESTION,
            tools=TOOLS,
            temperature=0,
            max_tokens=128,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *answer, usage = chunks
    assert usage.choices == [] and usage.usage.total_tokens == whole.usage.total_tokens
    deltas = [c.choices[0].delta for c in answer]
    assert deltas[0].role == "assistant"
    (call,) = [t for d in deltas for t in d.tool_calls or []]
    assert (
        call.function.name == "get_weather" and call.id == whole.choices[0].message.tool_calls[0].id
    )
    assert json.loads(call.function.arguments) == {"city": "sf"}
    assert answer[-1].choices[0].finish_reason == "tool_calls"
    carried = whole.choices[0].message.model_extra
    last = deltas[-1].model_extra
    for field in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        assert last[field] == carried[field], field


def test_a_seeded_request_gives_the_same_answer_twice(plain_client):
    """The batcher added 7919 x its call count to every seed: a seeded request drew anew."""

    def ask(**kwargs):
        reply = plain_client.chat.completions.create(
            model="tool-tiny",
            messages=[{"role": "user", "content": "tell me something"}],
            temperature=1.0,
            max_tokens=24,
            **kwargs,
        )
        return [c.message.model_extra["generation_token_ids"] for c in reply.choices]

    assert ask(seed=11) == ask(seed=11)
    # n choices of one seeded request are seeds seed, seed + 1, ... (vLLM's rule)
    first, second = ask(seed=11, n=2)
    assert [first] == ask(seed=11) and [second] == ask(seed=12)


def test_n_choices_each_carry_their_own_token_fields(plain_client):
    reply = plain_client.chat.completions.create(
        model="tool-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    generated = 0
    for choice in reply.choices:
        carried = choice.message.model_extra
        assert len(carried["generation_token_ids"]) == len(carried["generation_log_probs"]) >= 1
        assert choice.model_extra["token_ids"] == carried["generation_token_ids"]
        generated += len(carried["generation_token_ids"])
    assert reply.usage.completion_tokens == generated


def test_max_completion_tokens_counts_when_max_tokens_is_null(plain_client):
    """A null `max_tokens` hid `max_completion_tokens`: 133 tokens came back for a limit of 3."""
    reply = plain_client.chat.completions.create(
        model="tool-tiny",
        messages=[{"role": "user", "content": "tell me something long"}],
        max_completion_tokens=3,
        extra_body={"max_tokens": None},
    )
    assert len(reply.choices[0].message.model_extra["generation_token_ids"]) <= 3
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be a positive"):
        plain_client.chat.completions.create(
            model="tool-tiny", messages=QUESTION, max_completion_tokens=0
        )


def test_what_cannot_be_honoured_is_refused_naming_the_field(plain_client):
    """These were accepted and ignored (an unknown model, a forced tool, a JSON format)."""
    with pytest.raises(openai.NotFoundError, match="`gpt-4o` does not exist"):
        plain_client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    refused = [
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs=2 is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format type 'json_object'"),
        ({"tool_choice": "required"}, "tool_choice='required' needs `tools`"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": TOOLS},
            "Tool 'f' has not been passed in `tools`",
        ),
        ({"tool_choice": "forced", "tools": TOOLS}, "tool_choice='forced' is not one of"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ({"logit_bias": {"5": 10}}, "logit_bias="),
        ({"stream_options": {"include_usage": True}}, "stream_options can only be given"),
    ]
    for fields, names in refused:
        with pytest.raises(openai.BadRequestError, match=re.escape(names)):
            plain_client.chat.completions.create(model="tool-tiny", messages=QUESTION, **fields)
    text = plain_client.chat.completions.create(
        model="tool-tiny", messages=QUESTION, response_format={"type": "text"}, max_tokens=2
    )
    assert text.choices[0].message.model_extra["generation_token_ids"]


def test_tool_choice_none_parses_no_call(client):
    reply = client.chat.completions.create(
        model="tool-tiny",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=128,
    )
    choice = reply.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
    # The tools are not in the prompt either: the model is not to call one.
    with_tools = client.chat.completions.create(
        model="tool-tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=1
    )
    prompt = choice.message.model_extra["prompt_token_ids"]
    assert len(prompt) < len(with_tools.choices[0].message.model_extra["prompt_token_ids"])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_is_forced_in_the_prompt_and_the_next_turn_continues_it(client, server):
    """The call's opening (with the function's name) is appended to the prompt: its ids are
    prompt ids, the model generates the arguments, and the parsed call comes back with
    finish_reason "stop" (OpenAI's and vLLM's answer to a named function). The next turn's
    prompt starts with this turn's prompt + generation ids (NeMo Gym's contiguity)."""
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '  # hermes's, as the template
    assert CALL_TEXT.startswith(opening)
    plain = client.chat.completions.create(
        model="tool-tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=1
    ).choices[0]
    first = client.chat.completions.create(
        model="tool-tiny",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0,
        max_tokens=128,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "sf"}
    extra = choice.message.model_extra
    # The prompt is the question's, then the opening's ids; the model generated the rest.
    question = plain.message.model_extra["prompt_token_ids"]
    assert extra["prompt_token_ids"][: len(question)] == question
    forced = extra["prompt_token_ids"][len(question) :]
    assert server.tokenizer.decode(forced) == opening
    generated = extra["generation_token_ids"]
    assert server.tokenizer.decode(generated, skip_special_tokens=True).startswith('{"city"')
    assert first.usage.completion_tokens == len(generated) == len(extra["generation_log_probs"])
    tokenized = httpx.post(
        server.base_url.removesuffix("/v1") + "/tokenize",
        json={"messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED},
    ).json()["tokens"]
    assert tokenized == extra["prompt_token_ids"]  # /tokenize gives the same prompt

    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    second = client.chat.completions.create(
        model="tool-tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=128
    )
    sampled = extra["prompt_token_ids"] + generated
    assert second.choices[0].message.model_extra["prompt_token_ids"][: len(sampled)] == sampled
    assert second.choices[0].message.content == ANSWER


def test_tool_choice_required_opens_a_call_and_the_model_names_the_tool(client, server):
    reply = client.chat.completions.create(
        model="tool-tiny",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=128,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "sf"}
    generated = choice.message.model_extra["generation_token_ids"]
    assert server.tokenizer.decode(generated, skip_special_tokens=True).startswith("get_weather")


def test_a_tool_call_the_way_verifiers_chat_client_asks_for_it(server):
    """verifiers (not in nrl's lock) calls AsyncOpenAI with its max_tokens renamed to
    `max_completion_tokens` and earlier assistant messages carrying `reasoning_content`
    (null); streamed or not, the call and the token fields come back. (It also marks tools
    `strict`, which the chat template renders: a prompt the taught model was not taught.)"""
    strict = TOOLS

    async def ask(stream: bool):
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")
        sampling = {"max_completion_tokens": 128, "temperature": 0.0}
        if not stream:
            return await client.chat.completions.create(
                model="tool-tiny", messages=QUESTION, tools=strict, **sampling
            )
        chunks = await client.chat.completions.create(
            model="tool-tiny", messages=QUESTION, tools=strict, stream=True, **sampling
        )
        return [chunk async for chunk in chunks]

    whole = asyncio.run(ask(stream=False))
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    chunks = asyncio.run(ask(stream=True))
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in streamed] == ["get_weather"]
    last = chunks[-1].choices[0].delta.model_extra
    assert (
        last["generation_token_ids"] == whole.choices[0].message.model_extra["generation_token_ids"]
    )
    history = [
        *QUESTION,
        {**whole.choices[0].message.model_dump(exclude_none=True), "reasoning_content": None},
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    second = client.chat.completions.create(
        model="tool-tiny", messages=history, tools=strict, max_completion_tokens=128, temperature=0
    )
    assert second.choices[0].message.content == ANSWER


def test_a_plain_answer_streams_without_usage_unless_asked(plain_client):
    whole = plain_client.chat.completions.create(
        model="tool-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=4
    )
    stream = plain_client.chat.completions.create(
        model="tool-tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        seed=4,
        stream=True,
    )
    text, tokens = "", None
    for chunk in stream:
        assert chunk.usage is None  # not asked for
        text += chunk.choices[0].delta.content or ""
        tokens = chunk.choices[0].delta.model_extra.get("generation_token_ids", tokens)
    assert text == whole.choices[0].message.content
    assert tokens == whole.choices[0].message.model_extra["generation_token_ids"]


def test_a_stop_string_is_cut_from_the_content_and_kept_in_the_token_ids(
    plain_client, plain_server
):
    """`stop=['#']` answered `'JJ#'`: the stop string stayed in the content."""

    def ask(**kwargs):
        reply = plain_client.chat.completions.create(
            model="tool-tiny",
            messages=[{"role": "user", "content": "go on"}],
            temperature=0,
            max_tokens=24,
            **kwargs,
        )
        return reply.choices[0]

    text = ask().message.content
    stop = text[len(text) // 2 :][:2]  # a stop string the greedy answer reaches mid-way
    assert len(text) >= 6 and stop.strip(), text
    choice = ask(stop=[stop])
    assert choice.message.content == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    sampled = plain_server.prompts.decode(choice.message.model_extra["generation_token_ids"])
    assert stop in sampled  # the ids keep what was sampled, the stop string's token included
