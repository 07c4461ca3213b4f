"""Tool-call parsers as registered components (``nrl_register_tool_parsers``): a plugin's own
parser used by the endpoint, Mistral's (``[TOOL_CALLS]`` is a special token), a forced
``tool_choice`` under it, and ``parallel_tool_calls``; through the real `openai` client, over
tiny models taught their answers, with real torch generation."""

from __future__ import annotations

import json

import openai
import pytest

from nrl_core import hookimpl
from nrl_core.config.schema import ServerConfig

GO = [{"role": "user", "content": "go"}]
NO = [{"role": "user", "content": "no"}]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TWO_CALLS = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "sf"}}, '
    '{"name": "get_weather", "arguments": {"city": "la"}}]'
)
NOT_A_TOOL = 'nope", "arguments": {}}]'


def _serve(tmp_path, tokenizer, examples, config, registry=None):
    """A tiny Llama over ``tokenizer``, taught each ``(messages, prefix text, answer text)``
    of ``examples`` (greedy, the prompt as the endpoint builds it + ``prefix``), served."""
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM

    from nrl_core.serving.prompts import PromptBuilder
    from nrl_core.serving.server import PolicyServer
    from nrl_core.testing.tiny import memorize, tiny_llama_over
    from nrl_core.testing.tokenizers import ids_of

    tiny_llama_over(tokenizer, tmp_path / "base")
    builder = PromptBuilder(tokenizer)
    taught = [
        (
            [*builder.build(messages), *ids_of(tokenizer, prefix)],
            [*ids_of(tokenizer, answer), tokenizer.eos_token_id],
        )
        for messages, prefix, answer in examples
    ]
    folder = memorize(tmp_path / "base", tmp_path / "taught", taught, max_steps=1200)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    server = PolicyServer(
        generator.generate, tokenizer, model_id="tiny", max_model_len=256, config=config
    )
    if registry is not None:
        server.registry = registry  # what a run's session sets: its plugins' parsers
    server.start()
    return server, taught


class PlusParser:
    """A plugin's parser (what :class:`~nrl_core.serving.tool_calls.ToolParser` asks for): an
    answer ``+NAME`` is a call to NAME without arguments; it cannot force a call."""

    special_tokens = ()

    def parse(self, text, tools):
        if not text.startswith("+") or not text[1:].isalpha():
            return text, []
        call = {"id": "call_0", "type": "function", "function": {"name": text[1:]}}
        call["function"]["arguments"] = "{}"
        return None, [call]

    def opening(self, name):
        return None


class ParserPlugin:
    @staticmethod
    @hookimpl
    def nrl_register_tool_parsers(register):
        register("plus", PlusParser, description="+NAME calls NAME (a test plugin)")


def test_a_plugins_tool_parser_is_registered_listed_and_used_by_the_endpoint(tmp_path, plugin_host):
    from rich.console import Console

    from nrl_core.cli.output import plugins_table
    from nrl_core.testing.tokenizers import bpe_tokenizer

    info = plugin_host.add(ParserPlugin(), "test-parsers")
    assert info.status == "ok", info.error
    registry = plugin_host.registry()
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder", "plus"} <= set(
        registry.names("tool_parser")
    )
    console = Console(record=True, width=200)
    plugins_table(plugin_host.plugins, verbose=True, console=console)
    listed = console.export_text()
    assert "tool_parser" in listed and "plus" in listed and "mistral" in listed

    server, taught = _serve(
        tmp_path, bpe_tokenizer(), [(GO, "", "+get")], ServerConfig(tool_parser="plus"), registry
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        reply = client.chat.completions.create(model="tiny", messages=GO, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get"]
        assert choice.message.model_extra["generation_token_ids"] == taught[0][1]
    finally:
        server.stop()


def test_an_unregistered_tool_parser_is_one_line_naming_the_known_ones(plugin_host):
    from nrl_core.config.schema import ServeConfig
    from nrl_core.errors import ConfigError
    from nrl_core.preflight import check_tool_parser

    registry = plugin_host.registry()
    with pytest.raises(ConfigError) as caught:
        check_tool_parser(ServeConfig(server=ServerConfig(tool_parser="plus")), registry)
    message = str(caught.value)
    assert "server.tool_parser='plus'" in message and "\n" not in message
    assert "hermes, llama3_json, mistral, qwen3_coder" in message
    plugin_host.add(ParserPlugin(), "test-parsers")
    check_tool_parser(ServeConfig(server=ServerConfig(tool_parser="plus")), plugin_host.registry())


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    """A tiny model over a tokenizer with Mistral's specials: "go" is answered with two calls,
    and "no", once a forced call is opened, with a function that is not among the tools."""
    from nrl_core.serving.tool_calls import MistralParser
    from nrl_core.testing.tokenizers import mistral_tokenizer

    opening = MistralParser().opening(None)
    server, taught = _serve(
        tmp_path_factory.mktemp("mistral"),
        mistral_tokenizer(),
        [(GO, "", TWO_CALLS), (NO, opening, NOT_A_TOOL)],
        ServerConfig(tool_parser="mistral", batch_window_ms=0),
    )
    yield server, taught
    server.stop()


def test_mistral_calls_follow_a_special_token_that_decoding_drops(mistral_server):
    server, taught = mistral_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    reply = client.chat.completions.create(model="tiny", messages=GO, tools=WEATHER, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    cities = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"] * 2
    assert cities == ["sf", "la"]
    # The token fields are what was sampled, the [TOOL_CALLS] token included.
    generated = choice.message.model_extra["generation_token_ids"]
    assert generated == taught[0][1]
    assert server.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") == generated[0]

    # Sent back with its token fields, the next prompt continues them exactly.
    history = [
        *GO,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "content": "sunny", "tool_call_id": choice.message.tool_calls[0].id},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=WEATHER, temperature=0, max_tokens=2
    )
    sampled = choice.message.model_extra["prompt_token_ids"] + generated
    assert second.choices[0].message.model_extra["prompt_token_ids"][: len(sampled)] == sampled


def test_parallel_tool_calls_false_keeps_only_the_first_call(mistral_server):
    server, _ = mistral_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="tiny",
            messages=GO,
            tools=WEATHER,
            temperature=0,
            parallel_tool_calls=False,
            stream=stream,
        )
        if stream:
            calls = [
                call
                for chunk in reply
                for choice in chunk.choices
                for call in choice.delta.tool_calls or []
            ]
        else:
            calls = reply.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "sf"}]


def test_a_required_call_to_a_function_not_among_the_tools_is_no_call(mistral_server):
    """tool_choice=required opens a call; the model names a function the request did not
    offer: no tool call comes back, the generated text is the content, and the finish reason
    is the generation's (vLLM's guided decoding could not have produced it at all)."""
    server, taught = mistral_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    reply = client.chat.completions.create(
        model="tiny", messages=NO, tools=WEATHER, tool_choice="required", temperature=0
    )
    choice = reply.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == NOT_A_TOOL
    extra = choice.message.model_extra
    # The opening is in the prompt ids (not sampled); the generation is what was taught.
    assert extra["prompt_token_ids"] == taught[1][0]
    assert extra["generation_token_ids"] == taught[1][1]
