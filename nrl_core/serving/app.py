"""The HTTP routes of the policy endpoint (FastAPI), in the shapes OpenAI clients, NeMo Gym and
verifiers read.

- ``GET /v1/models``: the model id and ``max_model_len``.
- ``POST /v1/chat/completions``: messages (+ tools) in, ``n`` choices out (a request's own
  ``seed`` reproduces; choice i uses ``seed + i``, as vLLM does), whole or streamed
  (``stream``: server-sent chunks, sent once the answer is generated). Each assistant message
  carries ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs`` (NeMo
  RL's names, which NeMo Gym reads; a stream's last chunk of a choice carries them in its
  delta); sent back in a later request's history they make its prompt token-exact
  (:mod:`nrl_core.serving.prompts`). A stop string is cut from the content, not from the
  token ids. With ``logprobs``, each token's entry is ``"token_id:<id>"`` when
  ``return_tokens_as_token_ids`` is set (vLLM's convention), its text otherwise. What cannot
  be honoured exactly (``top_logprobs`` > 0, ``response_format`` other than text,
  penalties, ``logit_bias``) is a 400 naming the field; another model name a 404. A forced
  ``tool_choice`` (``required`` or a named function) appends the tool parser's call opening to
  the prompt (:mod:`nrl_core.serving.tool_calls`): its tokens are prompt tokens.
- ``POST /tokenize``: the prompt ids a chat request would get (same splice), or a text's ids.
- ``POST /inference/v1/generate``: token ids in, token ids and logprobs out (verifiers' client).

Bad input is answered 400 with OpenAI's error shape and one message naming what is wrong:
every sampling field is checked for its type and range here, before anything reaches the
request batcher (whose loop must outlive any one request). A body over
``server.max_request_bytes`` is answered 413, one not received within
``server.read_timeout_s`` 408; chat templates and tokenisation run in a worker thread, so one
large request does not hold up the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nrl_core.serving.batcher import SEED_LIMIT
from nrl_core.serving.errors import GenerationFailed, RequestError, SamplingError
from nrl_core.serving.prompts import PromptError
from nrl_core.serving.reasoning import split_reasoning
from nrl_core.serving.request_checks import (
    check_ids,
    check_messages,
    check_text_length,
    is_int,
    parse_body,
    read_capped,
    sampling_fields,
    too_large,
    vocab_size,
)
from nrl_core.serving.tool_calls import ToolParser, decode_keeping, load_parser, tool_names

if TYPE_CHECKING:
    from nrl_core.interfaces import SamplingParams
    from nrl_core.serving.batcher import RequestBatcher
    from nrl_core.serving.prompts import PromptBuilder


class ServedPolicy(Protocol):
    """What the routes read of the server they serve (a
    :class:`~nrl_core.serving.server.PolicyServer`, which builds the app: not imported here)."""

    api_key: str | None
    config: Any
    """The server section of the run config (body-size limit, read timeout, API key)."""
    model_id: str
    max_model_len: int
    tokenizer: Any
    prompts: PromptBuilder
    tool_parser: Any
    """The name of the tool parser (``server.tool_parser``, ``auto`` resolved), looked up in
    the server's ``registry`` attribute when it has one (the run's), else in the installed
    plugins'."""
    reasoning_parser: str | None
    batcher: RequestBatcher
    sampling_for: Callable[..., SamplingParams]
    """A request's sampling, from its keywords (see ``PolicyServer.sampling_for``)."""
    enforced: SamplingParams | None
    """The training run's sampling, while one is enforced (requests' own seeds are not used)."""


MAX_CHOICES = 64
"""The most choices (``n``) one chat request may ask for."""
UNHONOURED = {
    # field: (the values that ask for nothing, why anything else is refused)
    "frequency_penalty": ((None, 0, 0.0), "no penalties are applied in sampling"),
    "presence_penalty": ((None, 0, 0.0), "no penalties are applied in sampling"),
    "repetition_penalty": ((None, 1, 1.0), "no penalties are applied in sampling"),
    "logit_bias": ((None, {}), "logits are not biased in sampling"),
}


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _answer(exc: Exception) -> JSONResponse:
    status = getattr(exc, "status", 400)
    kind = {404: "NotFoundError"}.get(status, "invalid_request_error")
    return _error(status, str(exc), "server_error" if status >= 500 else kind)


@attrs.frozen
class ForcedCall:
    """A request's forced ``tool_choice``: the call opening appended to its prompt."""

    opening: str
    """The parser's text that opens the call (:meth:`ToolParser.opening`)."""
    name: str | None
    """The named function; None for ``required`` (any of the request's tools)."""
    names: tuple[str, ...]
    """The request's tool names: a call to another function is not returned as a call."""


def forced_call(body: dict[str, Any], parser: ToolParser | None, parser_name: str):
    """The :class:`ForcedCall` of a request's ``tool_choice``, or None (``auto``, ``none``,
    absent); a 400 for a malformed one, one without ``tools``, a named function not among
    them (as vLLM answers it), or a parser that cannot open a call."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    name = None
    if choice != "required":
        function = choice.get("function", choice) if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if (
            not isinstance(choice, dict)
            or choice.get("type", "function") != "function"
            or not isinstance(name, str)
            or not name
        ):
            raise RequestError(
                f"tool_choice={choice!r:.80} is not one of 'auto', 'none', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
    tools = body.get("tools")
    names = tool_names([_tool_for_template(t) for t in tools]) if isinstance(tools, list) else []
    if not names:
        raise RequestError(f"tool_choice={choice!r:.80} needs `tools` (the functions to call)")
    if name is not None and name not in names:
        raise RequestError(
            f"Tool {name!r:.80} has not been passed in `tools` (tool_choice names it; the "
            f"tools are {', '.join(names)})"
        )
    opening = parser.opening(name) if parser is not None else None
    if not opening:
        raise RequestError(
            f"tool_choice={choice!r:.80} cannot be honoured: server.tool_parser={parser_name} "
            "cannot open a call; use tool_choice 'auto' (or a parser that can force one)"
        )
    return ForcedCall(opening, name, tuple(names))


def create_app(server: ServedPolicy) -> FastAPI:
    """The FastAPI app serving ``server``'s backend. Raises ``ValueError`` when
    ``server.tool_parser`` names no registered parser."""
    app = FastAPI(title="nrl policy endpoint", docs_url=None, redoc_url=None)
    parser = load_parser(server.tool_parser, getattr(server, "registry", None))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "auth")
        return await call_next(request)

    for bad_input in (RequestError, PromptError, SamplingError, GenerationFailed):
        app.add_exception_handler(bad_input, lambda request, exc: _answer(exc))

    async def body_of(request: Request) -> dict[str, Any]:
        limit = server.config.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(too_large(limit), 413)
        try:
            raw = await asyncio.wait_for(read_capped(request, limit), server.config.read_timeout_s)
        except TimeoutError:
            raise RequestError(
                f"the request body did not arrive within server.read_timeout_s="
                f"{server.config.read_timeout_s:g} s",
                408,
            ) from None
        return await asyncio.to_thread(parse_body, raw)

    async def generated(
        prompt: list[int], params: Any, stops: list[str] | None, reproducible: bool = False
    ) -> Any:
        try:
            return await server.batcher.submit(prompt, params, stops, reproducible=reproducible)
        except Exception as exc:  # the backend failed this request (and only this one)
            first = next(iter(str(exc).strip().splitlines()), "")
            raise GenerationFailed(f"generation failed: {type(exc).__name__}: {first}") from exc

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_id,
                    "object": "model",
                    "owned_by": "nrl",
                    "max_model_len": server.max_model_len,
                }
            ],
        }

    def chat_prompt(body: dict[str, Any]) -> list[int]:
        check_messages(body.get("messages"), server.max_model_len)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("`tools` must be a list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("`chat_template_kwargs` must be an object")
        if body.get("tool_choice") == "none":
            tools = None  # the model is not to call any: it is not shown them
        forced = forced_call(body, parser, server.tool_parser)
        ids = server.prompts.build(
            body.get("messages"),
            [_tool_for_template(t) for t in tools or []],
            chat_template_kwargs=kwargs or None,
        )
        if forced is not None:
            # The call's opening is the server's, not the model's: prompt tokens, so training
            # never counts them as sampled, and the next turn's prompt still starts with
            # this turn's prompt + generation ids.
            opening = server.tokenizer(forced.opening, add_special_tokens=False)["input_ids"]
            ids = [*ids, *opening]
        return ids

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        check_model(body, server.model_id)
        n = _choice_count(body)
        stream, include_usage = _streaming(body)
        refuse_unhonoured(body)
        sampling = sampling_fields(body, vocab_size(server))
        stops = _stops(body.get("stop"))
        prompt = await asyncio.to_thread(chat_prompt, body)
        params = server.sampling_for(max_tokens=_budget(server, body, prompt), **sampling)
        # A request's own seed reproduces (the run's enforced seed is the batcher's business);
        # choice i of n uses seed + i, as vLLM does.
        reproducible = sampling["seed"] is not None and server.enforced is None
        every = [
            attrs.evolve(params, seed=(params.seed + i) % SEED_LIMIT)
            if reproducible and i
            else params
            for i in range(n)
        ]
        dones = await asyncio.gather(*(generated(prompt, p, stops, reproducible) for p in every))
        forced = forced_call(body, parser, server.tool_parser)
        choices = await asyncio.to_thread(
            lambda: [
                _choice(server, body, i, prompt, d, stops, parser, forced)
                for i, d in enumerate(dones)
            ]
        )
        generated_count = sum(len(done.token_ids) for done in dones)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_id,
            "choices": choices,
            "prompt_token_ids": prompt,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": generated_count,
                "total_tokens": len(prompt) + generated_count,
            },
        }
        if stream:
            return StreamingResponse(_events(answer, include_usage), media_type="text/event-stream")
        return answer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        if "messages" in body:
            ids = await asyncio.to_thread(chat_prompt, body)
        elif isinstance(body.get("prompt"), str):
            check_text_length(len(body["prompt"]), "`prompt`", server.max_model_len)
            ids = await asyncio.to_thread(
                lambda: list(
                    server.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
                )
            )
        else:
            raise RequestError("send `messages` (a chat) or `prompt` (a text)")
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        body = await body_of(request)
        check_model(body, server.model_id)
        vocab = vocab_size(server)
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("`token_ids` must be a non-empty list of token ids")
        check_ids(prompt, "`token_ids`", vocab)
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("`sampling_params` must be an object")
        stop_ids = sampling.get("stop_token_ids") or []
        if not isinstance(stop_ids, list):
            raise RequestError("`sampling_params.stop_token_ids` must be a list of token ids")
        check_ids(stop_ids, "`sampling_params.stop_token_ids`", vocab)
        stops = _stops(sampling.get("stop"))
        fields = sampling_fields(sampling, vocab, where="sampling_params.")
        params = server.sampling_for(
            max_tokens=_budget(server, sampling, prompt, where="sampling_params."),
            **fields,
            stop_token_ids=tuple(stop_ids),
        )
        reproducible = fields["seed"] is not None and server.enforced is None
        done = await generated(prompt, params, stops, reproducible)
        return {
            "request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex}",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "token_ids": done.token_ids,
                    "logprobs": {
                        "content": [
                            {"token": f"token_id:{t}", "logprob": lp}
                            for t, lp in zip(done.token_ids, done.logprobs, strict=True)
                        ]
                    },
                    "finish_reason": done.finish_reason,
                }
            ],
        }

    return app


def _tool_for_template(tool: Any) -> dict[str, Any]:
    """OpenAI's ``{"type": "function", "function": {...}}``, also accepting the Responses API's
    flat ``{"type": "function", "name": ..., "parameters": ...}`` (what NeMo Gym rows hold)."""
    if not isinstance(tool, dict):
        raise RequestError("each of `tools` must be an object")
    if isinstance(tool.get("function"), dict):
        return tool
    if isinstance(tool.get("name"), str):
        function = {k: v for k, v in tool.items() if k not in ("type", "strict")}
        return {"type": "function", "function": function}
    raise RequestError("each of `tools` needs `function.name` (or `name`)")


def _budget(server: ServedPolicy, body: dict[str, Any], prompt: list[int], where: str = "") -> int:
    """``max_tokens`` (or, when it is null or absent, ``max_completion_tokens``, OpenAI's newer
    name) clamped to what the context has left; neither: all the context has left.

    A limit over ``max_model_len`` is refused (400 naming the field), as vLLM refuses it: no
    prompt leaves room for it, so it is a mistake, not a ceiling. A limit within
    ``max_model_len`` that the prompt leaves no room for is clamped to what is left (vLLM's
    ``get_max_tokens``), so an agent keeping one ``max_tokens`` over a growing conversation is
    served until the context is full."""
    left = server.max_model_len - len(prompt)
    if left <= 0:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens, at or over max_model_len="
            f"{server.max_model_len}; shorten the conversation"
        )
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    asked = body.get(name)
    if asked is None:
        return left
    if not is_int(asked) or asked < 1:
        raise RequestError(f"{where}{name} must be a positive integer, got {asked!r:.40}")
    if asked > server.max_model_len:
        raise RequestError(
            f"{where}{name}={asked!r:.40} cannot be greater than max_model_len="
            f"{server.max_model_len} (GET /v1/models); ask for fewer tokens"
        )
    return min(asked, left)


MAX_STOP_STRINGS = 32


def _stops(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("`stop` must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"`stop` holds {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    return list(stops) or None


def check_model(body: dict[str, Any], model_id: str) -> None:
    """A ``model`` other than the one served is a 404, as OpenAI and vLLM answer it (none: the
    served one)."""
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(
            f"The model `{model!s:.80}` does not exist; this server serves `{model_id}` "
            "(GET /v1/models)",
            404,
        )


def _choice_count(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in 1..{MAX_CHOICES}, got {n!r:.40}")
    return n


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``, checked."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r:.40}")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options can only be given with stream=true")
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object")
    usage = options.get("include_usage") or False
    if not isinstance(usage, bool):
        raise RequestError("stream_options.include_usage must be true or false")
    return stream, usage


def refuse_unhonoured(body: dict[str, Any]) -> None:
    """A 400 naming each field this server cannot honour exactly, rather than ignoring it."""
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or top != 0):
        raise RequestError(
            f"top_logprobs={top!r:.40} is not supported: only 0 (each chosen token's logprob "
            "comes with logprobs=true)"
        )
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind != "text":
            raise RequestError(
                f"response_format type {kind!r:.40} is not supported (no guided decoding); "
                "leave response_format out, or ask for the format in the prompt"
            )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be true or false")
    for name, (neutral, why) in UNHONOURED.items():
        if name in body and body[name] not in neutral:
            raise RequestError(f"{name}={body[name]!r:.40} is not supported: {why}; leave it out")


def cut_at_stop(text: str, stops: list[str] | None) -> tuple[str, str | None]:
    """``text`` up to the first of ``stops`` in it, and that stop string (None: none is in
    it). OpenAI and vLLM leave the stop string out of the content."""
    found = [(text.find(stop), stop) for stop in stops or ()]
    found = [(at, stop) for at, stop in found if at >= 0]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


def _choice(
    server: ServedPolicy,
    body: dict[str, Any],
    index: int,
    prompt: list[int],
    done: Any,
    stops,
    parser: ToolParser | None = None,
    forced: ForcedCall | None = None,
) -> dict[str, Any]:
    """One choice of a chat answer.

    The stop string is cut from the content only: ``generation_token_ids`` (and the log probs)
    keep every sampled token, the one that completed the stop string included, since that is
    what the policy sampled and what the next turn's prompt continues from.

    A forced call (``forced``) is parsed from its opening plus the generated text; a call to a
    function other than the one asked for (``required``: other than the request's tools) is
    not returned as a call, and the generated text is then the content (the finish reason is
    the generation's). The finish reason is ``tool_calls`` when calls were parsed, except for
    a named function (``stop``, as OpenAI and vLLM answer it) and a ``required`` call cut by
    the length limit (``length``)."""
    keep = parser.special_tokens if parser is not None else ()
    decoded = decode_keeping(server.tokenizer, done.token_ids, keep) if keep else None
    text, stop_reason = cut_at_stop(decoded or server.prompts.decode(done.token_ids), stops)
    reasoning = None
    if forced is None:  # a forced call opens the answer: there is no reasoning before it
        reasoning, text = split_reasoning(text, server.reasoning_parser)
    if body.get("tool_choice") == "none" or parser is None:
        content, calls = text, []
    elif forced is not None:
        content, calls = parser.parse(forced.opening + text, body.get("tools"))
        wanted = (forced.name,) if forced.name is not None else forced.names
        calls = [call for call in calls if call["function"]["name"] in wanted]
        if not calls:
            content = text
    else:
        content, calls = parser.parse(text, body.get("tools"))
    if body.get("parallel_tool_calls") is False:
        calls = calls[:1]  # vLLM's rule: the first call only
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        # vLLM answered `reasoning_content` before 0.16 and `reasoning` since: both, for both;
        # and a null content when nothing follows the reasoning.
        message.update(content=content or None, reasoning_content=reasoning, reasoning=reasoning)
    if calls:
        message["tool_calls"] = calls
    message.update(
        prompt_token_ids=prompt,
        generation_token_ids=done.token_ids,
        generation_log_probs=done.logprobs,
    )
    finish = "stop" if stop_reason is not None else done.finish_reason
    if calls and (forced is None or (forced.name is None and finish == "stop")):
        finish = "tool_calls"
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if body.get("logprobs"):
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choice["logprobs"] = {
            "content": [
                _logprob_entry(server, token, logprob, as_ids)
                for token, logprob in zip(done.token_ids, done.logprobs, strict=True)
            ]
        }
    # vLLM's token transport, which NeMo Gym also checks against the message's fields:
    # the prompt's ids at the top level, the generated ids in the choice, always together.
    choice["token_ids"] = done.token_ids
    return choice


def _events(answer: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A finished chat answer as OpenAI's server-sent chunks: per choice its role, its content
    (with its logprobs), its tool calls, and a last chunk with the finish reason and the token
    fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` in the
    delta, ``token_ids`` in the choice); then the usage (``include_usage``) and ``[DONE]``."""
    head = {
        "id": answer["id"],
        "object": "chat.completion.chunk",
        "created": answer["created"],
        "model": answer["model"],
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**head, "choices": choices, **extra}
        if include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    for choice in answer["choices"]:
        index, message = choice["index"], choice["message"]
        opening = {"role": "assistant", "content": ""}
        yield event(
            [{"index": index, "delta": opening, "logprobs": None, "finish_reason": None}],
            prompt_token_ids=answer["prompt_token_ids"],
        )
        if message.get("reasoning_content") is not None:
            said = {key: message[key] for key in ("reasoning_content", "reasoning")}
            yield event([{"index": index, "delta": said, "finish_reason": None}])
        if message["content"] or "logprobs" in choice:
            delta = {"content": message["content"] or ""}
            logprobs = choice.get("logprobs")
            yield event(
                [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
            )
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            yield event([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}])
        tokens = {
            key: message[key]
            for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
        }
        last = {
            "index": index,
            "delta": tokens,
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"],
            "token_ids": choice["token_ids"],
        }
        yield event([last])
    if include_usage:
        yield event([], usage=answer["usage"])
    yield "data: [DONE]\n\n"


# -- request validation -------------------------------------------------------------------------


def _logprob_entry(server: ServedPolicy, token: int, logprob: float, as_ids: bool):
    text = server.tokenizer.decode([token])
    return {
        "token": f"token_id:{token}" if as_ids else text,
        "logprob": logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [],
    }
