"""Options of the SGLang generation backend (``generation.sglang``). Import-light: only attrs."""

from typing import ClassVar

import attrs

from nrl_core.config.schema import (
    ENGINE_DTYPES,
    REFIT_TRANSPORTS,
    EngineOptions,
    between,
    ge,
    option,
    optional,
)

__all__ = ["ENGINE_DTYPES", "REFIT_TRANSPORTS", "SglangConfig"]


COLOCATED_FRACTION = 0.6
"""``mem_fraction_static`` by default when the engine shares the policy's GPU."""
DEDICATED_FRACTION = 0.85
"""``mem_fraction_static`` by default on GPUs of the engine's own."""


@attrs.define
class SglangConfig(EngineOptions):
    """The engine fields the core reads come from
    :class:`~nrl_core.config.schema.EngineOptions`; SGLang's own follow."""

    # Refit goes through SGLang's model load_weights, which takes checkpoint names only
    # (``experts.{e}.gate_proj`` via its make_expert_params_mapping).
    weight_layout: ClassVar[str] = "checkpoint"

    mem_fraction_static: float | None = option(
        None,
        "Fraction of each GPU's memory SGLang may hold for weights and KV cache, in (0, 1]. "
        "Default (null): 0.6 when colocated (the policy keeps its training state on the same "
        "GPU), 0.85 on dedicated GPUs (`colocated=false`), leaving room for the CUDA graphs "
        "and activations SGLang allocates outside this pool.",
        validator=optional(between(0, 1, low_open=True)),
    )

    def gpu_memory_fraction(self) -> float:
        """The share of each GPU the engine reserves while awake: ``mem_fraction_static`` when
        set, else :data:`COLOCATED_FRACTION` or :data:`DEDICATED_FRACTION`. What SGLang is
        given, and what the memory preflight counts beside the policy when colocated."""
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        return COLOCATED_FRACTION if self.colocated else DEDICATED_FRACTION

    context_length: int | None = option(
        None, "Context length (default: the model's).", validator=optional(ge(1))
    )
