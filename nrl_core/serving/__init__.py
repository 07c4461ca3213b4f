"""The OpenAI-compatible policy endpoint: any generation backend served over HTTP.

- :mod:`~nrl_core.serving.prompts`: OpenAI chat messages (and tools) to prompt token ids,
  token-exact across turns (the splice of carried ids);
- :mod:`~nrl_core.serving.tool_calls`: tool calls parsed out of generated text;
- :mod:`~nrl_core.serving.batcher`: concurrent requests served by one backend call;
- :mod:`~nrl_core.serving.errors`: the request errors answered with HTTP 400;
- :mod:`~nrl_core.serving.app`: the FastAPI routes; :mod:`~nrl_core.serving.server`: the
  server object that ``nrl serve`` and agent-driven runs start.

Nothing here is imported by ``nrl_core`` at start-up: fastapi and uvicorn load only when a
server starts.
"""
