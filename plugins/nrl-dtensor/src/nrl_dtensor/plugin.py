"""Registers the dtensor policy and the colocated torch generation backend with nrl."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_policies(register):
    register(
        "dtensor",
        "nrl_dtensor.worker:DTensorPolicyWorker",
        config="nrl_dtensor.config:DTensorConfig",
        # compute_topk_logprobs and logprobs at given ids: a distillation teacher or student.
        distillation=True,
        # A per-token scalar value head (the `value_head` of a critic section): a PPO critic.
        value_head=True,
        # Takes packed micro batches (nrl_core.packing; see nrl_dtensor.packing).
        sequence_packing=True,
        # Replays the engine's expert choices of a MoE model (policy.moe.router_replay).
        router_replay=True,
        # ... exactly, for these models' routers only (nrl_dtensor.moe._REPLAYABLE): others
        # are refused before anything starts.
        router_replay_models=("qwen3_moe", "qwen3_5_moe"),
        description="FSDP2/DTensor training of Hugging Face causal LMs (CPU with gloo, GPU with NCCL)",
    )


@hookimpl
def nrl_register_generations(register):
    register(
        "torch",
        "nrl_dtensor.engine:TorchEngine",
        config="nrl_dtensor.config:TorchGenerationConfig",
        # Inside the policy workers from the policy's own weights, unless colocated=false asks
        # for separate engines (the registered class).
        colocated=True,
        # Returns each token's expert choices of a MoE model (policy.moe.record_routing).
        records_routing=True,
        description="KV-cache generation inside the policy workers, or on separate refitted engines",
    )
