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


@attrs.define
class SglangConfig(EngineOptions):
    """The engine fields the core reads come from
    :class:`~nrl_core.config.schema.EngineOptions`; SGLang's own follow."""

    # Refit goes through SGLang's model load_weights, which takes checkpoint names only
    # (``experts.{e}.gate_proj`` via its make_expert_params_mapping).
    weight_layout: ClassVar[str] = "checkpoint"

    mem_fraction_static: float = option(
        0.6, "Fraction of GPU memory SGLang may use.", validator=between(0, 1, low_open=True)
    )

    def gpu_memory_fraction(self) -> float:
        """The share of each GPU the engine reserves while awake (``mem_fraction_static``):
        what the memory preflight counts beside the policy when colocated."""
        return self.mem_fraction_static

    context_length: int | None = option(
        None, "Context length (default: the model's).", validator=optional(ge(1))
    )
