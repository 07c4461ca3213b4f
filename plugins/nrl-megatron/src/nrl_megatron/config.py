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
