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
