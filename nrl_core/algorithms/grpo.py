"""GRPO: group-relative policy optimisation, end to end.

One step: draw prompts, repeat each ``num_generations_per_prompt`` times, bring the generation
backend's weights up to date, roll out (single or multi-turn), score with the environments,
compute group-relative advantages, recompute logprobs where the loss needs them, train, and
validate / checkpoint on schedule. Every component comes from the registry by name.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from nrl_core import env_failures
from nrl_core.agents import BUILTIN_AGENT
from nrl_core.algorithms.advantages import (
    group_mean_baseline,
    group_relative_advantages,
    has_reward_variance,
    overlong_sample_mask,
    reinforce_plus_plus_advantages,
)
from nrl_core.algorithms.async_grpo import GroupProducer, RolloutProducer, TakenGroups, WeightGate
from nrl_core.algorithms.rollout import (
    Episode,
    apply_trajectory,
    episodes_to_batch,
    rollout,
    start_episodes,
)
from nrl_core.algorithms.runtime import PROGRESS_FIELDS, RunSession, train_in_session
from nrl_core.algorithms.samples import sample_records
from nrl_core.algorithms.warmup import answer_warmup
from nrl_core.config.schema import GRPOConfig
from nrl_core.data import VERSION_GAP_BUCKETS, VERSION_GAPS, Batch
from nrl_core.errors import NonFiniteError, NrlError
from nrl_core.interfaces import SamplingParams
from nrl_core.losses.clipped_pg import kl_penalty
from nrl_core.metrics import samples_console_table, samples_due
from nrl_core.registry import Registry


def sampling_params(
    config: GRPOConfig, tokenizer: Any, *, step: int, greedy: bool = False
) -> SamplingParams:
    """Sampling for one generation call; the seed depends only on the run seed and the step,
    so a resumed run samples exactly what an uninterrupted one would."""
    gen = config.generation
    stop_ids = tuple(dict.fromkeys([*gen.stop_token_ids, tokenizer.eos_token_id]))
    return SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=0.0 if greedy else gen.temperature,
        top_p=1.0 if greedy else gen.top_p,
        top_k=0 if greedy else gen.top_k,
        stop_token_ids=tuple(i for i in stop_ids if i is not None),
        stop_strings=tuple(gen.stop_strings),
        seed=config.seed * 1_000_003 + step,
    )


@attrs.define
class StepData:
    """What one step's rollouts produced."""

    episodes: list[Episode]
    rewards: torch.Tensor
    advantages: torch.Tensor
    sample_mask: torch.Tensor
    generation_s: float


class GRPOTrainer:
    """The GRPO loop over a :class:`~nrl_core.algorithms.runtime.RunSession`."""

    progress_fields: tuple[tuple[str, str], ...] | None = None
    """``(metric, label)`` pairs the progress bar shows (None: reward, val accuracy, s/step)."""
    algorithm = "grpo"
    """The ``nrl run`` command (and the algorithm checkpoints are written for)."""

    @classmethod
    def run(
        cls, config: GRPOConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
    ) -> int:
        """``nrl run <algorithm>``: seed, open the run session, train to the end."""
        return train_in_session(
            cls, config, registry, algorithm=cls.algorithm, verbose=verbose, quiet=quiet
        )

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.config: GRPOConfig = session.config
        self.grpo = self.config.grpo
        self.gate: WeightGate = session.gate
        self.producer: RolloutProducer | GroupProducer | None = None
        self.async_options = self.grpo.async_

    # -- one step ---------------------------------------------------------------------------

    def roll_out(
        self, episodes: list[Episode], params: SamplingParams, max_tokens_per_call: int = 0
    ) -> list[Episode]:
        """Roll ``episodes`` out in place, each task by its agent: the core's own generate /
        ``env.step`` loop (:data:`~nrl_core.agents.BUILTIN_AGENT`) on token ids, or a
        registered agent calling the run's policy endpoint, whose trajectories become the
        episodes' sequences (:func:`~nrl_core.algorithms.rollout.apply_trajectory`).
        ``max_tokens_per_call`` > 0: the core's episodes may come back unfinished (partial
        rollouts, see :func:`~nrl_core.algorithms.rollout.rollout`); agents' always finish."""
        s = self.session
        max_total_length = self.config.policy.max_total_sequence_length
        by_agent: dict[str, list[Episode]] = {}
        for episode in episodes:
            by_agent.setdefault(s.agent_for(episode.task), []).append(episode)
        for agent, chosen in by_agent.items():
            if agent == BUILTIN_AGENT:
                rollout(
                    chosen,
                    s.generate,
                    s.env_pool,
                    s.codec,
                    params,
                    max_turns=self.grpo.max_rollout_turns,
                    max_total_length=max_total_length,
                    max_tokens_per_call=max_tokens_per_call,
                )
                continue
            # Agents sample through the endpoint: it holds them to this call's settings.
            s.server.enforce(params)
            rows = [{**e.metadata, "messages": [dict(m) for m in e.messages]} for e in chosen]
            trajectories = s.agent_pool.run(agent, rows, s.endpoint)
            for episode, trajectory in zip(chosen, trajectories, strict=True):
                apply_trajectory(episode, trajectory, s.codec, max_total_length=max_total_length)
        return episodes

    def collect(self, step: int) -> StepData:
        """Roll out enough groups for one step (DAPO dynamic sampling draws more if asked)."""
        s, grpo = self.session, self.grpo
        params = sampling_params(self.config, s.tokenizer, step=step)
        episodes: list[Episode] = []
        generation_s = 0.0
        rounds = 1 + (grpo.dynamic_sampling_max_batches if grpo.dynamic_sampling else 0)
        for round_index in range(rounds):
            samples = s.train_stream.take(grpo.num_prompts_per_step)
            fresh = start_episodes(samples, s.codec, grpo.num_generations_per_prompt)
            offset = (max(e.group for e in episodes) + 1) if episodes else 0
            for e in fresh:
                e.group += offset
            start = time.perf_counter()
            self.roll_out(fresh, attrs.evolve(params, seed=params.seed + 7919 * round_index))
            generation_s += time.perf_counter() - start
            if grpo.dynamic_sampling:
                rewards = torch.tensor([e.reward for e in fresh])
                keep = has_reward_variance(rewards, [e.group for e in fresh])
                fresh = [e for e, k in zip(fresh, keep.tolist(), strict=True) if k]
            episodes.extend(fresh)
            wanted = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
            if len(episodes) >= wanted:
                episodes = episodes[:wanted]
                break
        if not episodes:  # dynamic sampling found no group with signal; train on nothing
            raise _NoSignal()
        return self.step_data(episodes, generation_s)

    def roll_groups(self, step: int, offset: int, samples: list) -> list[list[Episode]]:
        """Roll out one generate call's groups for ``step`` (the streaming producer's unit:
        :class:`~nrl_core.algorithms.async_grpo.GroupProducer`): one group per sample, in
        order. ``offset`` is the first prompt's place in its step: the call's seed moves with
        it, so offset 0 samples what :meth:`collect` samples for the same prompts."""
        s, grpo = self.session, self.grpo
        params = sampling_params(self.config, s.tokenizer, step=step)
        if params.seed is not None and offset:
            params = attrs.evolve(params, seed=params.seed + 104_729 * offset)
        episodes = start_episodes(samples, s.codec, grpo.num_generations_per_prompt)
        self.roll_out(episodes, params, self.async_options.max_tokens_per_call)
        groups: dict[int, list[Episode]] = {}
        for episode in episodes:
            groups.setdefault(episode.group, []).append(episode)
        return [groups[g] for g in sorted(groups)]

    def resume_groups(self, step: int, calls: int, groups: list[list[Episode]]) -> None:
        """Continue the unfinished samples of ``groups`` (partial rollouts,
        ``grpo.async.max_tokens_per_call``) in one generate call, in place. The seed moves
        with ``calls`` (the calls the first group took so far): a continuation does not replay
        the random draws of the call before it."""
        params = sampling_params(self.config, self.session.tokenizer, step=step)
        if params.seed is not None:
            params = attrs.evolve(params, seed=params.seed + 1_000_033 * calls)
        unfinished = [e for group in groups for e in group if not e.done]
        self.roll_out(unfinished, params, self.async_options.max_tokens_per_call)

    def step_data(self, episodes: list[Episode], generation_s: float) -> StepData:
        """One step's :class:`StepData` from its rolled-out episodes (groups numbered)."""
        grpo = self.grpo
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        groups = [e.group for e in episodes]
        if grpo.advantage_estimator == "grpo":
            advantages = group_relative_advantages(
                rewards,
                groups,
                use_leave_one_out_baseline=grpo.use_leave_one_out_baseline,
                normalize_rewards=grpo.normalize_rewards,
            )
        elif grpo.advantage_estimator == "reinforce_plus_plus_baseline":
            # Per-sample scores for the logs and the finiteness check; the token advantages
            # need the whole batch's logprobs and are computed in train_on.
            advantages = group_mean_baseline(rewards, groups).float()
        else:
            advantages = rewards.clone()
        sample_mask = torch.tensor([float(e.trainable) for e in episodes])
        if grpo.overlong_filtering:
            sample_mask *= overlong_sample_mask([e.finish_reason for e in episodes]).float()
        return StepData(episodes, rewards, advantages, sample_mask, generation_s)

    def train_step(self, step: int) -> dict[str, float]:
        """One synchronous step: bring the engines up to date, roll out, train."""
        step_start = time.perf_counter()
        refit_s = self.gate.ensure(step - 1)  # the weights after step - 1 optimizer steps
        data = self.collect(step)
        return self.train_on(step, data, step_start=step_start, refit_s=refit_s)

    def streaming_step(self, step: int) -> dict[str, float]:
        """One asynchronous step with group streaming: refit, take ``num_prompts_per_step``
        finished groups from the producer (each generated with weights at most
        ``max_trajectory_age_steps`` older), train on them in prompt order."""
        producer = self.producer
        assert isinstance(producer, GroupProducer)
        step_start = time.perf_counter()
        busy_before = self.gate.busy_s
        refit_s = self.gate.ensure(step - 1)
        waited = time.perf_counter()
        taken: TakenGroups = producer.take(step)
        waited = time.perf_counter() - waited
        buffered = producer.buffered
        episodes: list[Episode] = []
        ages: list[float] = []
        for number, group in enumerate(taken.groups):
            for episode in group.episodes:
                episode.group = number
                episodes.append(episode)
                ages.append(float((step - 1) - group.version))
        staleness = self.mark_staleness(step, episodes, [g.version for g in taken.groups])
        data = self.step_data(episodes, waited)
        metrics = self.train_on(
            step, data, step_start=step_start, refit_s=refit_s, generation_s=waited
        )
        step_s = metrics["timing/step_s"]
        size = self.grpo.num_generations_per_prompt
        metrics.update(staleness)
        metrics.update(self.replacement_metrics(producer.requeued))
        metrics.update(
            {
                "async/trajectory_age_mean": sum(ages) / len(ages),
                "async/trajectory_age_max": max(ages),
                "async/dropped_stale": float(taken.dropped * size),
                "async/buffer_size": float(buffered * size),
                "async/generation_s": max(g.seconds for g in taken.groups),
                "async/engine_idle_fraction": max(
                    0.0, 1.0 - (self.gate.busy_s - busy_before) / step_s
                )
                if step_s > 0
                else 0.0,
            }
        )
        return metrics

    def replacement_metrics(self, requeued_groups: int) -> dict[str, float]:
        """With ``grpo.async.replace_dead_engines``: ``async/engines_replaced`` (dead engines
        replaced so far in this run) and ``async/requeued_groups`` (groups whose generate call
        failed with them and were generated again, so far); nothing otherwise."""
        engines = getattr(self.session, "generation_engines", None)
        if not self.async_options.replace_dead_engines or engines is None:
            return {}
        return {
            "async/engines_replaced": float(engines.replaced),
            "async/requeued_groups": float(requeued_groups),
        }

    def mark_staleness(
        self, step: int, episodes: list[Episode], group_versions: Mapping[int, int] | list[int]
    ) -> dict[str, float]:
        """Set each episode's ``age`` (the weights of ``step - 1`` train it) and, with
        ``grpo.async.over_age=mask``, keep its tokens older than the age bound out of the loss
        (``loss_excluded``); returns ``async/age_mean``, ``async/age_max``,
        ``async/partial_fraction`` and ``async/dropped_stale_tokens`` (tokens masked).

        A token's version is its own (:attr:`Episode.weight_versions`) or, where the engine
        recorded none, the version its group's first call started with
        (``group_versions[episode.group]``). Over-age tokens kept (``over_age=train``) go
        through the loss's importance-sampling correction like every other token."""
        options = self.async_options
        trainer_version = step - 1
        oldest_allowed = trainer_version - options.max_trajectory_age_steps
        masked = 0
        ages: list[int] = []
        for episode in episodes:
            positions = [i for i, m in enumerate(episode.loss_mask) if m > 0]
            versions = list(episode.weight_versions)
            if len(versions) != len(positions):  # unknown (or an agent's): the group's call
                versions = [group_versions[episode.group]] * len(positions)
            oldest = min(versions, default=group_versions[episode.group])
            episode.age = trainer_version - oldest
            ages.append(episode.age)
            if options.over_age == "mask" and oldest < oldest_allowed:
                episode.loss_excluded = [
                    p for p, v in zip(positions, versions, strict=True) if v < oldest_allowed
                ]
                masked += len(episode.loss_excluded)
        return {
            "async/age_mean": sum(ages) / len(ages),
            "async/age_max": float(max(ages)),
            "async/partial_fraction": sum(e.partial for e in episodes) / len(episodes),
            "async/dropped_stale_tokens": float(masked),
        }

    def version_gaps(self, step: int, episodes: Sequence[Episode], width: int) -> torch.Tensor:
        """:data:`~nrl_core.data.VERSION_GAPS` of a step's batch (``[len(episodes), width]``):
        for each generated token, how many versions older than the trainer's (``step - 1``)
        the weights that made it were; -1 elsewhere and where the engine recorded none."""
        gaps = torch.full((len(episodes), width), -1, dtype=torch.long)
        for row, episode in enumerate(episodes):
            positions = [i for i, m in enumerate(episode.loss_mask) if m > 0]
            if positions and len(episode.weight_versions) == len(positions):
                versions = torch.tensor(episode.weight_versions, dtype=torch.long)
                gaps[row, positions] = (step - 1) - versions
        return gaps

    @staticmethod
    def mismatch_by_version_gap(train: dict[str, float]) -> dict[str, float]:
        """``async/gen_logprob_error_gap<k>`` (the loss's ``train/gen_logprob_error`` over the
        tokens generated ``k`` versions before the trainer's weights; the last bucket, ``k =
        VERSION_GAP_BUCKETS - 1``, that many or more) from the loss's additive shares, which
        are taken out of ``train``; a gap with no token is left out."""
        found: dict[str, float] = {}
        for k in range(VERSION_GAP_BUCKETS):
            error = train.pop(f"gen_logprob_error_gap{k}", None)
            tokens = train.pop(f"gen_logprob_tokens_gap{k}", None)
            if error is not None and tokens:
                found[f"async/gen_logprob_error_gap{k}"] = error / tokens
        return found

    @staticmethod
    def summarise_is_weights(batch: Batch, data: StepData, old: torch.Tensor) -> None:
        """Set each episode's :attr:`~Episode.is_weight`: ``mean``, ``min``, ``max`` of the
        importance weights ``exp(old - gen)`` of its trained tokens (for ``samples.jsonl``),
        from the trainer's logprobs ``old`` of the step (when the step computed them)."""
        mask = batch["loss_mask"] * batch["sample_mask"][:, None]
        log_w = (old.float() - batch["gen_logprobs"].float()).clamp(-20.0, 20.0)
        for row, episode in enumerate(data.episodes):
            trained = mask[row] > 0
            if bool(trained.any()):
                weights = torch.exp(log_w[row][trained])
                episode.is_weight = {
                    "mean": float(weights.mean()),
                    "min": float(weights.min()),
                    "max": float(weights.max()),
                }

    def async_step(self, step: int) -> dict[str, float]:
        """One asynchronous step: refit, take the producer's batch for this step (generated
        meanwhile, with weights at most ``max_trajectory_age_steps`` older), train on it."""
        producer = self.producer
        assert isinstance(producer, RolloutProducer)
        step_start = time.perf_counter()
        busy_before = self.gate.busy_s
        refit_s = self.gate.ensure(step - 1)
        dropped = 0
        while True:
            waited = time.perf_counter()
            produced = producer.take(step)
            waited = time.perf_counter() - waited
            age = (step - 1) - produced.version
            if age <= producer.max_age or self.async_options.over_age != "drop":
                break
            dropped += 1  # too old for the bound: generate it again with newer weights
            producer.regenerate(step)
        buffered = producer.buffered
        if produced.data is None:
            raise _NoSignal()
        episodes = produced.data.episodes
        staleness = self.mark_staleness(
            step, episodes, {e.group: produced.version for e in episodes}
        )
        metrics = self.train_on(
            step, produced.data, step_start=step_start, refit_s=refit_s, generation_s=waited
        )
        step_s = metrics["timing/step_s"]
        trajectories = float(len(produced.data.episodes))
        metrics.update(staleness)
        metrics.update(self.replacement_metrics(producer.requeued * self.grpo.num_prompts_per_step))
        metrics.update(
            {
                "async/trajectory_age_mean": float(age),
                "async/trajectory_age_max": float(age),
                "async/dropped_stale": float(dropped) * trajectories,
                "async/buffer_size": float(buffered) * trajectories,
                "async/generation_s": produced.seconds,
                "async/engine_idle_fraction": max(
                    0.0, 1.0 - (self.gate.busy_s - busy_before) / step_s
                )
                if step_s > 0
                else 0.0,
            }
        )
        return metrics

    def train_on(
        self,
        step: int,
        data: StepData,
        *,
        step_start: float,
        refit_s: float,
        generation_s: float | None = None,
    ) -> dict[str, float]:
        """Train on one step's rollouts; the step's metrics. ``generation_s``: the time the
        step spent on its rollouts (default: the time collecting them took)."""
        s = self.session
        env_failures.check(step, data.episodes, s.config.env, s._environment_routes())
        problem = nonfinite_inputs(step, data, s)
        if problem is not None:
            if self.grpo.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"{problem}; fix the environment, or set grpo.on_nonfinite=skip to skip such "
                    "steps"
                )
            print(f"warning: {problem}; step skipped (grpo.on_nonfinite=skip)", file=sys.stderr)
            metrics = {"train/skipped_nonfinite": 1.0, **episode_metrics("train", data.episodes, s)}
            timings = {"generation_s": data.generation_s if generation_s is None else generation_s}
            return self.close_step(step, data, metrics, step_start=step_start, timings=timings)
        batch = episodes_to_batch(data.episodes, data.advantages, s.tokenizer.pad_token_id)
        batch["sample_mask"] = data.sample_mask
        if self.producer is not None:  # the loss reports its mismatch per version gap
            batch[VERSION_GAPS] = self.version_gaps(
                step, data.episodes, batch["input_ids"].shape[1]
            )

        start = time.perf_counter()
        reward_kl = self.token_level_estimator and self.grpo.reward_kl_coef > 0
        old = None
        if s.loss_fn.needs_prev_logprobs or reward_kl:
            old = s.policy.get_logprobs(batch)
        if s.loss_fn.needs_prev_logprobs:
            batch["prev_logprobs"] = old
        if self.needs_reference:
            batch["ref_logprobs"] = s.policy.get_logprobs(batch, reference=True)
        logprobs_s = time.perf_counter() - start
        if old is not None and self.producer is not None:
            self.summarise_is_weights(batch, data, old)
        estimator_metrics = (
            self.token_advantages(batch, data, old) if self.token_level_estimator else {}
        )

        start = time.perf_counter()
        train = self.train_policy(step, batch)
        train_s = time.perf_counter() - start
        bad = [k for k in ("loss", "grad_norm") if k in train and not math.isfinite(train[k])]
        if bad:
            # Raised before the step is logged or checkpointed: no checkpoint holds its weights.
            raise NonFiniteError(
                f"step {step}: the policy's {' and '.join(f'{k}={train[k]}' for k in bad)} with "
                "finite rewards and advantages; nothing of this step was saved: resume from the "
                "last checkpoint with a lower policy.optimizer.lr or policy.max_grad_norm > 0"
            )

        # Without a reference model (kl_coef = 0) the KL is not measured: null, never a fake 0.
        train.setdefault("kl", float("nan"))
        train.update(estimator_metrics)
        gap_metrics = self.mismatch_by_version_gap(train)
        metrics = self.end_step(
            step,
            data,
            train,
            step_start=step_start,
            generation_s=generation_s,
            timings={"logprobs_s": logprobs_s, "train_s": train_s, "refit_s": refit_s},
        )
        metrics.update(gap_metrics)
        return metrics

    def train_policy(self, step: int, batch: Batch) -> dict[str, float]:
        """The policy's optimizer steps on one step's batch (its advantages set); their metrics
        (:meth:`nrl_core.policy.Policy.train`). PPO overrides it (epochs, critic warm-up)."""
        return self.session.policy.train(batch, self.session.loss_fn)

    @property
    def token_level_estimator(self) -> bool:
        """Whether ``grpo.advantage_estimator`` is REINFORCE++ (token advantages, computed on
        the whole step's batch in :meth:`token_advantages`)."""
        # getattr: subclasses (distillation) drive this loop with sections that have no
        # advantage estimator.
        estimator = getattr(self.grpo, "advantage_estimator", "grpo")
        return estimator.startswith("reinforce_plus_plus")

    @property
    def needs_reference(self) -> bool:
        """Whether the step needs reference logprobs: for the loss's KL term, or for the KL
        penalty in the REINFORCE++ rewards (``grpo.reward_kl_coef > 0``)."""
        reward_kl = getattr(self.grpo, "reward_kl_coef", 0) > 0 and self.token_level_estimator
        return bool(self.session.loss_fn.needs_reference or reward_kl)

    def token_advantages(
        self, batch: Batch, data: StepData, old: torch.Tensor | None
    ) -> dict[str, float]:
        """Replace ``batch["advantages"]`` by the REINFORCE++ token advantages of the step's
        WHOLE batch (normalised over all of its valid tokens here, before the policy splits it
        over ranks and micro batches); return the estimator's metrics."""
        grpo = self.grpo
        mask = batch["loss_mask"] * batch["sample_mask"][:, None]
        kl, metrics = self.reward_kl(batch, old, mask)
        batch["advantages"] = reinforce_plus_plus_advantages(
            data.rewards,
            mask,
            [e.group for e in data.episodes],
            baseline=grpo.advantage_estimator == "reinforce_plus_plus_baseline",
            gamma=grpo.gamma,
            kl=kl,
            kl_coef=grpo.reward_kl_coef,
        )
        return metrics

    def reward_kl(
        self, batch: Batch, old: torch.Tensor | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The per-token KL to the reference that a token-level estimator puts into the rewards
        (``reward_kl_coef > 0``; k1 of the rollout logprobs ``old``), and its token mean over
        the valid tokens as ``reward_kl``; ``(None, {})`` without it."""
        if self.grpo.reward_kl_coef <= 0:
            return None, {}
        assert old is not None
        kl = kl_penalty(old, batch["ref_logprobs"], "k1")
        valid = mask != 0
        tokens = max(int(valid.sum()), 1)
        return kl, {"reward_kl": float(torch.where(valid, kl, torch.zeros_like(kl)).sum() / tokens)}

    def end_step(
        self,
        step: int,
        data: StepData,
        train: dict[str, float],
        *,
        step_start: float,
        generation_s: float | None,
        timings: dict[str, float],
    ) -> dict[str, float]:
        """The end of a training step, shared by GRPO and distillation: the policy's training
        results ``train`` as ``train/*`` metrics, the rollouts' metrics
        (:meth:`rollout_metrics`), then :meth:`close_step` with the step's generation time
        (``generation_s``, default: the time collecting the rollouts took) and ``timings``."""
        metrics = {f"train/{k}": v for k, v in train.items()}
        metrics.update(self.rollout_metrics("train", data.episodes))
        generation = data.generation_s if generation_s is None else generation_s
        return self.close_step(
            step,
            data,
            metrics,
            step_start=step_start,
            timings={"generation_s": generation, **timings},
        )

    def rollout_metrics(self, prefix: str, episodes: Sequence[Episode]) -> dict[str, float]:
        """The rollouts' metrics under ``prefix`` (``train``, ``val``): see
        :func:`episode_metrics`."""
        return episode_metrics(prefix, episodes, self.session)

    def close_step(
        self,
        step: int,
        data: StepData,
        metrics: dict[str, float],
        *,
        step_start: float,
        timings: dict[str, float],
    ) -> dict[str, float]:
        """Add the step's ``timing/*`` (``timings`` and the whole step), throughput and refit
        metrics to ``metrics``, log sample rollouts when due; return ``metrics``."""
        s = self.session
        step_s = time.perf_counter() - step_start
        tokens = sum(len(e.token_ids) for e in data.episodes)
        metrics.update({f"timing/{key}": value for key, value in timings.items()})
        metrics["timing/step_s"] = step_s
        metrics["throughput/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
        engines = getattr(s, "generation_engines", None)
        if engines is not None and getattr(engines, "last_refit", None) is not None:
            metrics.update(engines.last_refit.as_metrics())  # bytes moved, GB/s, buckets
        if samples_due(step, self.config.logger.sample_period, self.grpo.max_num_steps):
            self.log_samples(step, data.episodes, "train", data.advantages)
        return metrics

    def log_samples(
        self,
        step: int,
        episodes: Sequence[Episode],
        split: str,
        advantages: torch.Tensor | None = None,
    ) -> None:
        """Log the first ``logger.num_samples`` of ``episodes`` (with their ``advantages``,
        aligned with them) to ``samples.jsonl`` and the sinks, and print training samples as
        a table above the progress bar (``logger.print_samples``; nothing with ``--quiet``)."""
        s, logger = self.session, self.config.logger
        chosen = list(episodes[: logger.num_samples])
        scores = None if advantages is None else advantages[: len(chosen)].tolist()
        records = sample_records(chosen, scores)
        s.metrics.log_samples(step, records, split=split)
        if split == "train" and logger.print_samples:
            s.console.print(samples_console_table(step, records, split=split))

    def validate(self, step: int) -> dict[str, float]:
        """Greedy responses to the validation prompts: their ``val/reward_mean``, and
        ``val/accuracy`` (the same mean) only where the environment says its reward is
        correctness (:attr:`~nrl_core.interfaces.Environment.defines_correctness`; overall:
        when every validated task's does). Partial credit is no accuracy."""
        s = self.session
        if not s.val_samples:
            return {}
        self.gate.ensure(step)  # separate engines: validate the weights after this step
        episodes = start_episodes(s.val_samples, s.codec, 1)
        self.roll_out(episodes, sampling_params(self.config, s.tokenizer, step=step, greedy=True))
        if self.config.logger.sample_period:
            self.log_samples(step, episodes, "validation")
        metrics = episode_metrics("val", episodes, s)
        correct = {task: self.defines_correctness(task) for task in {e.task for e in episodes}}
        if all(correct.values()):
            metrics["val/accuracy"] = metrics["val/reward_mean"]
        for task, defined in correct.items():
            if defined:
                metrics.setdefault(f"val/{task}/accuracy", metrics[f"val/{task}/reward_mean"])
        return metrics

    def defines_correctness(self, task: str) -> bool:
        """Whether ``task``'s rewards are correctness (its environment says so; an agent's
        task, or a run without environments, is scored by reward only)."""
        pool = self.session.env_pool
        if pool is None or self.session.agent_for(task) != BUILTIN_AGENT:
            return False
        return pool.defines_correctness(task)

    def honest_fields(self) -> tuple[tuple[str, str], ...]:
        """The progress fields, with the validation accuracy shown as the validation reward
        where the environment does not define correctness."""
        fields = self.progress_fields or PROGRESS_FIELDS
        tasks = {s.task for s in self.session.val_samples} or {"default"}
        if all(self.defines_correctness(task) for task in tasks):
            return fields
        return tuple(
            ("val/reward_mean", "val reward") if key == "val/accuracy" else (key, label)
            for key, label in fields
        )

    def sft_warmup(self) -> dict[str, float]:
        """Supervised steps before GRPO (``grpo.sft_warmup_steps``) on the training prompts'
        answers, or on shuffled answers (``grpo.sft_warmup_shuffle_answers``), which teach the
        shape of a response and where it ends but not the task."""
        s, grpo = self.session, self.grpo
        if grpo.sft_warmup_steps <= 0:
            return {}
        losses = answer_warmup(
            s,
            s.policy,
            grpo.sft_warmup_steps,
            template=grpo.sft_warmup_template,
            shuffle_answers=grpo.sft_warmup_shuffle_answers,
            batch_size=self.config.policy.train_global_batch_size,
        )
        if self.needs_reference:
            # The KL penalty keeps GRPO near the model it starts from: the warmed-up one.
            s.policy.snapshot_reference(str(self.warmup_reference_path))
        return {
            "warmup/loss_first": losses[0],
            "warmup/loss_last": losses[-1],
            "warmup/steps": float(len(losses)),
        }

    @property
    def warmup_reference_path(self):
        """Where the reference snapshot taken after the warm-up is kept (beside the step
        checkpoints, so that a resumed run measures the KL against the same model)."""
        return self.session.checkpoints.root / "reference_after_warmup"

    def _restore_warmup_reference(self) -> None:
        if self.grpo.sft_warmup_steps <= 0 or not self.needs_reference:
            return
        path = self.warmup_reference_path
        if not (path / "config.json").is_file():
            raise NrlError(
                f"resuming a run with grpo.sft_warmup_steps > 0 and a KL penalty needs the "
                f"reference snapshot taken after the warm-up, and {path} is missing; start over "
                "with checkpointing.resume=never"
            )
        self.session.policy.set_reference(str(path))

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        s, grpo = self.session, self.grpo
        start_step = s.start_step
        if start_step >= grpo.max_num_steps:
            s.console.print(
                f"[green]this run already finished[/green] (step {start_step} of "
                f"{grpo.max_num_steps}); nothing to train. Raise grpo.max_num_steps "
                "to continue, or use checkpointing.resume=never to start over."
            )
            return 0
        if start_step > 0:
            self._restore_warmup_reference()
        if start_step == 0:
            metrics: dict[str, float] = {}
            if grpo.sft_warmup_steps > 0:
                count = grpo.sft_warmup_steps
                steps = f"{count} supervised step{'s' * (count > 1)}"
                with s.phase(f"warm-up: {steps}") as done:
                    metrics.update(self.sft_warmup())
                    done(
                        f"warm-up: {steps}, loss {metrics['warmup/loss_first']:.3f} -> "
                        f"{metrics['warmup/loss_last']:.3f}"
                    )
            if grpo.val_period > 0:
                with s.phase(f"validating step 0 ({len(s.val_samples)} prompts)") as done:
                    metrics.update(self.validate(0))
                    done(
                        f"validation at step 0: accuracy {metrics['val/accuracy']:.3f}"
                        if "val/accuracy" in metrics
                        else f"validation at step 0: mean reward {metrics['val/reward_mean']:.3f}"
                    )
            self.log_start(metrics)
        if self.async_options.enabled:
            self.producer = self.start_producer(start_step)
        try:
            self._steps(start_step)
        finally:
            if self.producer is not None:
                self.producer.stop()
        s.summary()
        return 0

    @property
    def streams_groups(self) -> bool:
        """Whether the async producer streams groups (:class:`GroupProducer`): not with DAPO
        dynamic sampling, nor for a trainer with a ``collect`` of its own (whole batches)."""
        return not getattr(self.grpo, "dynamic_sampling", False) and (
            type(self).collect is GRPOTrainer.collect
        )

    def start_producer(self, start_step: int) -> RolloutProducer | GroupProducer:
        """The background producer of ``grpo.async`` (see nrl_core.algorithms.async_grpo)."""
        s, grpo, options = self.session, self.grpo, self.async_options
        # Separate engines serialise what they must themselves: calls may overlap there.
        engines = getattr(s, "generation_engines", None)
        self.gate.concurrent = engines is not None
        # The engines started for it (GenerationEngines.in_flight): refits land mid-call.
        self.gate.in_flight = bool(getattr(engines, "in_flight", False))
        self.gate.wait_timeout_s = options.wait_timeout_s
        if self.streams_groups:
            per_step = grpo.num_prompts_per_step
            per_call = min(options.groups_per_call or per_step, per_step)
            return GroupProducer(
                s.train_stream.take,
                self.roll_groups,
                self.gate,
                s.train_stream,
                first_step=start_step + 1,
                last_step=grpo.max_num_steps,
                max_age=options.max_trajectory_age_steps,
                max_buffer=options.max_buffer_size,
                groups_per_step=per_step,
                groups_per_call=per_call,
                calls_in_flight=max(1, engines.num_engines if engines is not None else 1),
                wait_timeout_s=options.wait_timeout_s,
                drop_stale=options.over_age == "drop",
                resume=self.resume_groups if options.max_tokens_per_call > 0 else None,
                finished=lambda episodes: all(e.done for e in episodes),
            )
        return RolloutProducer(
            self.collect,
            _NoSignal,
            self.gate,
            s.train_stream,
            first_step=start_step + 1,
            last_step=grpo.max_num_steps,
            max_age=options.max_trajectory_age_steps,
            max_buffer=options.max_buffer_size,
            wait_timeout_s=options.wait_timeout_s,
        )

    def log_start(self, metrics: dict[str, float]) -> None:
        """Log step 0 (a fresh run's warm-up and first validation, ``metrics``) with what loading
        the data dropped (overlong prompts), once per run; nothing when there is neither."""
        s = self.session
        metrics.update(getattr(s, "data_metrics", {}))
        if metrics:
            s.log(0, metrics)

    def _steps(self, start_step: int) -> None:
        s, grpo, producer = self.session, self.grpo, self.producer
        if producer is None:
            step_fn = self.train_step
        else:
            step_fn = (
                self.streaming_step if isinstance(producer, GroupProducer) else self.async_step
            )
        with s.progress(grpo.max_num_steps, start_step, self.honest_fields()) as advance:
            for step in range(start_step + 1, grpo.max_num_steps + 1):
                try:
                    metrics = step_fn(step)
                except _NoSignal:
                    metrics = {"train/skipped_no_signal": 1.0}
                last = step == grpo.max_num_steps
                if grpo.val_period > 0 and (step % grpo.val_period == 0 or last):
                    with producer.paused() if producer else contextlib.nullcontext():
                        metrics.update(self.validate(step))
                s.log(step, metrics)
                if s.should_checkpoint(step, last):
                    if producer is None:
                        s.save_checkpoint(step)
                    else:
                        # The buffer is discarded, the stream rewound to its oldest batch:
                        # see nrl_core.algorithms.async_grpo.
                        with producer.paused():
                            producer.discard(step + 1)
                            s.save_checkpoint(step)
                advance(metrics)


def nonfinite_inputs(step: int, data: StepData, session: RunSession) -> str | None:
    """What is not finite in a step's rewards or advantages, naming the environment and the
    first sample at fault (its task and prompt); ``None`` when all are finite."""
    for name, values in (("reward", data.rewards), ("advantage", data.advantages)):
        bad = (~torch.isfinite(values.float())).nonzero()
        if len(bad) == 0:
            continue
        index = int(bad[0])
        episode = data.episodes[index]
        routes = session._environment_routes()
        env, key = routes.get(episode.task) or routes.get("default") or (None, None)
        if env is None:  # a task driven by a registered agent: its trajectories carry rewards
            env, key = f"agent {session.agent_for(episode.task)}", "agent.name"
        prompt = next((m.get("content") for m in episode.messages if m.get("role") == "user"), "")
        source = (
            f"environment {env!r} ({key})"
            if name == "reward"
            else "the advantages of the rewards of environment " + repr(env)
        )
        return (
            f"step {step}: {source} gave {name} {float(values[index])} to sample {index} of "
            f"{len(values)} (task {episode.task!r}, prompt {str(prompt)[:60]!r}; "
            f"{len(bad)} non-finite in all)"
        )
    return None


class _NoSignal(Exception):
    """Dynamic sampling found no group whose rewards vary."""


def episode_metrics(
    prefix: str, episodes: Sequence[Episode], session: RunSession
) -> dict[str, float]:
    """Reward, length and error statistics, overall and per task, plus environment metrics."""
    metrics: dict[str, float] = {}
    tasks = sorted({e.task for e in episodes})
    for task, chosen in [(None, list(episodes))] + [
        (t, [e for e in episodes if e.task == t]) for t in tasks
    ]:
        key = f"{prefix}/" if task is None else f"{prefix}/{task}/"
        rewards = [e.reward for e in chosen]
        metrics[f"{key}reward_mean"] = sum(rewards) / len(rewards)
        if task is None:
            metrics[f"{key}reward_std"] = (
                float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0
            )
            metrics[f"{key}response_length_mean"] = sum(e.response_length for e in chosen) / len(
                chosen
            )
            metrics[f"{key}truncated_fraction"] = sum(e.truncated for e in chosen) / len(chosen)
            metrics[f"{key}env_errors"] = float(sum(e.env_errors for e in chosen))
            metrics.update(env_failures.failure_metrics(prefix, chosen))
            metrics[f"{key}turns_mean"] = sum(e.turns for e in chosen) / len(chosen)
        agents = getattr(session, "agent_pool", None) is not None
        by_agent = agents and task is not None and session.agent_for(task) != BUILTIN_AGENT
        if agents and (task is None or by_agent):
            # Agent-driven episodes the loss skips (see apply_trajectory), overall and per task.
            metrics[f"{key}noncontiguous"] = float(sum(e.noncontiguous for e in chosen))
            metrics[f"{key}agent_failures"] = float(sum(e.failure is not None for e in chosen))
        if by_agent:
            # The agent's own numbers (e.g. NeMo Gym's verifier fields), mean per task; the
            # environment did not score these episodes, so its metrics would misname them.
            for name in sorted({n for e in chosen for n in e.agent_metrics}):
                values = [e.agent_metrics[name] for e in chosen if name in e.agent_metrics]
                metrics[f"{key}agent/{name}"] = float(sum(values) / len(values))
        elif task is not None:
            env = session.env_pool.metrics(
                task,
                {
                    "rewards": rewards,
                    "group_ids": [e.group for e in chosen],
                    "metadata": [e.metadata for e in chosen],
                    "finish_reasons": [e.finish_reason for e in chosen],
                    "response_lengths": [e.response_length for e in chosen],
                },
            )
            metrics.update({f"{key}{k}": float(v) for k, v in env.items()})
    return metrics


run = GRPOTrainer.run
"""``nrl run grpo``."""


__all__ = ["GRPOTrainer", "run", "sampling_params"]
