"""Registers the Megatron-Core policy with nrl."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_policies(register):
    register(
        "megatron",
        "nrl_megatron.worker:MegatronPolicyWorker",
        extras=["engine"],
        config="nrl_megatron.config:MegatronConfig",
        # Takes packed micro batches (nrl_core.packing) in Megatron's THD layout.
        sequence_packing=True,
        # A per-token scalar value head (the `value_head` of a critic section): a PPO critic
        # (nrl_megatron.model.ValueHead), packed sequences included.
        value_head=True,
        description="Megatron-Core training (TP/PP/CP/EP) with Hugging Face weight conversion",
    )
