"""Tool calls parsed out of generated text, by model family.

Only the Hermes convention is implemented (Qwen2/2.5/3, Hermes, Llama-3 fine-tunes trained on
it, and nrl's tiny test model): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call. The parsed calls are returned in OpenAI's shape, the arguments as a JSON
string; the text outside the blocks is the message's content.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

PARSERS = ("hermes", "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parser_for(model_type: str | None, configured: str = "auto") -> str:
    """The parser for a model: ``configured`` unless ``auto``; for ``auto``, ``hermes`` for every
    family, since it is the only convention implemented (and the one the tiny test model's
    template renders), so a model that never writes ``<tool_call>`` simply gets no calls."""
    if configured != "auto":
        if configured not in PARSERS:
            raise ValueError(f"tool parser {configured!r}; use auto, {', '.join(PARSERS)}")
        return configured
    return "hermes"


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a generated text; malformed blocks stay in the content."""
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return match.group(0)
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        digest = hashlib.sha1(f"{len(calls)}:{match.group(1)}".encode()).hexdigest()[:12]
        calls.append(
            {
                "id": f"call_{digest}",
                "type": "function",
                "function": {"name": payload["name"], "arguments": arguments},
            }
        )
        return ""

    content = _HERMES.sub(take, text).strip()
    if not calls:
        return text, []
    return (content or None), calls
