"""The HTTP routes of the policy endpoint (FastAPI), in the shapes OpenAI clients, NeMo Gym and
verifiers read.

- ``GET /v1/models``: the model id and ``max_model_len``.
- ``POST /v1/chat/completions``: messages (+ tools) in, one choice out (``n`` = 1). The
  assistant message always carries ``prompt_token_ids``, ``generation_token_ids`` and
  ``generation_log_probs`` (NeMo RL's names, which NeMo Gym reads); sent back in a later
  request's history they make its prompt token-exact (:mod:`nrl_core.serving.prompts`). With
  ``logprobs``, each token's entry is ``"token_id:<id>"`` when
  ``return_tokens_as_token_ids`` is set (vLLM's convention), its text otherwise.
- ``POST /tokenize``: the prompt ids a chat request would get (same splice), or a text's ids.
- ``POST /inference/v1/generate``: token ids in, token ids and logprobs out (verifiers' client).

Bad input is answered 400 with OpenAI's error shape and one message naming what is wrong.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nrl_core.serving.errors import RequestError, SamplingError
from nrl_core.serving.prompts import PromptError
from nrl_core.serving.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from nrl_core.interfaces import SamplingParams
    from nrl_core.serving.batcher import RequestBatcher
    from nrl_core.serving.prompts import PromptBuilder


class ServedPolicy(Protocol):
    """What the routes read of the server they serve (a
    :class:`~nrl_core.serving.server.PolicyServer`, which builds the app: not imported here)."""

    api_key: str | None
    model_id: str
    max_model_len: int
    tokenizer: Any
    prompts: PromptBuilder
    tool_parser: Any
    batcher: RequestBatcher
    sampling_for: Callable[..., SamplingParams]
    """A request's sampling, from its keywords (see ``PolicyServer.sampling_for``)."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def create_app(server: ServedPolicy) -> FastAPI:
    """The FastAPI app serving ``server``'s backend."""
    app = FastAPI(title="nrl policy endpoint", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "auth")
        return await call_next(request)

    for bad_input in (RequestError, PromptError, SamplingError):
        app.add_exception_handler(bad_input, lambda request, exc: _error(400, str(exc)))

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

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
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("`tools` must be a list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("`chat_template_kwargs` must be an object")
        return server.prompts.build(
            body.get("messages"),
            [_tool_for_template(t) for t in tools or []],
            chat_template_kwargs=kwargs or None,
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        if body.get("n", 1) != 1:
            raise RequestError("only n=1 is supported; send n requests instead")
        if body.get("stream"):
            raise RequestError("stream=true is not supported")
        top_logprobs = body.get("top_logprobs") or 0
        if top_logprobs:
            raise RequestError("top_logprobs > 0 is not supported (the chosen token's is given)")
        prompt = chat_prompt(body)
        params = server.sampling_for(
            max_tokens=_budget(server, body, prompt),
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            top_k=body.get("top_k"),
            seed=body.get("seed"),
        )
        stops = _stops(body.get("stop"))
        done = await server.batcher.submit(prompt, params, stops)
        text = server.prompts.decode(done.token_ids)
        content, calls = parse_tool_calls(text, server.tool_parser)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        message.update(
            prompt_token_ids=prompt,
            generation_token_ids=done.token_ids,
            generation_log_probs=done.logprobs,
        )
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if calls else done.finish_reason,
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
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_id,
            "choices": [choice],
            "prompt_token_ids": prompt,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(done.token_ids),
                "total_tokens": len(prompt) + len(done.token_ids),
            },
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        if "messages" in body:
            ids = chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            ids = list(server.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"])
        else:
            raise RequestError("send `messages` (a chat) or `prompt` (a text)")
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        body = await body_of(request)
        prompt = body.get("token_ids")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt)
        ):
            raise RequestError("`token_ids` must be a non-empty list of token ids")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("`sampling_params` must be an object")
        stop_ids = sampling.get("stop_token_ids") or []
        params = server.sampling_for(
            max_tokens=_budget(server, sampling, prompt),
            temperature=sampling.get("temperature"),
            top_p=sampling.get("top_p"),
            top_k=sampling.get("top_k") if sampling.get("top_k", -1) > 0 else None,
            seed=sampling.get("seed"),
            stop_token_ids=tuple(int(i) for i in stop_ids),
        )
        done = await server.batcher.submit(prompt, params, _stops(sampling.get("stop")))
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


def _budget(server: ServedPolicy, body: dict[str, Any], prompt: list[int]) -> int:
    """``max_tokens`` (or ``max_completion_tokens``) clamped to what the context has left."""
    left = server.max_model_len - len(prompt)
    if left <= 0:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens, at or over max_model_len="
            f"{server.max_model_len}; shorten the conversation"
        )
    asked = body.get("max_tokens", body.get("max_completion_tokens"))
    if asked is None:
        return left
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {asked!r}")
    return min(asked, left)


def _stops(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop) or None
    raise RequestError("`stop` must be a string or a list of strings")


def _logprob_entry(server: ServedPolicy, token: int, logprob: float, as_ids: bool):
    text = server.tokenizer.decode([token])
    return {
        "token": f"token_id:{token}" if as_ids else text,
        "logprob": logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [],
    }
