"""Running environments as Ray actors: error isolation inside the actor, routing in the driver.

:class:`EnvironmentActor` runs inside each environment actor (in the environment plugin's own
virtualenv). It builds the plugin's environment from its target string and shields the run
from it: when ``step`` raises for a batch, the batch is retried sample by sample, and a sample
whose step still raises gets reward 0 and is counted as an environment error. An nrl error
(:class:`~nrl_core.errors.NrlError`, e.g. a ``ConfigError`` for options the environment cannot
use) is not a sample's fault: it fails the run, in one line naming the environment and rank.

:class:`EnvironmentPool` is the driver's side: one worker group per environment, batches split
across each group's actors, samples routed to their environment by task name, and every step
bounded by ``env.step_timeout_s`` (a hung environment fails the run naming that key).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import attrs

from nrl_core.data import split_even
from nrl_core.distributed.errors import WorkerTimeoutError
from nrl_core.errors import NrlError
from nrl_core.hosting import ComponentActor
from nrl_core.interfaces import EnvStep

ENV_ACTOR_TARGET = "nrl_core.environments:EnvironmentActor"
STEP_TIMEOUT_KEY = "env.step_timeout_s"
"""The config key that bounds one environment actor's ``step``."""


@attrs.frozen
class StepResult:
    """An environment's answer for one sample, or the error that replaced it."""

    step: EnvStep
    error: str | None = None

    @property
    def reward(self) -> float:
        return total_reward(self.step.reward)


def total_reward(reward: float | dict[str, float]) -> float:
    """The training reward: the float itself, or the sum of named rewards."""
    if isinstance(reward, dict):
        return float(sum(reward.values()))
    return float(reward)


class EnvironmentActor(ComponentActor):
    """Hosts one environment inside a Ray actor (built as :class:`~nrl_core.hosting.ComponentActor`
    says: ``EnvironmentActor(target, options, context)``)."""

    kind = "environment"
    result_type, result_name = EnvStep, "EnvStep"
    results_word, inputs_word = "results", "samples"

    @property
    def env(self) -> Any:
        """The hosted environment."""
        return self.component

    def step(self, batch: tuple[Sequence[Sequence[dict]], Sequence[dict]]) -> list[StepResult]:
        """Step every sample of ``(conversations, metadata)``; never raises for a sample."""
        conversations, metadata = batch
        if not conversations:
            return []
        step_results = getattr(self.env, "step_results", None)
        if callable(step_results):
            # An environment that says itself which samples raised (the core's reward_fn, whose
            # function runs in a process of its own): no sample-by-sample retry, which would
            # call the function again for every sample of the batch.
            results = list(step_results(conversations, metadata))
            if len(results) != len(conversations) or not all(
                isinstance(r, StepResult) for r in results
            ):
                raise ValueError(
                    f"{type(self.env).__name__}.step_results must return one StepResult per "
                    f"sample ({len(conversations)})"
                )
            return results
        try:
            return [StepResult(s) for s in self._checked_step(conversations, metadata)]
        except NrlError:
            raise  # the environment says its set-up is wrong: no sample is at fault
        except Exception:
            pass  # find the samples at fault below; the others still get their rewards
        results = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            try:
                results.append(StepResult(self._checked_step([conversation], [meta])[0]))
            except NrlError:
                raise
            except Exception as exc:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                results.append(
                    StepResult(
                        EnvStep(reward=0.0, terminated=True),
                        error=f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})",
                    )
                )
        return results

    def _checked_step(self, conversations, metadata) -> list[EnvStep]:
        return self.checked(self.env.step(conversations, metadata), "step", len(conversations))

    def shutdown(self) -> None:
        """At the group's shutdown: close the environment (its ``close``, when it has one: the
        ``reward_fn`` environment's process, a verifier pool)."""
        self.close()

    def defines_correctness(self) -> bool:
        """The hosted environment's ``defines_correctness`` (see
        :class:`~nrl_core.interfaces.Environment`; False when it does not say)."""
        return bool(getattr(self.env, "defines_correctness", False))

    def metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """The environment's own metrics of a finished batch ({} when it defines none)."""
        fn = getattr(self.env, "metrics", None)
        return dict(fn(batch)) if callable(fn) else {}


class ExactMatchEnvironment:
    """The core's built-in environment: reward 1.0 when the last line of the response, stripped,
    equals the sample's answer, else 0.0. Single turn. Registered as ``exact_match``; it needs
    no plugin, so the whole loop can be tested with the core alone."""

    defines_correctness = True
    """Reward 1.0 is a correct response, 0.0 a wrong one."""

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.context = context

    def step(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[EnvStep]:
        steps = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            lines = conversation[-1]["content"].strip().splitlines() or [""]
            correct = lines[-1].strip() == str(meta.get("answer", "")).strip()
            steps.append(EnvStep(reward=1.0 if correct else 0.0, terminated=True))
        return steps


class EnvironmentPool:
    """The environments of a run, each a worker group of :class:`EnvironmentActor`.

    Args:
        groups: task name -> worker group hosting that task's environment.
        step_timeout_s: the longest one actor's ``step`` may take (``env.step_timeout_s``);
            None leaves the groups' own timeout (``cluster.worker_timeout_s``).
    """

    def __init__(self, groups: dict[str, Any], step_timeout_s: float | None = None) -> None:
        self.groups = groups
        self._correctness: dict[int, bool] = {}
        if step_timeout_s is not None:
            for group in groups.values():
                # In-process groups (tests, single process) have no timeouts to set.
                set_timeout = getattr(group, "set_call_timeout", None)
                if set_timeout is not None:
                    set_timeout("step", step_timeout_s, STEP_TIMEOUT_KEY)

    def step(
        self,
        tasks: Sequence[str],
        conversations: Sequence[Sequence[dict]],
        metadata: Sequence[dict],
    ) -> list[StepResult]:
        """Step each sample in the environment of its task; results in input order."""
        results: list[StepResult | None] = [None] * len(tasks)
        for task in sorted(set(tasks)):
            group = self.groups.get(task) or self.groups.get("default")
            if group is None:
                known = ", ".join(sorted(self.groups))
                raise KeyError(f"no environment serves task {task!r}; configured: {known}")
            index = [i for i, t in enumerate(tasks) if t == task]
            shards = split_even([(conversations[i], metadata[i]) for i in index], group.dp_size)
            try:
                outputs = group.run_sharded(
                    "step", [([c for c, _ in shard], [m for _, m in shard]) for shard in shards]
                )
            except WorkerTimeoutError:
                # A hung step never returns, so the actor could not run a clean shutdown
                # either: stop the group now instead of waiting for it at the run's end.
                group.shutdown(timeout_s=0)
                raise
            for i, result in zip(index, [r for out in outputs for r in out], strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def defines_correctness(self, task: str) -> bool:
        """Whether ``task``'s environment says its reward is correctness (asked once)."""
        group = self.groups.get(task) or self.groups.get("default")
        if group is None:
            return False
        if id(group) not in self._correctness:
            self._correctness[id(group)] = bool(group.run_one(0, "defines_correctness"))
        return self._correctness[id(group)]

    def metrics(self, task: str, batch: dict[str, Any]) -> dict[str, float]:
        group = self.groups.get(task) or self.groups.get("default")
        return group.run_one(0, "metrics", batch) if group is not None else {}

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
