"""Each algorithm's own section: ``grpo`` (with ``grpo.async``), ``ppo`` (and its
``critic``), ``distill`` (and its ``teacher``), ``sft``, ``dpo``, ``rm`` and ``eval``."""

from __future__ import annotations

from typing import ClassVar

import attrs

from nrl_core.config.schema.fields import (
    FINITE,
    between,
    each,
    ge,
    gt,
    one_of,
    option,
    optional,
)
from nrl_core.config.schema.policy import PolicyConfig


@attrs.define
class AsyncSection:
    """Asynchronous GRPO (``grpo.async``): separate engines generate the next steps' rollouts
    while the trainer trains (see docs/async-grpo.md)."""

    enabled: bool = option(
        False,
        "Generate rollouts on a background producer while training. Needs separate generation "
        "engines (`generation.<backend>.colocated=false`: torch, vLLM or SGLang engines that are "
        "not colocated).",
    )
    max_trajectory_age_steps: int = option(
        1,
        "How many optimizer steps older than the trainer the weights that generated a trained "
        "trajectory may be (>= 0). The producer generates the batch of step k only once the "
        "engines hold weights of step k - this or newer; a batch found older when it is "
        "trained is dropped and counted (`async/dropped_stale`). 0 is the synchronous loop.",
        validator=ge(0),
    )
    max_buffer_size: int = option(
        2,
        "Most finished batches (one step's rollouts each) waiting for the trainer (>= 1); the "
        "producer pauses when the buffer is full.",
        validator=ge(1),
    )
    groups_per_call: int = option(
        0,
        "Prompts (groups) per generate call of the producer (0 or more; 0: "
        "`grpo.num_prompts_per_step`, one call per step as the synchronous loop makes; larger "
        "values are capped there). Each finished call hands its groups to the trainer at once, "
        "which trains a step as soon as it holds `num_prompts_per_step` groups: smaller calls "
        "keep a long-tailed call from holding back groups that are done. Not with "
        "`grpo.dynamic_sampling` (whole-step batches).",
        validator=ge(0),
    )
    in_flight_weight_updates: bool = option(
        False,
        "Refit without waiting for the generate calls in flight (NeMo RL's name): the engines "
        "pause between two decode steps, load the trainer's new weights and continue the "
        "requests, whose later tokens record the new version (samples.jsonl "
        "`weight_versions`); the old weights' KV cache of the earlier tokens is kept. false: a "
        "refit waits for the calls in flight, which finish on the old weights. Needs "
        "`grpo.async.enabled=true` and engines that take such refits (torch; vLLM with "
        "`generation.vllm.async_engine=true`).",
    )
    wait_timeout_s: float = option(
        1800.0,
        "The longest the trainer waits for rollouts, and a refit or pause for the generate "
        "calls in flight, in seconds (> 0); past it the run stops with one line naming the "
        "stuck engine wait instead of hanging.",
        validator=gt(0),
    )


@attrs.define
class GRPOSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    num_prompts_per_step: int = option(
        8, "Prompts drawn per step (1 to 1,048,576).", validator=between(1, 2**20)
    )
    num_generations_per_prompt: int = option(
        8,
        (
            "Responses per prompt (the group size); at least 2, since a sample's advantage is "
            "its reward against the rest of its group (a group of one learns nothing)."
        ),
        validator=ge(2),
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    val_period: int = option(
        10, "Validate every N steps (0 disables); step 0 is validated too.", validator=ge(0)
    )
    advantage_estimator: str = option(
        "grpo",
        (
            "How rewards become advantages, one of `grpo`, `reinforce_plus_plus`, "
            "`reinforce_plus_plus_baseline`. `grpo`: group-relative, one advantage per sample "
            "(GRPO / RLOO / Dr. GRPO, see `normalize_rewards` and `use_leave_one_out_baseline`). "
            "`reinforce_plus_plus` (REINFORCE++): per-token returns of the outcome reward on the "
            "last generated token minus `reward_kl_coef` x the per-token KL to the reference, "
            "discounted by `gamma`, then normalised to mean 0 and std 1 over the valid tokens of "
            "the whole step's batch. `reinforce_plus_plus_baseline`: the same after subtracting "
            "each group's mean reward from its rewards."
        ),
        validator=one_of("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    )
    gamma: float = option(
        1.0,
        (
            "Discount in [0, 1] of the REINFORCE++ token returns, per generated token (1: every "
            "token's return is the sum of the rewards from it to the end). Only the "
            "`reinforce_plus_plus*` estimators use it."
        ),
        validator=between(0, 1),
    )
    reward_kl_coef: float = option(
        0.0,
        (
            "Coefficient (>= 0) of the per-token KL penalty subtracted from the REINFORCE++ token "
            "rewards, KL = logp_old - logp_ref (k1, as REINFORCE++ and OpenRLHF). > 0 loads the "
            "reference model; 0 means no KL and no reference. Only the `reinforce_plus_plus*` "
            "estimators use it (a KL term in the loss is `loss.clipped_pg.kl_coef`; set one of "
            "the two)."
        ),
        validator=ge(0),
    )
    normalize_rewards: bool = option(
        True, "Divide advantages by the group's std (`advantage_estimator=grpo` only)."
    )
    use_leave_one_out_baseline: bool = option(
        True, "Baseline = mean of the other samples (`advantage_estimator=grpo` only)."
    )
    dynamic_sampling: bool = option(False, "DAPO: drop zero-variance groups and sample more.")
    dynamic_sampling_max_batches: int = option(
        4, "Most extra generation rounds per step.", validator=ge(0)
    )
    overlong_filtering: bool = option(False, "Mask out samples truncated by max_new_tokens.")
    on_nonfinite: str = option(
        "stop",
        (
            "A step whose rewards or advantages are NaN or infinite: `stop` the run in one line "
            "naming the environment and the first bad sample, or `skip` the step (nothing is "
            "trained on it; `train/skipped_nonfinite` is 1). A non-finite loss or gradient "
            "always stops the run, before anything is saved."
        ),
        validator=one_of("stop", "skip"),
    )
    sft_warmup_steps: int = option(
        0,
        (
            "Supervised optimizer steps on the training prompts before GRPO (0 disables): a short "
            "warm start that teaches the answer format. Step 0's validation runs after it, so the "
            "metrics show where GRPO starts from."
        ),
        validator=ge(0),
    )
    sft_warmup_shuffle_answers: bool = option(
        False,
        (
            "Pair each warm-up prompt with the answer of another, random prompt: the model learns "
            "what an answer looks like and where it ends, but not which one is right."
        ),
    )
    sft_warmup_template: str = option(
        "{answer}",
        ("Response text of the warm-up examples; `{answer}` is the (possibly shuffled) answer."),
    )
    async_: AsyncSection = attrs.field(
        factory=AsyncSection,
        metadata={
            "doc": "Asynchronous GRPO: overlap rollout generation with training.",
            "key": "async",  # a Python keyword: the attribute is `async_`, the key `async`
        },
    )

    def __attrs_post_init__(self) -> None:
        # A KL coefficient the estimator ignores would train without the penalty the config asks
        # for, silently.
        if self.reward_kl_coef > 0 and not self.advantage_estimator.startswith(
            "reinforce_plus_plus"
        ):
            raise ValueError(
                f"reward_kl_coef={self.reward_kl_coef} is the KL penalty in the rewards of the "
                "reinforce_plus_plus estimators, and advantage_estimator="
                f"{self.advantage_estimator} does not use it; set advantage_estimator="
                "reinforce_plus_plus (or _baseline), or put the KL in the loss with "
                "loss.clipped_pg.kl_coef"
            )


@attrs.define
class PPOSection(GRPOSection):
    """PPO with a learned critic (``nrl run ppo``): GRPO's loop (rollouts, validation, warm-up,
    checkpoints) with the advantages of generalized advantage estimation over the critic's
    values, and a critic trained alongside the policy. The fields it shares with ``grpo`` mean
    the same; those below are PPO's own or mean something else here. Mini-batches: each model
    takes ``train_global_batch_size`` samples per optimizer step (``policy.*`` and
    ``critic.*``), so a step's rollouts give ``samples / train_global_batch_size`` optimizer
    steps per epoch for each."""

    num_generations_per_prompt: int = option(
        1,
        (
            "Responses per prompt (>= 1). The critic is the baseline, so one response per "
            "prompt learns; more give more samples per prompt."
        ),
        validator=ge(1),
    )
    advantage_estimator: str = option(
        "gae",
        "How rewards become advantages: `gae` (generalized advantage estimation with the critic).",
        validator=one_of("gae"),
    )
    gamma: float = option(
        1.0,
        (
            "Discount in [0, 1] per generated token of the GAE returns (delta_t = r_t + "
            "gamma * V_{t+1} - V_t)."
        ),
        validator=between(0, 1),
    )
    lam: float = option(
        1.0,
        (
            "GAE lambda in [0, 1] (the name verl uses): 1 gives the Monte-Carlo returns minus "
            "the values (unbiased, high variance), 0 the one-step TD error."
        ),
        validator=between(0, 1),
    )
    reward_kl_coef: float = option(
        0.0,
        (
            "Coefficient (>= 0) of the per-token KL penalty in the token rewards, as in classic "
            "RLHF: r_t = -coef * (logp_old - logp_ref) on every generated token, plus the outcome "
            "reward on the last one. > 0 loads the reference model (a KL term in the loss, "
            "`loss.clipped_pg.kl_coef`, is the alternative; set one of the two)."
        ),
        validator=ge(0),
    )
    whiten_advantages: bool = option(
        True,
        (
            "Normalise the GAE advantages to mean 0 and std 1 over the valid tokens of the whole "
            "step's batch (before it is split over ranks and micro batches)."
        ),
    )
    value_clip: float | None = option(
        0.2,
        (
            "Clip range eps_v (>= 0) of the critic's value loss 0.5 * max((V - R)^2, "
            "(clip(V, V_old +- eps_v) - R)^2), in reward units; null for the plain squared error."
        ),
        validator=optional(ge(0)),
    )
    critic_warmup_steps: int = option(
        0,
        (
            "Steps (>= 0) at the start in which only the critic trains: the policy keeps its "
            "weights until the critic's values mean something."
        ),
        validator=ge(0),
    )
    ppo_epochs: int = option(
        1,
        (
            "Passes (1 to 64) over each step's rollouts, for the policy and for the critic alike; "
            "each pass takes the optimizer steps of its mini-batches."
        ),
        validator=between(1, 64),
    )

    normalize_rewards: bool = option(
        True, "GRPO's group normalisation; PPO's baseline is the critic (leave it true)."
    )
    use_leave_one_out_baseline: bool = option(
        True, "GRPO's group baseline; PPO's baseline is the critic (leave it true)."
    )

    def __attrs_post_init__(self) -> None:
        # GRPO ties reward_kl_coef to REINFORCE++; in PPO the GAE rewards carry it. GRPO's
        # group-baseline switches do nothing here: setting one would be ignored silently.
        for name in ("normalize_rewards", "use_leave_one_out_baseline"):
            if getattr(self, name) is not True:
                raise ValueError(
                    f"{name}={getattr(self, name)} shapes GRPO's group baseline, and PPO's "
                    f"baseline is the critic; remove ppo.{name} (GAE: ppo.gamma, ppo.lam)"
                )


@attrs.define
class CriticConfig(PolicyConfig):
    """The critic of ``nrl run ppo``: a worker group of a policy backend whose model has a
    scalar value head per token (initialised from ``model_name``, by default the policy's
    checkpoint; the head starts at zero). Its own optimizer, learning rate, micro batching and
    checkpoint state; the core's training step trains it with the clipped value loss."""

    value_head: ClassVar[bool] = True
    """Read by policy backends: build the model with a per-token scalar value head."""

    model_name: str = option(
        "",
        "Checkpoint the critic starts from (empty: the policy's `policy.model_name`).",
    )
    num_workers: int = option(
        1, "Number of critic ranks (Ray actors), one per GPU on GPU.", validator=ge(1)
    )


@attrs.define
class TeacherConfig(PolicyConfig):
    """The frozen teacher of ``nrl run distill``: a second policy worker group that only scores
    the student's rollouts (top-k logprobs per position). It must share the student's
    tokenizer. Its batch-size and optimizer fields matter only for
    ``distill.teacher_warmup_steps``."""

    num_workers: int = option(
        1, "Number of teacher ranks (Ray actors), one per GPU on GPU.", validator=ge(1)
    )


@attrs.define
class DistillSection:
    """On-policy distillation (``nrl run distill``): the student generates, the teacher scores
    the student's own tokens, the student minimises the per-token divergence (the
    ``distillation`` loss)."""

    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    num_prompts_per_step: int = option(16, "Prompts drawn per step.", validator=ge(1))
    num_generations_per_prompt: int = option(
        1, "Student responses per prompt (>= 1; no group baseline is needed).", validator=ge(1)
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    val_period: int = option(
        10,
        "Validate every N steps (0 disables; needs an environment); step 0 is validated too.",
        validator=ge(0),
    )
    topk: int = option(
        64,
        (
            "Teacher logprobs kept per position (>= 1): the k most likely tokens, plus the "
            "rest of the mass as one bucket. At or above the vocabulary size the full "
            "distribution is kept and the divergence is exact; below it only k numbers per "
            "position cross Ray."
        ),
        validator=ge(1),
    )
    teacher_warmup_steps: int = option(
        0,
        (
            "Supervised optimizer steps that first train the teacher on the training prompts' "
            "answers (>= 0; 0 for a teacher that is already trained). The CPU demo trains its "
            "teacher this way; the result is kept beside the checkpoints for resuming."
        ),
        validator=ge(0),
    )
    teacher_warmup_template: str = option(
        "{answer}", "Response text of the teacher's warm-up examples; `{answer}` is the answer."
    )


@attrs.define
class SFTSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))


@attrs.define
class DPOSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))
    beta: float = option(0.1, "DPO temperature.", validator=gt(0))
    sft_loss_weight: float = option(
        0.0, "Weight of an NLL term on the chosen response.", validator=ge(0)
    )
    average_logprobs: bool = option(False, "Average (not sum) response logprobs.")


@attrs.define
class RMSection:
    max_num_steps: int = option(100, "Training steps.", validator=ge(0))
    val_period: int = option(10, "Validate every N steps (0 disables).", validator=ge(0))


@attrs.define
class EvalSection:
    checkpoint: str | None = option(
        None,
        (
            "An nrl checkpoint to evaluate: a `step_N` folder, or a checkpoint directory (its "
            "best step by `checkpointing.metric_name`, else its newest). The policy's model keys (backend, model_name, tokenizer_name, "
            "precision, backend options) come from the config saved in it; unset: evaluate "
            "`policy.model_name` (a Hugging Face name or folder, or a checkpoint folder)."
        ),
    )
    num_samples: int = option(
        1,
        "Responses sampled per problem (n), at `generation.temperature`.",
        validator=ge(1),
    )
    pass_k: list[int] = option(
        [],
        (
            "The k of each reported pass@k (each at most num_samples); empty: 1 and num_samples. "
            "Unbiased estimator of Chen et al. (2021) when n > k, any-correct when n == k."
        ),
        validator=each(ge(1)),
    )
    correct_threshold: float = option(
        1.0,
        "A response is correct when its episode reward is at least this.",
        validator=FINITE,
    )
    max_rollout_turns: int = option(1, "Most turns per episode (1 = single turn).", validator=ge(1))
    batch_size: int = option(
        256, "Responses rolled out together in one rollout call (0: all at once).", validator=ge(0)
    )
    output: str | None = option(
        None, "Where eval.json is written (default: <logger.log_dir>/<logger.run_name>/eval.json)."
    )
