"""Options of the dtensor policy (``policy.dtensor``) and torch generation (``generation.torch``).

Import-light: only attrs. The CLI validates configs with these classes without torch.
"""

import attrs

from nrl_core.config.schema import option


@attrs.define
class DTensorConfig:
    tensor_parallel_size: int = option(
        1,
        (
            "Tensor parallel degree via DTensor plans (Llama/Qwen2-style models); must divide the "
            "number of ranks and the number of key/value heads."
        ),
    )
    activation_checkpointing: bool = option(False, "Recompute activations in backward.")
    cpu_offload: bool = option(False, "FSDP2 CPU offload of parameters and gradients.")
    micro_batch_token_budget: int | None = option(
        None,
        (
            "If set, pack micro batches up to this many (unpadded) tokens instead of a fixed "
            "number of samples."
        ),
    )


@attrs.define
class TorchGenerationConfig:
    generation_batch_size: int = option(64, "Prompts generated together per rank.")
    stop_at_eos: bool = option(
        True, ("Stop a sample at the tokenizer's EOS token (off only for fixed-length benchmarks).")
    )
