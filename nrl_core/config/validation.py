"""Checks that span several config sections, run once the config is structured.

A field's own range is checked by its attrs validator, and a section's internal consistency by
its ``__attrs_post_init__``; what needs two sections at once lives here. Each problem is a
:class:`~nrl_core.errors.ConfigError` with one line naming every setting involved and the fix.
"""

from __future__ import annotations

import math
from typing import Any

from nrl_core.errors import ConfigError


def validate_run_config(config: Any) -> None:
    """Raise :class:`ConfigError` when settings of different sections contradict each other.

    Runs when a config is loaded (:func:`~nrl_core.config.loader.resolve_config`) and again in
    :func:`~nrl_core.preflight.preflight`, for configs built or changed in code.
    """
    _check_response_room(config)
    _check_batch_layout(config)
    _check_on_policy_shortcut(config)
    _check_reward_kl(config)
    _check_async(config)
    _check_colocated_nccl(config)
    _check_lora_refit(config)


def nccl_colocated_message(section: str) -> str:
    """The one line refusing ``refit_transport=nccl`` for colocated engines on GPUs."""
    return (
        f"{section}.refit_transport=nccl with {section}.colocated=true: policy rank 0 and "
        "engine 0 would share one GPU in one NCCL group, which NCCL refuses; set "
        f"{section}.refit_transport=cuda_ipc (or auto), or {section}.colocated=false"
    )


def _check_colocated_nccl(config: Any) -> None:
    # Colocated engines share policy rank i's GPU; NCCL refuses two ranks of one group on one
    # device. Known before Ray when the config says the cluster has GPUs; otherwise
    # nrl_core.generation.resolve_transport refuses it before the engines start.
    generation, cluster = getattr(config, "generation", None), getattr(config, "cluster", None)
    if generation is None or cluster is None:
        return
    options = generation.options_for()
    if getattr(options, "refit_transport", None) != "nccl" or not getattr(
        options, "colocated", False
    ):
        return
    if cluster.gpus_per_node or getattr(cluster, "gpu_memory_gib", None):
        raise ConfigError(nccl_colocated_message(f"generation.{generation.backend}"))


def _check_lora_refit(config: Any) -> None:
    # Asked-for adapter refits an engine cannot apply would fail at the first refit, after
    # the models loaded; `auto` falls back to merged there instead.
    from nrl_core.weight_sync.adapters import ADAPTERS, engine_accepts_adapters, policy_lora_rank

    generation = getattr(config, "generation", None)
    if generation is None or getattr(generation, "lora_refit", "auto") != ADAPTERS:
        return
    if policy_lora_rank(config) > 0 and not engine_accepts_adapters(generation):
        raise ConfigError(
            f"generation.lora_refit=adapters: the {generation.backend} engine cannot take "
            "adapter-only LoRA refits; set generation.lora_refit=merged (or auto)"
        )


def _check_async(config: Any) -> None:
    # The producer overlaps generation with training: that needs engines that hold weights of
    # their own. Generation inside the policy workers (torch's default) or on engines that
    # hand the GPUs back and forth with the policy (colocated vLLM/SGLang) cannot overlap.
    grpo = getattr(config, "grpo", None)
    if grpo is not None and grpo.async_.in_flight_weight_updates:
        _check_in_flight(config)
    if grpo is not None and grpo.async_.replace_dead_engines and not grpo.async_.enabled:
        raise ConfigError(
            "grpo.async.replace_dead_engines=true needs grpo.async.enabled=true (only the "
            "asynchronous producer generates a failed call again); enable it or set "
            "replace_dead_engines=false"
        )
    if grpo is None or not grpo.async_.enabled:
        return
    if hasattr(config, "ppo"):
        raise ConfigError(
            "ppo.async.enabled=true: asynchronous PPO is not supported yet (the critic would "
            "value rollouts of older weights); set ppo.async.enabled=false"
        )
    generation = config.generation
    options = generation.options_for()
    if getattr(options, "colocated", True) is False:
        return
    key = f"generation.{generation.backend}.colocated"
    if options is None or not hasattr(options, "colocated"):
        # Name the key the user can set: a backend without the option has no engines of its own.
        raise ConfigError(
            "grpo.async.enabled=true needs generation engines of their own, and "
            f"generation.backend={generation.backend} has no such option ({key}); choose a backend "
            "with separate engines (e.g. generation.backend=vllm) or set grpo.async.enabled=false"
        )
    raise ConfigError(
        "grpo.async.enabled=true needs generation engines of their own, and "
        f"{key} is true; set {key}=false"
    )


def _check_in_flight(config: Any) -> None:
    # A refit that lands mid-call needs a producer whose calls overlap training (async) and
    # engines of their own that load weights between decode steps; colocated engines hand the
    # GPU back and forth with the policy and cannot hold a call across a refit.
    if not config.grpo.async_.enabled:
        raise ConfigError(
            "grpo.async.in_flight_weight_updates=true needs grpo.async.enabled=true (only the "
            "asynchronous producer has calls in flight at a refit); enable it or set "
            "in_flight_weight_updates=false"
        )
    generation = config.generation
    options = generation.options_for()
    problem = getattr(options, "in_flight_refit_problem", None)
    problem = (
        problem()
        if problem is not None
        else "choose an engine that takes in-flight refits (generation.backend=torch or vllm)"
    )
    if problem is not None:
        raise ConfigError(
            "grpo.async.in_flight_weight_updates=true: the "
            f"{generation.backend} engines cannot take a refit while a call is in flight; "
            f"{problem}, or set grpo.async.in_flight_weight_updates=false"
        )


def _model_parallel_size(options: Any) -> tuple[str, int]:
    # The ranks one data shard spans, under the usual option names (as nrl_core.policy's
    # policy_layout reads them; that module imports torch, this one must not).
    names, size = [], 1
    for name in (
        "tensor_parallel_size",
        "tensor_model_parallel_size",
        "pipeline_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        value = getattr(options, name, None)
        if isinstance(value, int) and value > 1:
            names.append(f"{name}={value}")
            size *= value
    return " x ".join(names), size


def _check_expert_parallel(policy: Any, options: Any, dp: int) -> None:
    # Experts are split over the ranks that share the dense weights (data x context parallel;
    # nrl_core.distributed.worker_group.ParallelLayout), so the expert-parallel size must
    # divide their number.
    for name in ("expert_parallel_size", "expert_model_parallel_size"):
        ep = getattr(options, name, None)
        if not isinstance(ep, int) or ep <= 1:
            continue
        cp = getattr(options, "context_parallel_size", None) or 1
        if (dp * cp) % ep:
            raise ConfigError(
                f"policy.{policy.selected}.{name}={ep} must divide the {dp * cp} data x "
                f"context parallel ranks (policy.num_workers={policy.num_workers} over the "
                "model-parallel sizes); lower it or raise policy.num_workers"
            )


def _check_batch_layout(config: Any) -> None:
    # Micro batches cut one rank's share of a global batch, and every data-parallel rank takes
    # an equal share: a layout that cannot hold is refused here, not by a worker after Ray.
    # The PPO critic is a policy worker group of its own, with its own batch sizes.
    for key in ("policy", "critic"):
        _check_group_batch_layout(getattr(config, key, None), key)


def _check_group_batch_layout(policy: Any, key: str) -> None:
    if policy is None or not hasattr(policy, "train_global_batch_size"):
        return
    workers, global_batch = policy.num_workers, policy.train_global_batch_size
    options = policy.options_for() if hasattr(policy, "options_for") else None
    names, model_parallel = _model_parallel_size(options)
    if model_parallel > 1 and workers % model_parallel:
        raise ConfigError(
            f"{key}.{policy.selected}: {names} must divide {key}.num_workers={workers}; set "
            f"{key}.num_workers to a multiple of {model_parallel} or lower the parallel size"
        )
    dp = max(1, workers // model_parallel)
    _check_expert_parallel(policy, options, dp)
    if global_batch % dp:
        raise ConfigError(
            f"{key}.train_global_batch_size={global_batch} does not split evenly over the "
            f"{dp} data-parallel ranks ({key}.num_workers={workers}); set it to a multiple "
            f"of {dp}"
        )
    if policy.train_micro_batch_size > global_batch:
        raise ConfigError(
            f"{key}.train_micro_batch_size={policy.train_micro_batch_size} is larger than "
            f"{key}.train_global_batch_size={global_batch} (a micro batch is part of one "
            f"optimizer step); lower {key}.train_micro_batch_size or raise "
            f"{key}.train_global_batch_size"
        )


def _check_response_room(config: Any) -> None:
    # A prompt needs at least one token, so a response budget that fills the whole sequence
    # leaves no prompt that fits: every prompt would be dropped when the data is loaded.
    generation = getattr(config, "generation", None)
    policy = getattr(config, "policy", None)
    if generation is None or policy is None:
        return
    limit = policy.max_total_sequence_length
    if generation.max_new_tokens >= limit:
        raise ConfigError(
            f"generation.max_new_tokens={generation.max_new_tokens} leaves no room for a prompt "
            f"in policy.max_total_sequence_length={limit} (prompt + response); lower "
            "generation.max_new_tokens or raise policy.max_total_sequence_length"
        )


def optimizer_steps_per_rollout(config: Any) -> int:
    """How many optimizer steps :meth:`nrl_core.policy.Policy.train` takes on one GRPO step's
    batch: it cuts ``num_prompts_per_step * num_generations_per_prompt`` samples (dynamic
    sampling never gives more) into chunks of ``policy.train_global_batch_size`` (PPO: once per
    ``ppo.ppo_epochs``)."""
    samples = config.grpo.num_prompts_per_step * config.grpo.num_generations_per_prompt
    # PPO passes over the rollouts ppo_epochs times.
    epochs = getattr(config.grpo, "ppo_epochs", 1)
    return epochs * max(1, math.ceil(samples / max(1, config.policy.train_global_batch_size)))


def loop_key(config: Any) -> str:
    """The config key of the RL loop's section: ``ppo`` for ``nrl run ppo`` (whose section
    extends GRPO's, and which the checks read as ``config.grpo``), else ``grpo``."""
    return "ppo" if hasattr(config, "ppo") else "grpo"


def _check_reward_kl(config: Any) -> None:
    # REINFORCE++ puts the KL to the reference into the rewards; a KL term in the loss as well
    # would penalise the same divergence twice, with two coefficients that each look like the
    # whole penalty (OpenRLHF turns the reward KL off when its KL loss is on, for this reason).
    grpo, loss = getattr(config, "grpo", None), getattr(config, "loss", None)
    if grpo is None or loss is None or getattr(grpo, "reward_kl_coef", 0) <= 0:
        return
    loss_kl = getattr(loss.options_for(), "kl_coef", 0) or 0
    if loss_kl > 0:
        raise ConfigError(
            f"{loop_key(config)}.reward_kl_coef={grpo.reward_kl_coef} and "
            f"loss.{loss.selected}.kl_coef="
            f"{loss_kl} both penalise the KL to the reference (in the rewards and in the loss); "
            f"set one of them to 0"
        )


def _check_on_policy_shortcut(config: Any) -> None:
    # The shortcut takes old = sg(logp) instead of recomputing prev_logprobs. That is exact for
    # the first optimizer step of a rollout only: after it the weights have moved, the true
    # ratio is no longer 1, and every later step would train unclipped without saying so.
    if not (hasattr(config, "grpo") and hasattr(config, "loss")):
        return
    loss = config.loss
    options = loss.options_for()
    if getattr(options, "on_policy_shortcut", False) is not True:  # `auto` resolves safely
        return
    steps = optimizer_steps_per_rollout(config)
    if steps <= 1:
        return
    grpo = config.grpo
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    raise ConfigError(
        f"loss.{loss.selected}.on_policy_shortcut=true needs one optimizer step per rollout, but "
        f"policy.train_global_batch_size={config.policy.train_global_batch_size} is less than "
        f"{loop_key(config)}.num_prompts_per_step x {loop_key(config)}.num_generations_per_prompt"
        f" = {samples} ({steps} "
        "steps; every step after the first would run with ratio 1, i.e. without clipping); "
        f"set policy.train_global_batch_size={samples} or "
        f"loss.{loss.selected}.on_policy_shortcut=false"
    )
