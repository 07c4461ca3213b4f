"""Tool calls parsed out of generated text (nrl_core.serving.tool_calls)."""

import json

from nrl_core.serving.prompts import PromptBuilder, normalize_messages
from nrl_core.serving.tool_calls import parse_tool_calls, parser_for


def test_hermes_calls_are_parsed_into_openai_tool_calls():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "sf"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "sf"}
    assert calls[0]["id"].startswith("call_")


def test_several_calls_and_only_calls_give_no_content():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"k": [1, 2]}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, "hermes")
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]


def test_malformed_blocks_stay_text_and_never_raise():
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"x": 1}</tool_call>',
        "<tool_call>",
    ):
        assert parse_tool_calls(text, "hermes") == (text, [])
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>', "none")[1] == []


def test_parser_choice():
    assert parser_for("qwen2") == "hermes"
    assert parser_for("llama", "none") == "none"


def test_a_call_rendered_by_the_tiny_template_parses_back():
    from nrl_core.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    builder = PromptBuilder(tokenizer)
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
    }
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    ids = builder.render_ids(normalize_messages(messages), add_generation_prompt=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assistant_text = text.split("hi", 1)[1]
    content, calls = parse_tool_calls(assistant_text, "hermes")
    assert content is None
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "sf"}


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def test_qwen3_coder_xml_calls_are_typed_by_the_tools_schema():
    text = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = parse_tool_calls(text, "qwen3_coder", WEATHER)
    assert content == "Checking."
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    # "42" stays a string (the schema says so), 3 is an integer
    assert json.loads(call["function"]["arguments"]) == {"city": "42", "days": 3}
    # Hermes JSON is not this parser's format: it stays text.
    hermes = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert parse_tool_calls(hermes, "qwen3_coder", WEATHER) == (hermes, [])


def test_llama3_json_calls_are_the_whole_text():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    for prose in ('The answer is {"name": 1}', '{"name": "a"} and then text', '{"no": "name"}'):
        assert parse_tool_calls(prose, "llama3_json") == (prose, [])


def test_mistral_calls_in_both_of_its_formats():
    from nrl_core.serving.tool_calls import MistralParser

    parser = MistralParser()
    listed = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    content, calls = parser.parse("Sure. " + listed, None)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    # Mistral's v11+ tokenizers: one [TOOL_CALLS]NAME[ARGS]{...} per call.
    content, calls = parser.parse('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', None)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    for text in ("[TOOL_CALLS][{bad", '[TOOL_CALLS]a{"x": 1}', "no calls at all"):
        assert parser.parse(text, None) == (text, [])


def test_each_builtin_parser_reads_its_own_forced_opening_back():
    """A forced call is parsed from the parser's opening + what the model generates after it."""
    from nrl_core.serving.tool_calls import load_parser

    rest = {
        "hermes": '{"city": "sf"}}\n</tool_call>',
        "llama3_json": '{"city": "sf"}}',
        "mistral": '{"city": "sf"}}]',
        "qwen3_coder": "<parameter=city>\nsf\n</parameter>\n</function>\n</tool_call>",
    }
    for name, after in rest.items():
        parser = load_parser(name)
        content, calls = parser.parse(parser.opening("get_weather") + after, WEATHER)
        assert content is None, name
        assert [c["function"]["name"] for c in calls] == ["get_weather"], name
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "sf"}, name
        # `required`: the opening stops where the model names the function.
        assert parser.opening("get_weather").startswith(parser.opening(None)), name
