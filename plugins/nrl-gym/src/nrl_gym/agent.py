"""The ``nemo_gym`` agent: rows go to NeMo Gym's agents, whose model calls come to nrl's endpoint.

Per row: ``POST <agent>/run`` with the row as it is in the Gym JSONL file; the agent calls the
model server (Gym's ``vllm_model``, pointed at nrl's endpoint, which returns the token ids of
every call), the tools of the resources server, and its ``/verify`` for the reward. In the
result's ``response.output``, the last item of each model call carries
``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``: one
:class:`~nrl_core.agents.ModelCall` each. A row whose run fails (HTTP error, a result flagged
``mask_sample``, or one with a ``failure_reason``) comes back with ``failure_reason`` set.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from nrl_core.agents import Endpoint, ModelCall, Trajectory
from nrl_core.errors import ConfigError
from nrl_gym.config import EXAMPLE_CONFIG, NemoGymAgentConfig

_log = logging.getLogger(__name__)

HEAVY_ROW_FIELDS = ("responses_create_params",)
"""Fields of a result not sent to ``/aggregate_metrics`` (as Gym's own rollout collection)."""

AGENT_NAME = "nemo_gym"
"""The name this agent is registered under (:mod:`nrl_gym.plugin`)."""

ROW_KEY = "nemo_gym_row"
"""Where the ``nemo_gym_jsonl`` dataset keeps a row's own fields in the sample's metadata."""


class NemoGymAgent:
    """Sends rows to NeMo Gym's agents (servers started on first use, stopped by close)."""

    def __init__(self, options: NemoGymAgentConfig | None = None, context: Any = None) -> None:
        self.options = options or NemoGymAgentConfig()
        self.servers: Any = None
        self._endpoint: Endpoint | None = None
        self._keep_log = _run_log(context)
        self.task_configs = task_configs(context)
        self._declared: dict[str, set[str]] = {}  # task -> the agents its configs declare
        self._no_aggregate: set[str] = set()  # Gym agents without /aggregate_metrics

    def config_paths(self) -> list[str]:
        """Every Gym config file ``ng_run`` starts: ``agent.nemo_gym.config_paths`` and each
        task's ``agent_configs`` (once each, in order), else the example's."""
        paths = [*self.options.config_paths, *(p for ps in self.task_configs.values() for p in ps)]
        return list(dict.fromkeys(paths)) or [EXAMPLE_CONFIG]

    def _ensure_servers(self, endpoint: Endpoint) -> None:
        if self.servers is not None and self._endpoint == endpoint:
            return
        from nrl_gym.install import config_instances, gym_venv
        from nrl_gym.servers import GymServers

        self.close()
        servers = GymServers(keep_log=self._keep_log)
        if self.options.head_server_url:
            if self.task_configs:
                raise ConfigError(
                    f"data.tasks {', '.join(map(repr, self.task_configs))} name agent_configs, "
                    "which nrl cannot start in a NeMo Gym it joins (agent.nemo_gym."
                    "head_server_url); start them with that Gym, or leave head_server_url unset"
                )
            servers.join(self.options.head_server_url, timeout_s=self.options.startup_timeout_s)
        else:
            venv = gym_venv(self.options.nemo_gym_version, self.options.gym_python)
            self._declared = {
                task: config_instances(venv, paths) for task, paths in self.task_configs.items()
            }
            servers.start(
                venv,
                self.config_paths(),
                endpoint,
                timeout_s=self.options.startup_timeout_s,
                ray_address=_run_ray_address(),
                host=self.options.host,
                python=self.options.gym_python,
            )
        self.servers, self._endpoint = servers, endpoint

    def run(self, rows: Sequence[dict[str, Any]], endpoint: Endpoint) -> list[Trajectory]:
        self._ensure_servers(endpoint)
        for row in rows:
            self._check_route(row)
        return asyncio.run(self._run_all(rows))

    def _check_route(self, row: dict[str, Any]) -> None:
        """A task with its own ``agent_configs`` runs only on the agents those declare: a row
        naming another one (another task's, or a typo) would train on the wrong environment."""
        declared = self._declared.get(row.get("task"))
        name = (row.get(ROW_KEY, row).get("agent_ref") or {}).get("name")
        if declared is not None and name not in declared:
            raise ConfigError(
                f"task {row.get('task')!r}: a row names agent_ref.name={name!r}, which its "
                f"agent_configs do not declare (they declare: {', '.join(sorted(declared))}); "
                "fix the row's agent_ref.name or add the Gym config that declares it"
            )

    async def _run_all(self, rows: Sequence[dict[str, Any]]) -> list[Trajectory]:
        limit = asyncio.Semaphore(self.options.max_concurrency)
        timeout = httpx.Timeout(self.options.request_timeout_s, connect=30)
        async with httpx.AsyncClient(timeout=timeout) as client:

            async def one(row: dict[str, Any]) -> tuple[Trajectory, Any]:
                async with limit:
                    return await self._run_one(client, row.get(ROW_KEY, row))

            done = await asyncio.gather(*(one(row) for row in rows))
            await self._add_aggregate_metrics(client, rows, done)
            return [trajectory for trajectory, _ in done]

    async def _run_one(
        self, client: httpx.AsyncClient, row: dict[str, Any]
    ) -> tuple[Trajectory, Any]:
        """The row's trajectory, and Gym's result (None when the run failed)."""
        name = (row.get("agent_ref") or {}).get("name")
        limit = self.options.request_timeout_s
        try:
            url = self.servers.url_of(name)
            # The whole answer within the limit (httpx's read timeout restarts on every byte).
            response = await asyncio.wait_for(client.post(f"{url}/run", json=row), limit)
        except TimeoutError:
            return _failed(
                f"{name}'s /run did not answer within agent.nemo_gym.request_timeout_s={limit:g} s"
            )
        except (KeyError, httpx.HTTPError) as exc:
            return _failed(f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return _failed(f"/run answered {response.status_code}: {response.text:.300}")
        # A broken answer fails its row, as a 500 does; it never ends the run.
        try:
            result = response.json()
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deeply
            return _failed(f"{name}'s /run answered 200 with a body that is not JSON: {exc}")
        try:
            return trajectory_of(result, row), result
        except (ValueError, TypeError, AttributeError) as exc:
            return _failed(f"{name}'s /run answered a result nrl cannot read: {exc}")

    async def _add_aggregate_metrics(
        self,
        client: httpx.AsyncClient,
        rows: Sequence[dict[str, Any]],
        done: Sequence[tuple[Trajectory, Any]],
    ) -> None:
        """Gym's own aggregate of each (task, Gym agent)'s results in this call: its agent's
        ``/aggregate_metrics`` (the results without their heavy fields, each with a task
        index, one per distinct Gym row, and a rollout index among that row's repeats); the
        numbers of its ``agent_metrics`` go into each of those trajectories' metrics as
        ``agg/<name>`` (the core logs them as ``<split>/<task>/agent/agg/<name>``). An agent
        without the endpoint, or an error, only skips them (logged at debug level)."""
        groups: dict[tuple[Any, Any], list[tuple[dict[str, Any], Trajectory, dict]]] = {}
        for row, (trajectory, result) in zip(rows, done, strict=True):
            if isinstance(result, dict) and trajectory.failure_reason is None:
                gym_row = row.get(ROW_KEY, row)
                name = (gym_row.get("agent_ref") or {}).get("name")
                if name not in self._no_aggregate:
                    groups.setdefault((row.get("task"), name), []).append(
                        (gym_row, trajectory, result)
                    )
        for (_, name), members in groups.items():
            task_index: dict[str, int] = {}
            repeats: dict[int, int] = {}
            responses = []
            for gym_row, _, result in members:
                index = task_index.setdefault(json.dumps(gym_row, sort_keys=True), len(task_index))
                repeats[index] = repeats.get(index, -1) + 1
                stripped = {
                    k: v for k, v in result.items() if k not in ("response", *HEAVY_ROW_FIELDS)
                }
                responses.append(
                    {**stripped, "_ng_task_index": index, "_ng_rollout_index": repeats[index]}
                )
            try:
                url = self.servers.url_of(name)
                answer = await client.post(
                    f"{url}/aggregate_metrics", json={"verify_responses": responses}
                )
            except (KeyError, httpx.HTTPError) as exc:
                _log.debug("NeMo Gym /aggregate_metrics of %s failed: %s", name, exc)
                continue
            if answer.status_code in (404, 405):
                self._no_aggregate.add(name)  # not implemented: do not ask again
                _log.debug("NeMo Gym agent %s has no /aggregate_metrics; skipped", name)
                continue
            try:
                metrics = answer.json().get("agent_metrics") if answer.status_code == 200 else None
            except ValueError:
                metrics = None
            if not isinstance(metrics, dict):
                _log.debug(
                    "NeMo Gym /aggregate_metrics of %s answered %s: %.300s",
                    name,
                    answer.status_code,
                    answer.text,
                )
                continue
            numbers = {
                f"agg/{key}": float(value)
                for key, value in metrics.items()
                if isinstance(value, int | float) and value == value  # not NaN
            }
            for _, trajectory, _ in members:
                trajectory.metrics.update(numbers)

    def close(self) -> None:
        if self.servers is not None:
            self.servers.stop()
            self.servers = None


def _failed(reason: str) -> tuple[Trajectory, None]:
    """A failed row (no result): masked out of the loss, counted in ``agent_failures``."""
    return Trajectory(calls=[], failure_reason=reason), None


def task_configs(context: Any) -> dict[str, list[str]]:
    """Task name -> its ``agent_configs``, for the tasks this agent (``nemo_gym``) drives."""
    config = getattr(context, "config", None)
    default = getattr(getattr(config, "agent", None), "name", None)
    tasks = getattr(getattr(config, "data", None), "tasks", None) or ()
    return {
        task.name: list(task.agent_configs)
        for task in tasks
        if (task.agent or default) == AGENT_NAME and getattr(task, "agent_configs", None)
    }


def _run_log(context: Any) -> Path | None:
    """``<run folder>/nemo_gym.log`` (``nemo_gym-<rank>.log`` for agent actors after the
    first), where Gym's log is kept; None without a run folder."""
    logger = getattr(getattr(context, "config", None), "logger", None)
    if logger is None or not getattr(logger, "log_dir", None):
        return None
    rank = getattr(context, "rank", 0)
    name = "nemo_gym.log" if not rank else f"nemo_gym-{rank}.log"
    return Path(logger.log_dir) / logger.run_name / name


def _run_ray_address() -> str | None:
    """The GCS address of the run's Ray cluster when this agent runs in it (an agent actor),
    which Gym joins; None outside Ray (Gym then starts a cluster of its own)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().gcs_address


RESULT_FIELDS = frozenset({"response", "reward", "mask_sample", "failure_kind", "failure_reason"})


def trajectory_of(result: Any, row: dict[str, Any] | None = None) -> Trajectory:
    """A Gym ``/run`` result (the row plus ``response``, ``reward``, ``mask_sample``,
    ``failure_kind``, ``failure_reason``, and what the verifier adds) as a
    :class:`Trajectory`; the verifier's numbers (fields of the result that are numbers and not
    fields of ``row``, e.g. reasoning_gym's ``score``) become its ``metrics``."""
    if not isinstance(result, dict) or not isinstance(result.get("response"), dict):
        return Trajectory(calls=[], failure_reason=f"not a NeMo Gym result: {result!s:.300}")
    calls = []
    for item in result["response"].get("output") or []:
        if isinstance(item, dict) and item.get("generation_token_ids") is not None:
            calls.append(
                ModelCall(
                    list(item.get("prompt_token_ids") or []),
                    list(item["generation_token_ids"]),
                    [float(x) for x in item.get("generation_log_probs") or []],
                )
            )
    failure = result.get("failure_reason")
    if failure is None and result.get("mask_sample"):
        failure = f"masked by NeMo Gym ({result.get('failure_kind') or 'no reason given'})"
    incomplete = result["response"].get("incomplete_details") or {}
    row = row or {}
    metrics = {
        name: float(value)
        for name, value in result.items()
        if name not in RESULT_FIELDS
        and name not in row
        and isinstance(value, int | float)
        and value == value  # not NaN
    }
    return Trajectory(
        calls=calls,
        metrics=metrics,
        reward=float(result.get("reward") or 0.0),
        failure_reason=failure,
        finish_reason="length" if incomplete.get("reason") == "max_output_tokens" else "stop",
    )
