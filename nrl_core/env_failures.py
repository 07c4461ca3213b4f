"""Environment failures made visible: per-step shares, a console warning and a stop threshold.

A sample fails in its environment when the environment's ``step`` raised for it (the core
gives it reward 0: :class:`~nrl_core.environments.EnvironmentActor`), or when the environment
says it could not score it (:attr:`~nrl_core.interfaces.EnvStep.failure`: its check raised,
timed out, or a helper process crashed). Such samples still train, with their stand-in reward;
without a count a verifier that always fails looks like a model that never answers right. Every
training step logs the shares (``train/env_error_frac``, ``train/env_timeout_frac``,
``train/env_crash_frac`` and their sum ``train/env_failed_frac``), warns on the console at
``env.warn_failed_fraction`` and stops the run at ``env.stop_failed_fraction``.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from nrl_core.errors import NrlError

FAILURE_KINDS = ("error", "timeout", "crashed")
"""What an environment failure may be; another kind an environment reports counts as error."""

METRIC_NAMES = {
    "error": "env_error_frac",
    "timeout": "env_timeout_frac",
    "crashed": "env_crash_frac",
}
"""Failure kind -> its metric (``<prefix>/<name>``)."""


class EnvironmentFailureError(NrlError):
    """At least ``env.stop_failed_fraction`` of a step's samples failed in their environment."""


def failure_of(result: Any) -> str | None:
    """The failure of one :class:`~nrl_core.environments.StepResult` as ``kind: detail``
    (the step raised: ``error``; or the environment's own ``EnvStep.failure``), or None."""
    if getattr(result, "error", None) is not None:
        return f"error: {result.error}"
    failure = getattr(result.step, "failure", None)
    if failure is None:
        return None
    kind, _, detail = str(failure).partition(":")
    kind = kind.strip() if kind.strip() in FAILURE_KINDS else "error"
    return f"{kind}: {detail.strip()}" if detail.strip() else kind


def kind_of(failure: str) -> str:
    """The kind (one of :data:`FAILURE_KINDS`) of a failure string from :func:`failure_of`."""
    kind = failure.partition(":")[0].strip()
    return kind if kind in FAILURE_KINDS else "error"


def failure_metrics(prefix: str, episodes: Sequence[Any]) -> dict[str, float]:
    """``<prefix>/env_error_frac``, ``env_timeout_frac``, ``env_crash_frac`` (each 0 when
    none: the columns are there every step) and ``env_failed_frac`` of ``episodes``."""
    if not episodes:
        return {}
    counts = Counter(kind_of(e.env_failure) for e in episodes if e.env_failure is not None)
    metrics = {
        f"{prefix}/{name}": counts[kind] / len(episodes) for kind, name in METRIC_NAMES.items()
    }
    metrics[f"{prefix}/env_failed_frac"] = sum(counts.values()) / len(episodes)
    return metrics


def describe(step: int, episodes: Sequence[Any], routes: dict[str, tuple[str, str]]) -> str | None:
    """``step 3: 64 of 64 samples (100%) failed in environment 'math' (env.name): 64 crashed
    (first: crashed: ...)``, per environment, or None when no sample failed."""
    failed = [e for e in episodes if e.env_failure is not None]
    if not failed:
        return None
    by_env: dict[tuple[str, str], list[Any]] = {}
    for episode in failed:
        env = routes.get(episode.task) or routes.get("default") or (episode.task, "data.tasks")
        by_env.setdefault(env, []).append(episode)
    parts = []
    for (name, key), chosen in sorted(by_env.items()):
        counts = Counter(kind_of(e.env_failure) for e in chosen)
        kinds = ", ".join(f"{counts[k]} {k}" for k in FAILURE_KINDS if counts[k])
        first = " ".join(str(chosen[0].env_failure).split())[:200]
        parts.append(f"environment {name!r} ({key}): {kinds} (first: {first})")
    share = len(failed) / len(episodes)
    return (
        f"step {step}: {len(failed)} of {len(episodes)} samples ({share:.0%}) failed in their "
        f"environment; {'; '.join(parts)}"
    )


def check(step: int, episodes: Sequence[Any], env_config: Any, routes: dict) -> None:
    """Warn (stderr) when at least ``env.warn_failed_fraction`` of ``episodes`` failed in their
    environment; raise :class:`EnvironmentFailureError` at ``env.stop_failed_fraction``."""
    if not episodes:
        return
    share = sum(e.env_failure is not None for e in episodes) / len(episodes)
    stop = getattr(env_config, "stop_failed_fraction", None)
    warn = getattr(env_config, "warn_failed_fraction", 0.5)
    if stop is not None and share >= stop:
        raise EnvironmentFailureError(
            f"{describe(step, episodes, routes)}; stopped at env.stop_failed_fraction={stop}: "
            "fix the environment (or raise env.stop_failed_fraction / set it to null)"
        )
    if share > 0 and share >= warn:
        print(
            f"warning: {describe(step, episodes, routes)} (these get reward 0; "
            f"env.warn_failed_fraction={warn}, env.stop_failed_fraction stops the run)",
            file=sys.stderr,
        )
