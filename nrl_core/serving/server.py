"""The policy endpoint as an object: what ``nrl serve`` and agent-driven runs start.

:class:`PolicyServer` holds the generation backend, the tokenizer and the request batcher, and
runs uvicorn in a daemon thread on loopback (unless told otherwise), so the driver can go on
training while agents call it. During training the run's sampling settings are enforced
(:meth:`PolicyServer.enforce`): an agent cannot make its rollouts off-policy by asking for
another temperature.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import attrs

from nrl_core.interfaces import SamplingParams
from nrl_core.serving.batcher import Generate, RequestBatcher
from nrl_core.serving.errors import SamplingError
from nrl_core.serving.prompts import PromptBuilder
from nrl_core.serving.tool_calls import parser_for


class PolicyServer:
    """An OpenAI-compatible endpoint in front of ``generate``.

    Args:
        generate: the generation backend (``GenerationWorker.generate``'s signature).
        tokenizer: the policy's Hugging Face tokenizer (chat template, decoding).
        model_id: the id ``/v1/models`` lists and requests name.
        max_model_len: the longest prompt + completion, in tokens.
        config: a :class:`~nrl_core.config.schema.ServerConfig` (batching, key, tool parser).
        model_type: the model's ``config.model_type``, for the tool-call parser.
    """

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        *,
        model_id: str,
        max_model_len: int,
        config: Any,
        model_type: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.config = config
        self.api_key = config.api_key
        self.prompts = PromptBuilder(tokenizer)
        self.tool_parser = parser_for(model_type, config.tool_parser)
        self.reasoning_parser: str | None = getattr(config, "reasoning_parser", None)
        self.batcher = RequestBatcher(
            generate, window_s=config.batch_window_ms / 1000.0, max_batch=config.max_batch_size
        )
        self.enforced: SamplingParams | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set when the serving thread has ended
        self._app: Any = None

    @property
    def app(self) -> Any:
        """The FastAPI application (built on first use)."""
        if self._app is None:
            from nrl_core.serving.app import create_app

            self._app = create_app(self)
        return self._app

    # -- sampling ------------------------------------------------------------------------------

    def enforce(self, params: SamplingParams | None) -> None:
        """Hold every later request to ``params`` (temperature, top-p, top-k, seed, stop ids,
        and ``max_new_tokens`` as a ceiling); None lets requests choose."""
        self.enforced = params

    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.prompts.end_of_turn_ids))

    def sampling_for(
        self,
        *,
        max_tokens: int,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None = None,
        seed: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> SamplingParams:
        """The sampling of one request: what it asks for, or the enforced settings (a request
        that asks for other values is refused with :class:`SamplingError`)."""
        enforced = self.enforced
        if enforced is None:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p),
                top_k=int(top_k or 0),
                stop_token_ids=tuple(dict.fromkeys([*self.stop_token_ids(), *stop_token_ids])),
                seed=seed,
            )
        for name, asked, run_value in (
            ("temperature", temperature, enforced.temperature),
            ("top_p", top_p, enforced.top_p),
        ):
            if asked is not None and abs(float(asked) - run_value) > 1e-6:
                raise SamplingError(
                    f"{name}={asked} differs from the training run's {name}={run_value}; "
                    f"rollouts must be sampled with the run's settings (leave {name} unset)"
                )
        if top_k and int(top_k) != enforced.top_k:
            raise SamplingError(
                f"top_k={top_k} differs from the training run's top_k={enforced.top_k}"
            )
        return attrs.evolve(
            enforced,
            max_new_tokens=min(max_tokens, enforced.max_new_tokens),
            stop_token_ids=tuple(dict.fromkeys([*enforced.stop_token_ids, *self.stop_token_ids()])),
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> str:
        """Serve in a daemon thread; returns the OpenAI base URL (``http://host:port/v1``)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            from nrl_core.errors import ConfigError

            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror}); choose another server.port "
                "(0 picks a free one)"
            ) from None
        bound_port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        config.load()  # picks the HTTP protocol class (h11 or httptools), wrapped below
        config.http_protocol_class = _header_timeout(
            config.http_protocol_class, self.config.read_timeout_s
        )
        self._server = uvicorn.Server(config)
        server, done = self._server, threading.Event()
        self._done = done

        def serve() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                done.set()

        self._thread = threading.Thread(target=serve, name="nrl-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if done.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"the policy endpoint did not start on {host}:{bound_port}")
            time.sleep(0.02)
        self._socket = sock
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{bound_port}/v1"
        return self.base_url

    def stop(self) -> None:
        """Stop serving and wait for the thread (idempotent)."""
        if self._server is None:
            return
        self._server.should_exit = True
        # Waits on an Event, not Thread.join: on Python < 3.13 a signal handler raising while
        # the main thread is inside join() marks the thread stopped although it still runs,
        # and the socket closed here then broke uvicorn's own shutdown ("Invalid file
        # descriptor: -1" after SIGTERM). uvicorn closes the socket itself once it has stopped.
        if not self._done.wait(timeout=10):
            self._socket.close()  # uvicorn's loop is stuck: free the port anyway
        self._server = None

    def serve_forever(self) -> None:
        """Block until the serving thread ends (Ctrl-C / SIGTERM end it through the caller)."""
        while self._server is not None and not self._done.wait(timeout=0.5):
            pass


def _header_timeout(protocol: type, timeout_s: float) -> type:
    """``protocol`` (uvicorn's HTTP protocol class) closing a connection that has not sent a
    whole request head within ``timeout_s`` of opening or of its previous response.

    uvicorn's own ``timeout_keep_alive`` stops as soon as a first byte arrives, and nothing
    times a new connection's headers: a client sending one byte a minute would hold its
    connection (and, times many, the server's sockets) for ever."""

    class HeaderTimeout(protocol):
        _nrl_timer: Any = None

        def _nrl_arm(self) -> None:
            if self._nrl_timer is not None:
                self._nrl_timer.cancel()
            armed = self.cycle
            self._nrl_timer = self.loop.call_later(timeout_s, self._nrl_expire, armed)

        def _nrl_expire(self, armed: Any) -> None:
            waiting = self.cycle is armed and (armed is None or armed.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()  # no new request head since the timer started

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._nrl_arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._nrl_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._nrl_timer is not None:
                self._nrl_timer.cancel()
            super().connection_lost(exc)

    HeaderTimeout.__name__ = HeaderTimeout.__qualname__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeout
