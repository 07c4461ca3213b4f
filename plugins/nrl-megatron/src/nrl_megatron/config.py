"""Options of the megatron policy (``policy.megatron``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import ge, option


@attrs.define
class MegatronConfig:
    tensor_model_parallel_size: int = option(1, "Tensor model parallel degree.", validator=ge(1))
    pipeline_model_parallel_size: int = option(
        1, "Pipeline model parallel degree.", validator=ge(1)
    )
    context_parallel_size: int = option(1, "Context parallel degree.", validator=ge(1))
    expert_model_parallel_size: int = option(1, "Expert parallel degree (MoE).", validator=ge(1))
    transformer_engine: bool = option(
        False, "Use the Transformer Engine layer spec (GPU, extra `te`)."
    )

    def required_modules(self) -> dict[str, tuple[str, str]]:
        """Modules the policy's actors must import for these options: ``{module: (extra of
        nrl-megatron that installs it, the setting that needs it)}``, checked by the driver
        before anything starts (:func:`nrl_core.preflight.check_component_requirements`); the
        actor venv is built with those extras
        (:func:`nrl_core.distributed.actor_env.component_extras`). Transformer Engine is not a
        registered extra: it builds only against CUDA, so it cannot go into every venv."""
        if self.transformer_engine:
            return {"transformer_engine": ("te", "transformer_engine=true")}
        return {}
