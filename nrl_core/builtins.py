"""The core's own components, registered through the same plugin manager as third parties."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_clusters(register):
    register(
        "auto",
        # Resolved by the run (nrl_core.distributed.inprocess.cluster_backend); built directly,
        # it is the local cluster.
        "nrl_core.distributed.cluster:LocalCluster",
        description="inprocess where that is exact (1 CPU policy rank, generation in it, no "
        "agents/teacher/async), else local",
    )
    register(
        "inprocess",
        "nrl_core.distributed.inprocess:InProcessCluster",
        description="no Ray: the policy rank, generation and environments in this process",
    )
    register(
        "local",
        "nrl_core.distributed.cluster:LocalCluster",
        description="starts a Ray head in this process; shut down when the run ends",
    )
    register(
        "ray",
        "nrl_core.distributed.ray_cluster:RayCluster",
        description="joins a running Ray cluster (cluster.address or RAY_ADDRESS)",
    )


@hookimpl
def nrl_register_environments(register):
    register(
        "exact_match",
        "nrl_core.environments:ExactMatchEnvironment",
        description="reward 1 when the response's last line equals the answer (core, single turn)",
    )
    register(
        "reward_fn",
        "nrl_core.reward_fn:RewardFunctionEnvironment",
        config="nrl_core.reward_fn:RewardFnConfig",
        description="reward = your Python function, env.reward_fn.path=FILE.py:FUNCTION "
        "(score(prompt, completion, **row) -> float); no plugin needed",
    )
    register(
        "reward_model",
        "nrl_core.reward_model:RewardModelEnvironment",
        config="nrl_core.reward_model:RewardModelEnvConfig",
        description="reward = the score of a trained reward model (`nrl run rm`) folder",
    )


@hookimpl
def nrl_register_agents(register):
    register(
        "env",
        "nrl_core.algorithms.rollout:rollout",
        description="the core's generate / env.step loop on token ids (no HTTP; the default)",
        in_driver=True,
    )


@hookimpl
def nrl_register_datasets(register):
    register(
        "chat",
        "nrl_core.chat_data:ChatDataset",
        config="nrl_core.chat_data:ChatDataConfig",
        extras=["hf"],
        extras_for="Hugging Face hub and saved datasets (JSONL files need nothing)",
        description="conversations (JSONL messages or a Hugging Face dataset) for SFT",
    )
    register(
        "preference",
        "nrl_core.chat_data:PreferenceDataset",
        config="nrl_core.chat_data:PreferenceDataConfig",
        extras=["hf"],
        extras_for="Hugging Face hub and saved datasets (JSONL files need nothing)",
        description="prompt / chosen / rejected pairs (JSONL or Hugging Face) for DPO and RMs",
    )
    register(
        "prompts",
        "nrl_core.prompt_data:PromptDataset",
        config="nrl_core.prompt_data:PromptDataConfig",
        extras=["hf"],
        extras_for="Hugging Face hub and saved datasets (JSONL files need nothing)",
        description="your own GRPO prompts (JSONL or Hugging Face): a prompt field, an answer, "
        "every other field handed to the environment",
    )


@hookimpl
def nrl_register_losses(register):
    # Strings, not objects: the loss modules import torch, and this module must stay light.
    # The config classes live in the torch-free nrl_core.losses.config (the loss modules
    # re-export them) because the driver structures them without importing torch.
    register(
        "clipped_pg",
        "nrl_core.losses.clipped_pg:ClippedPGLoss",
        config="nrl_core.losses.config:ClippedPGConfig",
        description="clipped policy gradient: GRPO, DAPO, Dr. GRPO, GSPO; KL; IS correction",
    )
    register(
        "nll",
        "nrl_core.losses.nll:NLLLoss",
        config="nrl_core.losses.config:NLLConfig",
        description="negative log-likelihood on loss_mask tokens (SFT)",
    )
    register(
        "dpo",
        "nrl_core.losses.preference:DPOLoss",
        config="nrl_core.losses.config:DPOLossConfig",
        description="direct preference optimization on (chosen, rejected) row pairs",
    )
    register(
        "distillation",
        "nrl_core.losses.distillation:DistillationLoss",
        config="nrl_core.losses.config:DistillationLossConfig",
        description="on-policy distillation: reverse/forward/mixed KL to a teacher's top-k "
        "(nrl run distill)",
    )


@hookimpl
def nrl_register_tool_parsers(register):
    # nrl_core.serving.tool_calls imports only the standard library.
    for name, cls, what in (
        ("hermes", "HermesParser", "<tool_call>{JSON}</tool_call> (Qwen2/2.5/3, Hermes)"),
        ("llama3_json", "Llama3JsonParser", "the whole answer is JSON calls (Llama 3.1-3.3)"),
        ("mistral", "MistralParser", "[TOOL_CALLS][{JSON}, ...] (Mistral, Mixtral)"),
        ("qwen3_coder", "Qwen3CoderParser", "<tool_call><function=NAME> XML (Qwen3-Coder)"),
    ):
        register(name, f"nrl_core.serving.tool_calls:{cls}", description=what)
