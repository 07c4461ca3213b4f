"""Options of the megatron policy (``policy.megatron``). Import-light: only attrs."""

import attrs

from nrl_core.config.schema import option


@attrs.define
class MegatronConfig:
    tensor_model_parallel_size: int = option(1, "Tensor model parallel degree.")
    pipeline_model_parallel_size: int = option(1, "Pipeline model parallel degree.")
    context_parallel_size: int = option(1, "Context parallel degree.")
    expert_model_parallel_size: int = option(1, "Expert parallel degree (MoE).")
    transformer_engine: bool = option(
        False, "Use the Transformer Engine layer spec (GPU, extra `te`)."
    )
