"""What a request to the endpoint may hold, checked field by field before anything is queued: the
body's size and JSON, token ids, sampling fields, messages and text lengths. Each check raises
:class:`~nrl_core.serving.errors.RequestError` (a 4xx naming the field)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import Request

from nrl_core.data import token_id_problem
from nrl_core.serving.batcher import SEED_LIMIT
from nrl_core.serving.errors import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles a request may use (``developer`` is read as ``system``)."""
CHARS_PER_TOKEN = 64
"""A prompt text longer than ``max_model_len`` times this cannot fit the context under any
tokenizer in use; it is refused before it is tokenised (which could take minutes)."""


def too_large(limit: int) -> str:
    return (
        f"the request body is over server.max_request_bytes={limit}; send less (or raise "
        "server.max_request_bytes)"
    )


async def read_capped(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes (a chunked body declares
    no length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(too_large(limit), 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; anything else (bad JSON, ``NaN``/``Infinity``, nesting
    deeper than the parser allows) is a :class:`RequestError`."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(f"the request body is not JSON: {exc}") from None
    except RecursionError:
        raise RequestError(
            "the request body is not JSON this server reads: nested too deeply"
        ) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can put a surrogate in a str
        where = lone_surrogate_at(body)
        if where is not None:
            raise RequestError(
                f"{where} holds a lone surrogate (a \\ud800-\\udfff escape not "
                "paired as UTF-16), which is not text; send valid Unicode"
            )
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_at(value: Any) -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate (``messages[0].content``,
    or ``a key of messages[0]``), or None. Walked without recursion: the parser allows
    deeper nesting than Python's stack."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return f"a key of {path}" if path else "a key"
                todo.append((name, child))
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def vocab_size(server: Any) -> int:
    """One past the largest token id a request may name (the tokenizer's vocabulary)."""
    return len(server.tokenizer)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ids(ids: list[Any], what: str, vocab: int) -> None:
    problem = token_id_problem(ids, what, vocab)
    if problem is not None:
        raise RequestError(problem)


def _number(body: dict[str, Any], name: str, where: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"{where}{name} must be a finite number, got {value!r:.40}")
    return float(value)


def sampling_fields(body: dict[str, Any], vocab: int, where: str = "") -> dict[str, Any]:
    """``temperature``, ``top_p``, ``top_k`` and ``seed`` of a request, checked: types and
    ranges (temperature 0..100, top_p in (0, 1], top_k an integer in -1..vocabulary size with
    -1 and 0 meaning off, seed an integer in 0..2^63-1); as
    :meth:`~nrl_core.serving.server.PolicyServer.sampling_for` keywords."""

    temperature = _number(body, "temperature", where)
    if temperature is not None and not 0 <= temperature <= 100:
        raise RequestError(f"{where}temperature must lie in 0..100 (0: greedy), got {temperature}")
    top_p = _number(body, "top_p", where)
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"{where}top_p must lie in (0, 1], got {top_p}")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or not -1 <= top_k <= vocab):
        raise RequestError(
            f"{where}top_k must be an integer in -1..{vocab} (-1 or 0: off), got {top_k!r:.40}"
        )
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise RequestError(f"{where}seed must be an integer in 0..2^63-1, got {seed!r:.40}")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k if top_k and top_k > 0 else None,
        "seed": seed,
    }


def check_text_length(length: int, what: str, max_model_len: int) -> None:
    limit = CHARS_PER_TOKEN * max_model_len
    if length > limit:
        raise RequestError(
            f"{what} has {length} characters, more than fits max_model_len={max_model_len} "
            f"tokens (at most {limit}); shorten it"
        )


def check_messages(messages: Any, max_model_len: int) -> None:
    """What the chat template would otherwise trip on: an unknown role, a null content outside
    an assistant message, a non-string name or id; and a text too long for the context."""
    if not isinstance(messages, list):
        return  # normalize_messages names the problem
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return
        role = message.get("role")
        if isinstance(role, str) and role not in ROLES:
            raise RequestError(
                f"messages[{index}].role={role!r:.40} is not a chat role; use one of "
                f"{', '.join(ROLES)}"
            )
        content = message.get("content")
        if content is None and role != "assistant":
            raise RequestError(
                f"messages[{index}] ({role}) has no content; only an assistant message may "
                "have a null content (with tool_calls)"
            )
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise RequestError(f"messages[{index}].{key} must be a string")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
            total += sum(len(p) for p in content if isinstance(p, str))
    check_text_length(total, "`messages`", max_model_len)
