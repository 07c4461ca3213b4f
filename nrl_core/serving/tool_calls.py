"""Tool calls parsed out of generated text, by model family (``server.tool_parser``, vLLM's
``--tool-call-parser`` names):

- ``hermes`` (Qwen2/2.5/3, Hermes, nrl's tiny test model):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
- ``qwen3_coder`` (Qwen3-Coder's XML style): ``<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter>...</function></tool_call>``; a value is JSON where the tool's schema gives
  the parameter a non-string type, text otherwise.
- ``llama3_json`` (Llama 3.1-3.3): the whole text (after an optional ``<|python_tag|>``) is one
  or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.

The parsed calls are returned in OpenAI's shape, the arguments as a JSON string; the text
outside the calls is the message's content. Malformed calls stay text.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

PARSERS = ("hermes", "qwen3_coder", "llama3_json", "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML_CALL = re.compile(
    r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL
)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def parser_for(model_type: str | None, configured: str = "auto") -> str:
    """The parser for a model: ``configured`` unless ``auto``; for ``auto``, ``hermes`` for every
    family (the convention of most tool-calling models, and the one the tiny test model's
    template renders), so a model that never writes ``<tool_call>`` simply gets no calls; the
    others are chosen by name, as with vLLM's ``--tool-call-parser``."""
    if configured != "auto":
        if configured not in PARSERS:
            raise ValueError(f"tool parser {configured!r}; use auto, {', '.join(PARSERS)}")
        return configured
    return "hermes"


def _call(index: int, raw: str, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    digest = hashlib.sha1(f"{index}:{raw}".encode()).hexdigest()[:12]
    return {
        "id": f"call_{digest}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _schema_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: {parameter: JSON-schema type}}`` of a request's tools (either shape)."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(properties, dict):
            types[function["name"]] = {
                key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)
            }
    return types


def _parse_xml(text: str, tools: list[dict[str, Any]] | None):
    types = _schema_types(tools)
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        name, body = match.group(1), match.group(2)
        arguments: dict[str, Any] = {}
        for key, value in _XML_PARAMETER.findall(body):
            kind = types.get(name, {}).get(key)
            if kind in (None, "string"):
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value  # as vLLM: a value that is not JSON stays text
        calls.append(_call(len(calls), match.group(0), name, arguments))
        return ""

    content = _XML_CALL.sub(take, text).strip()
    return ((content or None), calls) if calls else (text, [])


def _parse_llama3_json(text: str):
    rest = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(rest):
        try:
            payload, end = decoder.raw_decode(rest, at)
        except json.JSONDecodeError:
            return text, []
        arguments = (
            payload.get("arguments", payload.get("parameters"))
            if isinstance(payload, dict)
            else None
        )
        if not isinstance(payload.get("name") if isinstance(payload, dict) else None, str):
            return text, []
        if arguments is None:
            return text, []
        calls.append(_call(len(calls), rest[at:end], payload["name"], arguments))
        at = end
        while at < len(rest) and (rest[at].isspace() or rest[at] == ";"):
            at += 1
    return None, calls


def parse_tool_calls(
    text: str, parser: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a generated text; malformed calls stay in the content.
    ``tools``: the request's tools (``qwen3_coder`` types the parameters by their schema)."""
    if parser == "llama3_json":
        return _parse_llama3_json(text)
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    if parser == "qwen3_coder":
        return _parse_xml(text, tools)
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return match.group(0)
        calls.append(
            _call(len(calls), match.group(1), payload["name"], payload.get("arguments", {}))
        )
        return ""

    content = _HERMES.sub(take, text).strip()
    if not calls:
        return text, []
    return (content or None), calls
