"""The ``generation`` section (how responses are generated) and the ``server`` section (the
OpenAI-compatible policy endpoint)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from nrl_core.config.schema.fields import (
    NON_EMPTY,
    ComponentSection,
    between,
    each,
    ge,
    gt,
    one_of,
    option,
)
from nrl_core.registry import ComponentKind

LORA_REFITS = ("auto", "adapters", "merged")
"""``generation.lora_refit`` values (see :func:`nrl_core.weight_sync.adapters.lora_refit_mode`)."""


@attrs.define
class GenerationConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "generation"
    selector: ClassVar[str] = "backend"

    backend: str = option("torch", "Registered generation backend (`torch`, `vllm`, `sglang`).")
    max_new_tokens: int = option(
        128,
        "Most tokens generated per turn (less than policy.max_total_sequence_length).",
        validator=ge(1),
    )
    temperature: float = option(1.0, "Sampling temperature; 0 is greedy.", validator=ge(0))
    top_p: float = option(
        1.0, "Nucleus sampling threshold (1 disables).", validator=between(0, 1, low_open=True)
    )
    top_k: int = option(0, "Top-k sampling (0 disables).", validator=ge(0))
    stop_strings: list[str] = option(
        [],
        "Strings that end a turn (matched on decoded text).",
        validator=each(NON_EMPTY, "a list of non-empty strings"),
    )
    stop_token_ids: list[int] = option(
        [], "Token ids that end a turn (EOS is always one).", validator=each(ge(0))
    )
    lora_refit: str = option(
        "auto",
        (
            "How a LoRA policy (policy.dtensor.lora_rank > 0) refits separate engines: "
            "`adapters` (the engines keep the base weights they loaded and receive only the "
            "adapter tensors at each refit), `merged` (the adapters merged into the base "
            "weights, the whole model streamed), or `auto` (`adapters` where the engine takes "
            "them: torch and vLLM; `merged` otherwise). Ignored without LoRA."
        ),
        validator=one_of(*LORA_REFITS),
    )


@attrs.define
class ServerConfig:
    """The OpenAI-compatible policy endpoint (`nrl serve`, and agent-driven runs)."""

    host: str = option(
        "127.0.0.1",
        "Address to bind; loopback by default (use 0.0.0.0 to expose it, with api_key).",
        validator=NON_EMPTY,
    )
    port: int = option(
        0, "Port to bind (0: a free port, printed at start).", validator=between(0, 65535)
    )
    api_key: str | None = option(
        None, "Bearer token every request must carry (Authorization: Bearer ...); null: none."
    )
    batch_window_ms: float = option(
        20.0,
        (
            "How long the server collects concurrent requests before one backend call serves "
            "them all, in milliseconds (>= 0)."
        ),
        validator=ge(0),
    )
    max_batch_size: int = option(256, "Most requests served by one backend call.", validator=ge(1))
    max_request_bytes: int = option(
        16 << 20,
        (
            "Largest request body accepted, in bytes (>= 1024; a larger one is answered 413). "
            "The default, 16 MiB, holds a long multi-turn history with its carried token ids."
        ),
        validator=ge(1024),
    )
    read_timeout_s: float = option(
        30.0,
        (
            "Seconds a client has to send a request's headers, and again its body (> 0): a "
            "slower connection is closed (headers) or answered 408 (body)."
        ),
        validator=gt(0),
    )
    model_id: str | None = option(
        None, "The model id that /v1/models lists (default: policy.model_name)."
    )
    tool_parser: str = option(
        "auto",
        (
            "How tool calls are parsed out of generated text (vLLM's --tool-call-parser "
            "names): `auto` (`hermes`), `none`, or a registered parser: `hermes` "
            "(<tool_call>JSON</tool_call>), `qwen3_coder` (<tool_call><function=...> XML), "
            "`llama3_json` (bare JSON), `mistral` ([TOOL_CALLS] JSON), or one a plugin "
            "registers (`nrl plugins`)."
        ),
    )
    reasoning_parser: str | None = option(
        None,
        (
            "Split `<think>...</think>` out of the content into `reasoning_content` (vLLM's "
            "--reasoning-parser names): `deepseek_r1`, `qwen3`, or null (no split). The token "
            "ids stay as sampled."
        ),
        validator=one_of(None, "deepseek_r1", "qwen3"),
    )


ENGINE_DTYPES = ("bfloat16", "float16", "float32")
"""Engine dtypes: torch dtype names, since refit casts the policy's tensors to it."""
REFIT_TRANSPORTS = ("auto", "cuda_ipc", "nccl", "shm")
"""``refit_transport`` values (see :func:`nrl_core.generation.resolve_transport`)."""


@attrs.define
class EngineOptions:
    """The options of a separate generation engine that the core reads to place the engines and
    refit them (:func:`nrl_core.generation.start_generation_engines`): the base of an engine
    plugin's config class (``generation.vllm``, ``generation.sglang``), which adds its own.

    A plugin may redeclare a field to change its default or words; it then keeps the same
    meaning and valid range.
    """

    accepts_lora_adapters: ClassVar[bool] = False
    """Whether the engine takes adapter-only LoRA refits (not a config field: a fact about the
    engine): its worker implements ``load_lora_adapter`` (see
    :mod:`nrl_core.weight_sync.adapters`). ``generation.lora_refit=adapters`` is refused for an
    engine that does not, and ``auto`` falls back to ``merged`` there."""

    lora_adapter_extras: ClassVar[tuple[str, ...]] = ()
    """Extras of the engine plugin that its actor venv needs to apply adapters (the torch
    engine's ``lora``, for peft); added only when the run refits adapters."""

    weight_layout: ClassVar[str] = "checkpoint"
    """The weight layout the engine loads at refit (not a config field: a fact about the
    engine): ``"checkpoint"``, the tensors and names of a published Hugging Face folder (each
    expert of a mixture of experts on its own), as vLLM's and SGLang's model loaders take them;
    or ``"in_memory"``, transformers' loaded ``state_dict()`` (experts stacked). The policy's
    refit stream is converted to it (:mod:`nrl_core.weight_sync.layout`)."""

    def in_flight_refit_problem(self) -> str | None:
        """Why these engines cannot take a refit while a generate call is in flight
        (``grpo.async.in_flight_weight_updates``), as the fix a user can make; None when they
        can: their worker accepts weight-sync calls concurrently with ``generate``, lands the
        refit between two decode steps, returns per-token ``weight_versions`` and implements
        ``expect_weight_version``. Default: they cannot."""
        return "choose an engine that takes in-flight refits (generation.backend=torch or vllm)"

    tensor_parallel_size: int = option(1, "GPUs per engine.", validator=ge(1))
    num_engines: int = option(1, "Engines (data parallel).", validator=ge(1))
    colocated: bool = option(
        True,
        "Share GPUs with the policy (the engines sleep whenever the policy needs its GPUs and "
        "are refitted before generating again). On CPU engines are separate actors either way "
        "(with NRL_MEMORY_CONTRACT=1, as in the tests, they still follow the sleep and refit "
        "calls: docs/testing.md).",
    )
    refit_bucket_mb: int = option(
        512, "Size bound of each weight bucket during refit.", validator=ge(1)
    )
    dtype: str = option(
        "bfloat16",
        "Engine weight and activation dtype on GPUs (refit casts to it). Engines on CPU run "
        "float32, the dtype CPU policies train in and send.",
        validator=one_of(*ENGINE_DTYPES),
    )
    refit_transport: str = option(
        "auto",
        "`auto` (cuda_ipc when colocated, nccl otherwise), `cuda_ipc`, `nccl` or `shm`.",
        validator=one_of(*REFIT_TRANSPORTS),
    )

    def gpu_memory_fraction(self) -> float | None:
        """The share of each of its GPUs (0 to 1] the engine reserves while awake (vLLM's
        ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``), resolved for
        ``colocated``; ``None`` when the engine does not say. The memory preflight
        (:mod:`nrl_core.memory_plan`) counts it on the policy's GPUs when the engines are
        colocated; an engine plugin overrides this method."""
        return None
