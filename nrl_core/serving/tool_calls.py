"""Tool calls parsed out of generated text, by model family (``server.tool_parser``, vLLM's
``--tool-call-parser`` names). The parsers are components registered through the
``nrl_register_tool_parsers`` hook (:mod:`nrl_core.hookspecs`), the built-ins by the core, so a
plugin adds its own the same way. The built-ins:

- ``hermes`` (Qwen2/2.5/3, Hermes, nrl's tiny test model):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
- ``qwen3_coder`` (Qwen3-Coder's XML style): ``<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter>...</function></tool_call>``; a value is JSON where the tool's schema gives
  the parameter a non-string type, text otherwise.
- ``llama3_json`` (Llama 3.1-3.3): the whole text (after an optional ``<|python_tag|>``) is one
  or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.
- ``mistral`` (Mistral / Mixtral instruct): ``[TOOL_CALLS]`` (a special token) and then a JSON
  list ``[{"name": ..., "arguments": {...}}, ...]``, or (tokenizers v11+) one
  ``[TOOL_CALLS]NAME[ARGS]{...}`` per call. The text is decoded keeping ``[TOOL_CALLS]`` and
  ``[ARGS]`` (:attr:`ToolParser.special_tokens`), which decoding otherwise drops.

The parsed calls are returned in OpenAI's shape, the arguments as a JSON string; the text
outside the calls is the message's content. Malformed calls stay text.

A forced ``tool_choice`` (``required``, or a named function) is honoured without guided
decoding: the parser's :meth:`ToolParser.opening` (the text that opens a call, with the
function's name when one is named) is appended to the prompt, so its tokens are prompt tokens
(never trained as sampled), the model generates the rest, and the opening plus the generated
text is parsed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

BUILTIN_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "mistral")
"""The parsers the core registers (``nrl_core.builtins``)."""
KEYWORDS = ("auto", "none")
"""``server.tool_parser`` values that are not registered parsers: ``auto`` (``hermes``) and
``none`` (no parsing)."""
PARSERS = (*BUILTIN_PARSERS, "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML_CALL = re.compile(
    r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL
)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


class ToolParser:
    """What a registered tool parser is: the target of an ``nrl_register_tool_parsers``
    registration is a subclass (or any class with these members), built with no arguments.

    Subclasses override :meth:`parse` and, to let requests force a call, :meth:`opening`.
    """

    special_tokens: Sequence[str] = ()
    """Special tokens the parser reads (``mistral``: ``[TOOL_CALLS]``): the generated ids are
    decoded keeping these, which decoding with ``skip_special_tokens`` otherwise drops. The
    token id fields of the answer are not affected."""

    def parse(
        self, text: str, tools: list[dict[str, Any]] | None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a generated text: the calls in OpenAI's shape
        (:func:`make_call`), the text outside them as content (None when there is none). A
        malformed call stays in the content; never raises."""
        raise NotImplementedError

    def opening(self, name: str | None) -> str | None:
        """The text that opens a call to function ``name`` up to its arguments (None: opens a
        call to whichever function, up to its name), as the model's chat template writes a
        call. None: this parser cannot force a call (a forced ``tool_choice`` is then a 400)."""
        return None


def parser_for(model_type: str | None, configured: str = "auto") -> str:
    """The parser's name for a model: ``configured`` unless ``auto``; for ``auto``, ``hermes``
    for every family (the convention of most tool-calling models, and the one the tiny test
    model's template renders), so a model that never writes ``<tool_call>`` simply gets no
    calls; the others are chosen by name, as with vLLM's ``--tool-call-parser``. Whether the
    name is registered is checked by :func:`load_parser` (and before a run, by preflight)."""
    if configured != "auto":
        if not isinstance(configured, str) or not configured:
            raise ValueError(f"tool parser {configured!r}; use auto, none or a parser's name")
        return configured
    return "hermes"


def unknown_parser_message(name: str, known: Sequence[str]) -> str:
    """The one line naming an unregistered ``server.tool_parser`` and the known ones."""
    return (
        f"server.tool_parser={name!r} is not a registered tool parser; use one of "
        f"{', '.join([*KEYWORDS, *known])} (a plugin adds more with nrl_register_tool_parsers; "
        "`nrl plugins` lists them)"
    )


def load_parser(name: str, registry: Any = None) -> ToolParser | None:
    """The parser registered as ``name`` (None for ``none``), built; ``registry``: the run's
    (default: the installed plugins'). Raises ``ValueError`` (:func:`unknown_parser_message`)
    for a name nobody registers."""
    if name == "none":
        return None
    if name in _BUILTIN_CLASSES and registry is None:
        return _BUILTIN_CLASSES[name]()  # no plugin discovery needed for the core's own
    if registry is None:
        from nrl_core.plugins import PluginHost

        registry = PluginHost.discover().registry()
    spec = registry.find("tool_parser", name)
    if spec is None:
        raise ValueError(unknown_parser_message(name, registry.names("tool_parser")))
    target = spec.load()
    return target() if isinstance(target, type) else target


def make_call(index: int, raw: str, name: str, arguments: Any) -> dict[str, Any]:
    """One tool call in OpenAI's shape: ``arguments`` as a JSON string, an id derived from the
    call's index and raw text (the same text gives the same id)."""
    return _call(index, raw, name, arguments)


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


def _parse_hermes(text: str):
    if "<tool_call>" not in text:
        return text, []
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


def _parse_mistral(text: str):
    before, marker, rest = text.partition(_MISTRAL_CALLS)
    if not marker:
        return text, []
    calls: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    stripped = rest.lstrip()
    if stripped.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
        try:
            payload, end = decoder.raw_decode(stripped)
        except json.JSONDecodeError:
            return text, []
        items = payload if isinstance(payload, list) else []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return text, []
            arguments = item.get("arguments", item.get("parameters", {}))
            calls.append(_call(len(calls), json.dumps(item), item["name"], arguments))
        after = stripped[end:]
    else:  # v11+: [TOOL_CALLS]NAME[ARGS]{...}, once per call
        after = ""
        for part in rest.split(_MISTRAL_CALLS):
            name, found, arguments_text = part.partition(_MISTRAL_ARGS)
            if not found or not name.strip():
                return text, []
            try:
                arguments, end = decoder.raw_decode(arguments_text.lstrip())
            except json.JSONDecodeError:
                return text, []
            calls.append(_call(len(calls), part, name.strip(), arguments))
            after = arguments_text.lstrip()[end:]
    if not calls:
        return text, []
    content = (before + after).strip()
    return (content or None), calls


class HermesParser(ToolParser):
    """``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks."""

    def parse(self, text, tools):
        return _parse_hermes(text)

    def opening(self, name):
        return '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name else "")


class Qwen3CoderParser(ToolParser):
    """``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>...`` (XML style)."""

    def parse(self, text, tools):
        if "<tool_call>" not in text:
            return text, []
        return _parse_xml(text, tools)

    def opening(self, name):
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")


class Llama3JsonParser(ToolParser):
    """``llama3_json``: the whole text is ``{"name": ..., "parameters": ...}`` objects."""

    def parse(self, text, tools):
        return _parse_llama3_json(text)

    def opening(self, name):
        return '{"name": "' + (f'{name}", "parameters": ' if name else "")


class MistralParser(ToolParser):
    """``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls (or ``NAME[ARGS]{...}``)."""

    special_tokens = (_MISTRAL_CALLS, _MISTRAL_ARGS)

    def parse(self, text, tools):
        return _parse_mistral(text)

    def opening(self, name):
        return _MISTRAL_CALLS + '[{"name": "' + (f'{name}", "arguments": ' if name else "")


_BUILTIN_CLASSES: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parse_tool_calls(
    text: str, parser: str | ToolParser | None, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a generated text; malformed calls stay in the content.
    ``parser``: a parser or a built-in's name (``none`` or None: no parsing); ``tools``: the
    request's tools (``qwen3_coder`` types the parameters by their schema)."""
    if isinstance(parser, str):
        parser = load_parser(parser) if parser in _BUILTIN_CLASSES else None
    if parser is None:
        return text, []
    return parser.parse(text, tools)


def decode_keeping(tokenizer: Any, ids: Sequence[int], keep: Sequence[str]) -> str:
    """The text of ``ids`` with special tokens skipped, except those named in ``keep`` (which
    a parser reads, as Mistral's ``[TOOL_CALLS]``)."""
    vocab = tokenizer.get_vocab() if keep else {}
    kept = {vocab[token]: token for token in keep if token in vocab}
    if not kept:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    pieces, run = [], []
    for token in ids:
        if token in kept:
            pieces.append(tokenizer.decode(run, skip_special_tokens=True))
            pieces.append(kept[token])
            run = []
        else:
            run.append(token)
    pieces.append(tokenizer.decode(run, skip_special_tokens=True))
    return "".join(pieces)


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names of a request's tools (either shape)."""
    return list(_schema_types(tools)) if tools else []
