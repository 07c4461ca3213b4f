"""On-policy distillation: ``nrl run distill``.

The student (the policy) generates; a frozen teacher (a second worker group of a policy
backend, the ``teacher`` section) scores the student's own tokens; the student minimises the
per-token divergence from the teacher on those tokens (the ``distillation`` loss, see
:mod:`nrl_core.losses.distillation` and docs/algorithms.md).

One step: draw ``distill.num_prompts_per_step`` prompts, roll out
``num_generations_per_prompt`` responses each with the GRPO rollout machinery (single or
multi-turn; an environment scores them when one is configured, for the logs only), have the
teacher score every position (its ``distill.topk`` most likely tokens and their logprobs, plus
the logprob of the sampled token: only ``k`` numbers per position cross Ray), and take the
optimizer steps of :meth:`nrl_core.policy.Policy.train` with the distillation loss. Validation
is the environment's accuracy of greedy responses, as in GRPO; step 0 also reports the
teacher's own (``val/teacher_accuracy``).

``distill.teacher_warmup_steps`` first trains the teacher on the training prompts' answers (the
CPU demo's teacher); the result is exported beside the checkpoints, and a resumed run scores
with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from nrl_core.algorithms.grpo import (
    GRPOTrainer,
    StepData,
    answer_warmup,
    episode_metrics,
    sampling_params,
)
from nrl_core.algorithms.rollout import Episode, episodes_to_batch, rollout, start_episodes
from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.schema import DistillConfig
from nrl_core.errors import ConfigError
from nrl_core.registry import Registry


def check_config(config: DistillConfig, registry: Registry) -> None:
    """What only distillation needs: a loss that reads the teacher's top-k, and policy backends
    that compute logprobs at given ids (one line, exit 2, before anything starts)."""
    spec = registry.get("loss", config.loss.name, key="loss.name")
    if not getattr(spec.load(), "logprobs_at_key", None):
        raise ConfigError(
            f"loss.name={config.loss.name} does not read a teacher's scores; "
            "`nrl run distill` trains with loss.name=distillation"
        )
    for key, section in (("policy", config.policy), ("teacher", config.teacher)):
        backend = registry.get("policy", section.backend, key=f"{key}.backend")
        if not backend.metadata.get("distillation"):
            raise ConfigError(
                f"{key}.backend={section.backend} cannot score a teacher's top-k tokens "
                "(it registers no `distillation` support); use the dtensor backend for "
                f"{key}.backend"
            )


class DistillTrainer(GRPOTrainer):
    """The distillation loop; rollouts, validation and the step loop are GRPO's."""

    algorithm = "distill"

    progress_fields = (
        ("train/kl_to_teacher", "kl"),
        ("val/accuracy", "val acc"),
        ("timing/step_s", "s/step"),
    )

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.config: DistillConfig = session.config
        self.distill = session.config.distill
        # GRPOTrainer's rollout, validation and step loop read the loop's section as `grpo`:
        # distill has the fields they read (max_rollout_turns, max_num_steps, val_period).
        self.grpo = self.distill
        self.gate = session.gate
        self.producer = None

    @property
    def has_environment(self) -> bool:
        return self.session.env_pool is not None

    # -- one step ---------------------------------------------------------------------------

    def collect(self, step: int) -> StepData:
        """The student's rollouts of one step (rewards when an environment scores them)."""
        s, distill = self.session, self.distill
        samples = s.train_stream.take(distill.num_prompts_per_step)
        episodes = start_episodes(samples, s.codec, distill.num_generations_per_prompt)
        start = time.perf_counter()
        self.roll_out(episodes, sampling_params(self.config, s.tokenizer, step=step))
        generation_s = time.perf_counter() - start
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        sample_mask = torch.tensor([float(e.trainable) for e in episodes])
        return StepData(episodes, rewards, torch.zeros_like(rewards), sample_mask, generation_s)

    def train_on(
        self,
        step: int,
        data: StepData,
        *,
        step_start: float,
        refit_s: float,
        generation_s: float | None = None,
    ) -> dict[str, float]:
        """Score the rollouts with the teacher, train the student on them; the metrics."""
        s = self.session
        batch = episodes_to_batch(data.episodes, data.advantages, s.tokenizer.pad_token_id)
        batch["sample_mask"] = data.sample_mask

        start = time.perf_counter()
        tokens, topk_logprobs, topk_ids = s.teacher.get_topk_logprobs(batch, self.distill.topk)
        batch["teacher_logprobs"] = tokens
        batch["teacher_topk_logprobs"] = topk_logprobs
        batch["teacher_topk_ids"] = topk_ids
        teacher_s = time.perf_counter() - start

        start = time.perf_counter()
        train = s.policy.train(batch, s.loss_fn)
        train_s = time.perf_counter() - start

        return self.end_step(
            step,
            data,
            train,
            step_start=step_start,
            generation_s=generation_s,
            timings={"teacher_s": teacher_s, "train_s": train_s, "refit_s": refit_s},
        )

    def rollout_metrics(self, prefix: str, episodes: Sequence[Episode]) -> dict[str, float]:
        """GRPO's episode metrics with an environment; lengths only without one."""
        if self.has_environment:
            return episode_metrics(prefix, episodes, self.session)
        return {
            f"{prefix}/response_length_mean": sum(e.response_length for e in episodes)
            / len(episodes),
            f"{prefix}/truncated_fraction": sum(e.truncated for e in episodes) / len(episodes),
        }

    def validate(self, step: int) -> dict[str, float]:
        """The environment's accuracy of the student's greedy responses (none without one)."""
        if not self.has_environment:
            return {}
        return super().validate(step)

    def teacher_accuracy(self) -> dict[str, float]:
        """``val/teacher_accuracy``: the validation accuracy of the teacher's own greedy
        responses (generated on the teacher's ranks), what the student can hope to reach."""
        s = self.session
        if not (self.has_environment and s.val_samples):
            return {}
        episodes = start_episodes(s.val_samples, s.codec, 1)
        rollout(
            episodes,
            s.teacher.generate,
            s.env_pool,
            s.codec,
            sampling_params(self.config, s.tokenizer, step=0, greedy=True),
            max_turns=self.distill.max_rollout_turns,
            max_total_length=self.config.policy.max_total_sequence_length,
        )
        return {"val/teacher_accuracy": sum(e.reward for e in episodes) / len(episodes)}

    def teacher_warmup(self) -> dict[str, float]:
        """Train the teacher first (``distill.teacher_warmup_steps``) and keep it for resuming."""
        s, distill = self.session, self.distill
        if distill.teacher_warmup_steps <= 0:
            return {}
        losses = answer_warmup(
            s,
            s.teacher,
            distill.teacher_warmup_steps,
            template=distill.teacher_warmup_template,
            batch_size=self.config.teacher.train_global_batch_size,
        )
        from nrl_core import atomic

        with atomic.new_dir(s.teacher_snapshot) as tmp:
            s.teacher.export_hf(str(tmp))
        return {
            "teacher_warmup/loss_first": losses[0],
            "teacher_warmup/loss_last": losses[-1],
            "teacher_warmup/steps": float(len(losses)),
        }

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        s, distill = self.session, self.distill
        start_step = s.start_step
        if start_step == 0:
            metrics = self.teacher_warmup()
            if distill.val_period > 0:
                metrics.update(self.teacher_accuracy())
                metrics.update(self.validate(0))
            self.log_start(metrics)
        self._steps(start_step)
        s.summary(self.summary_rows())
        return 0

    def summary_rows(self) -> list[tuple[str, str]]:
        history = self.session.history
        trains = [h for h in history if "train/kl_to_teacher" in h]
        vals = [h for h in history if "val/accuracy" in h]
        rows = [("steps this session", str(len(trains)))]
        if trains:
            first, last = trains[0]["train/kl_to_teacher"], trains[-1]["train/kl_to_teacher"]
            rows.append(("KL to teacher (first -> last)", f"{first:.3f} -> {last:.3f}"))
        teacher = [h for h in history if "val/teacher_accuracy" in h]
        if teacher:
            rows.append(("teacher val accuracy", f"{teacher[0]['val/teacher_accuracy']:.3f}"))
        if vals:
            rows.append(
                (
                    "student val accuracy (first -> last)",
                    f"{vals[0]['val/accuracy']:.3f} (step {vals[0]['step']}) -> "
                    f"{vals[-1]['val/accuracy']:.3f} (step {vals[-1]['step']})",
                )
            )
        return rows


def run(
    config: DistillConfig, registry: Registry, *, verbose: bool = False, quiet: bool = False
) -> int:
    """``nrl run distill``."""
    check_config(config, registry)
    return DistillTrainer.run(config, registry, verbose=verbose, quiet=quiet)


__all__ = ["DistillTrainer", "check_config", "run"]
