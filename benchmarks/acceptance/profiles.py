"""The stages' names and order, the profiles (model shape, workload sizes, stage time limits)
and the device plan their limits must fit (:func:`plan_seconds`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

STAGES: tuple[str, ...] = (
    "model",
    "dtensor",
    "generation",
    "cuda_ipc_refit",
    "megatron",
    "megatron_moe",
    "memory_plan",
    "grpo_step",
)
"""Every stage, in the order they run."""


@dataclass(frozen=True)
class Profile:
    """Model shape and workload sizes of one run; ``cpu`` runs ``tiny``, ``cuda`` the 0.5B."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None
    """None: the tokenizer's size rounded up to 64 (the real Qwen2 vocabulary is 151936; ids
    beyond the character tokenizer are valid model tokens that decode to nothing)."""
    dtype: str
    """Precision of the saved weights and of the policies (``policy.precision``)."""
    lr: float
    train_batch: int
    train_seq: int
    micro_batch: int
    train_steps: int
    """Timed training steps, after one warm-up step."""
    gen_prompts: int
    gen_prompt_len: int
    gen_new_tokens: int
    refit_bucket_mb: float
    refit_repeats: int
    """Timed refits after a warm-up one (the first opens the transport)."""
    grpo_overrides: tuple[str, ...]
    limits: dict[str, int]
    """Upper bound of each stage in seconds (:data:`STAGES`); their sum is the default
    ``--budget-s``. A stage the profile has no limit for is reported SKIP (``quick`` leaves
    ``megatron_moe`` and ``memory_plan`` out)."""


PROFILES = {
    "tiny": Profile(
        name="tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=None,
        dtype="float32",
        lr=1e-3,
        train_batch=2,
        train_seq=32,
        micro_batch=2,
        train_steps=1,
        gen_prompts=4,
        gen_prompt_len=8,
        gen_new_tokens=8,
        refit_bucket_mb=1 / 16,
        refit_repeats=2,
        grpo_overrides=(
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=8",
            "generation.max_new_tokens=4",
            "policy.max_total_sequence_length=48",
        ),
        # What CI tolerates before it calls a stage hung.
        limits={
            "model": 90,
            "dtensor": 90,
            "generation": 90,
            "cuda_ipc_refit": 120,
            "megatron": 120,
            "megatron_moe": 120,
            "memory_plan": 90,
            "grpo_step": 180,
        },
    ),
    # Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 query and 2 key/value heads, MLP 4864,
    # vocabulary 151936, tied embeddings (~494M parameters).
    "qwen2-0.5b": Profile(
        name="qwen2-0.5b",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        dtype="bfloat16",
        lr=1e-4,
        train_batch=16,
        train_seq=1024,
        micro_batch=4,
        train_steps=3,
        gen_prompts=64,
        gen_prompt_len=32,
        gen_new_tokens=128,
        refit_bucket_mb=256,
        refit_repeats=3,
        grpo_overrides=(
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8",
            "policy.train_global_batch_size=64",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=16",
            "generation.max_new_tokens=128",
            "generation.torch.generation_batch_size=64",
            "policy.max_total_sequence_length=192",
        ),
        limits={
            "model": 180,
            "dtensor": 240,
            "generation": 180,
            "cuda_ipc_refit": 180,
            "megatron": 240,
            "megatron_moe": 120,
            "memory_plan": 180,
            "grpo_step": 420,
        },
    ),
}
# The default on a GPU: the same Qwen2.5-0.5B shape with workloads sized so that the whole
# acceptance, the wheel install included, is one device command of at most 8 minutes
# (QUICK_PLAN_S; tests/benchmarks/test_gpu_acceptance.py checks the sum).
PROFILES["quick"] = replace(
    PROFILES["qwen2-0.5b"],
    name="quick",
    train_seq=512,
    train_steps=2,
    gen_prompts=32,
    gen_new_tokens=64,
    refit_repeats=2,
    grpo_overrides=(
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16",
        "generation.max_new_tokens=48",
        "generation.torch.generation_batch_size=32",
        "policy.max_total_sequence_length=128",
    ),
    # No megatron_moe, no memory_plan: the plan has 15 s to spare and the megatron stage alone
    # took 25 s on an H100 (docs/performance.md), so they run with --profile qwen2-0.5b.
    limits={
        "model": 50,
        "dtensor": 70,
        "generation": 40,
        "cuda_ipc_refit": 60,
        "megatron": 70,
        "grpo_step": 110,
    },
)
DEFAULT_PROFILE = {"cpu": "tiny", "cuda": "quick"}

QUICK_PLAN_S = 480
"""What one device command of the default GPU acceptance may take, the wheel install included
(the issue's bound: 8 minutes, so that a 15-minute device slot leaves room for a machine start
and a rerun)."""
INSTALL_ESTIMATE_S = 45
"""Upper estimate of ``install.sh`` on the GPU machine (join, hashes, pip install of the
bundle and nrl's editable packages); the measured time is in docs/performance.md."""
GRACE_S = 20
"""After a stage's limit: SIGTERM (a Ray head in it shuts down cleanly), then this long before
SIGKILL to its process group."""


def plan_seconds(profile: Profile) -> int:
    """The longest one invocation of every stage can take with ``profile``, the bundle's
    install before it included: the install estimate, every stage's limit (the default
    ``--budget-s`` caps their sum) and the grace of a last stage stopped at its limit."""
    return INSTALL_ESTIMATE_S + sum(profile.limits.get(name, 0) for name in STAGES) + GRACE_S
