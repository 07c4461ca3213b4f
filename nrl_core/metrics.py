"""Where a run's metrics and sample rollouts go: ``metrics.jsonl`` and ``samples.jsonl``
always, TensorBoard / W&B / MLflow on request.

Every sink gets the resolved run config once at start (TensorBoard: hyperparameters; W&B: the
run config; MLflow: params and a ``config.yaml`` artifact), each step's metrics, and the sample
tables of :meth:`MetricsLogger.log_samples`. A resumed run continues the same W&B and MLflow
runs: their ids are kept in ``<run dir>/logger_ids.json``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nrl_core import atomic
from nrl_core.config.schema import LoggerConfig
from nrl_core.errors import ConfigError
from nrl_core.run_log import output_to_run_log

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
LOGGER_IDS_FILE = "logger_ids.json"
"""The W&B run id and MLflow run id of the run folder (``{"wandb": ..., "mlflow": ...}``)."""
TENSORBOARD_DIR = "tensorboard"

HPARAM_METRICS = ("train/reward_mean", "train/loss", "val/accuracy")
"""Metrics TensorBoard's HParams dashboard shows beside the hyperparameters (those a run does
not log stay empty)."""
MLFLOW_PARAM_VALUE_LIMIT = 500
"""MLflow refused longer param values before 2.? (6000 since); the full config is also logged
as the ``config.yaml`` artifact, so a truncated value loses nothing."""
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000

TABLE_COLUMNS = ("step", "task", "prompt", "completion", "answer", "reward", "advantage")
"""Columns of the sample tables the sinks receive (``advantage`` for training samples only),
then ``finish_reason``."""


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN or inf; they are written as null (and never silently as 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def samples_due(step: int, period: int, last_step: int) -> bool:
    """Whether training step ``step`` logs sample rollouts: step 1, every ``period`` steps and
    the last step ``last_step`` (so a run shorter than ``period`` still has samples); never
    with ``period`` 0."""
    return period > 0 and (step == 1 or step % period == 0 or step == last_step)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as one level of dotted keys (``policy.optimizer.lr``); lists and empty
    sections stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _scalar(value: Any) -> bool | int | float | str:
    """A config value as a TensorBoard hyperparameter: numbers, strings and booleans as they
    are, anything else (null, lists, infinities) as its JSON text."""
    if isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return json.dumps(value, default=str)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors it to the sinks
    enabled in ``logger``; sample rollouts go to ``samples.jsonl`` and the sinks' tables.

    ``run_config``: the resolved run config as a plain dict, given to every sink at start.
    ``resume_step``: the checkpoint step a resumed run continues from (None: a fresh run). On
    resume the records of steps after it are dropped from ``metrics.jsonl`` and
    ``samples.jsonl`` first, so neither file holds two records of one step, TensorBoard hides
    its events after that step, and W&B and MLflow continue the runs named in
    ``logger_ids.json``. A fresh run starts both files (and the TensorBoard folder) empty and
    starts new W&B / MLflow runs.
    """

    def __init__(
        self,
        run_dir: Path,
        config: LoggerConfig,
        *,
        resume_step: int | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.samples_path = run_dir / SAMPLES_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
            self.samples_path.unlink(missing_ok=True)
        else:
            _truncate_after(self.path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        ids = self._saved_ids() if resume_step is not None else {}
        run_config = run_config or {}
        self._sinks: list[Any] = []
        # W&B last: its run cannot be taken back (issue 39: MLflow refusing its file store left
        # the W&B run started just before it behind), MLflow's can (deleted by discard()).
        starts = (
            ("tensorboard", lambda: _TensorBoard(run_dir, run_config, resume_step)),
            ("mlflow", lambda: _MLflow(config, run_dir, run_config, ids.get("mlflow"))),
            ("wandb", lambda: _WandB(config, run_dir, run_config, ids.get("wandb"))),
        )
        for name, start in starts:
            if not getattr(config, name):
                continue
            try:
                self._sinks.append(start())
            except Exception as exc:
                self._discard()  # the sinks already started: no run of a run that never was
                if isinstance(exc, ConfigError):
                    raise
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ConfigError(f"logger.{name}=true: could not start logging: {first}") from None
        self._save_ids(ids)

    def _saved_ids(self) -> dict[str, str]:
        try:
            ids = json.loads((self.run_dir / LOGGER_IDS_FILE).read_text())
        except (OSError, ValueError):
            return {}  # none yet (or unreadable): the sinks start new runs
        return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}

    def _save_ids(self, previous: dict[str, str]) -> None:
        # Ids of sinks off in this session are kept: turning W&B back on later continues it.
        ids = {**previous, **{s.name: s.id for s in self._sinks if getattr(s, "id", None)}}
        path = self.run_dir / LOGGER_IDS_FILE
        if ids:
            atomic.write_text(path, json.dumps(ids, indent=2) + "\n")
        else:
            path.unlink(missing_ok=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``metrics`` of ``step`` to ``metrics.jsonl`` and the sinks."""
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        _append(self.path, json.dumps(record) + "\n")
        for sink in self._sinks:
            sink.log(step, metrics)

    def log_samples(
        self, step: int, samples: list[dict[str, Any]], *, split: str = "train"
    ) -> None:
        """Append sample rollouts of ``step`` to ``samples.jsonl`` (one line each, with
        ``step`` and ``split`` first) and send them to the sinks as one table.

        A sample holds ``task``, ``prompt`` (the chat messages before the response),
        ``completion`` (the response text), ``answer`` (the reference, or None), ``reward``,
        ``advantage`` (training samples) and ``finish_reason``.
        """
        if not samples:
            return
        records = [{"step": step, "split": split, **sample} for sample in samples]
        _append(
            self.samples_path,
            "".join(json.dumps(_clean_record(r), default=str) + "\n" for r in records),
        )
        columns, rows = sample_table(records)
        for sink in self._sinks:
            sink.log_samples(step, split, columns, rows)

    def close(self) -> None:
        """Finish the sinks' runs (W&B, MLflow) and flush TensorBoard."""
        while self._sinks:
            self._sinks.pop().close()

    def _discard(self) -> None:
        """Undo the sinks started so far (a later one failed): a run they created is deleted
        where the sink can (``discard``), else finished."""
        while self._sinks:
            sink = self._sinks.pop()
            getattr(sink, "discard", sink.close)()


def _append(path: Path, text: str) -> None:
    """Append ``text`` to ``path``; an OSError names the file (a failed write or close, e.g. a
    full disk, does not say which file otherwise)."""
    try:
        with path.open("a") as f:
            f.write(text)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _clean_record(record: dict[str, Any]) -> dict[str, Any]:
    return {k: _clean(v) for k, v in record.items()}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, in order."""
    return _records((Path(run_dir) / METRICS_FILE).read_text())


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``samples.jsonl``, in order (none when it has none)."""
    path = Path(run_dir) / SAMPLES_FILE
    return _records(path.read_text(), SAMPLES_FILE) if path.exists() else []


def _truncate_after(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` from the JSON-lines file ``path``."""
    if not path.exists():
        return
    keep = [
        json.dumps(record)
        for record in _records(path.read_text(), path.name)
        if record.get("step", 0) <= step
    ]
    path.write_text("".join(f"{line}\n" for line in keep))


def _records(text: str, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The JSON records of a JSON-lines text (the file ``name``). A last line that does not
    parse is the torn write of a run killed mid-line, and is left out; a bad line before it is
    corruption and an error naming the line."""
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ConfigError(
                f"{name} line {number} is not JSON; the file is corrupt (only a torn "
                "last line is tolerated)"
            ) from None
        if isinstance(record, dict):
            records.append(record)
    return records


# -- sample tables --------------------------------------------------------------------------


def prompt_text(prompt: Any) -> str:
    """A sample's prompt as text: the only message's content, or one ``role: content`` line
    per message."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt or [])
    if len(messages) == 1:
        return str(messages[0].get("content", ""))
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)


def sample_table(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The columns and rows of sample ``records`` (as :meth:`MetricsLogger.log_samples`
    writes them) for a table: texts as strings (an absent answer is empty), rewards and
    advantages as numbers."""
    train = any("advantage" in r for r in records)
    columns = [c for c in TABLE_COLUMNS if c != "advantage" or train] + ["finish_reason"]
    rows = []
    for r in records:
        values = {
            "step": r.get("step"),
            "task": str(r.get("task", "")),
            "prompt": prompt_text(r.get("prompt")),
            "completion": str(r.get("completion", "")),
            "answer": "" if r.get("answer") is None else str(r["answer"]),
            "reward": _number(r.get("reward")),
            "advantage": _number(r.get("advantage")),
            "finish_reason": str(r.get("finish_reason", "")),
        }
        rows.append([values[c] for c in columns])
    return columns, rows


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def shorten(text: str, limit: int) -> str:
    """``text`` on one line (whitespace collapsed), at most ``limit`` characters: its head and
    tail around an ellipsis, since a response's final answer is at its end."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    tail = (limit - 1) // 3
    return f"{text[: limit - 1 - tail]}…{text[len(text) - tail :]}"


def samples_console_table(
    step: int, records: Sequence[dict[str, Any]], *, split: str = "train", max_rows: int = 4
) -> Any:
    """A compact ``rich`` table of at most ``max_rows`` sample ``records``: the prompt's last
    message, the completion and the reference answer shortened to one line each, the reward and
    (training samples) the advantage, as TRL's ``log_completions`` prints it."""
    from rich.table import Table

    train = any("advantage" in r for r in records)
    table = Table(title=f"samples at step {step} ({split})", title_justify="left", expand=True)
    table.add_column("prompt", ratio=2, overflow="fold")
    table.add_column("completion", ratio=3, overflow="fold")
    table.add_column("answer", ratio=1, overflow="fold")
    table.add_column("reward", justify="right", no_wrap=True)
    if train:
        table.add_column("advantage", justify="right", no_wrap=True)
    for r in list(records)[:max_rows]:
        prompt = r.get("prompt")
        last = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else prompt
        cells = [
            shorten(str(last or ""), 120),
            shorten(str(r.get("completion", "")), 200),
            shorten("" if r.get("answer") is None else str(r["answer"]), 40),
            _format(r.get("reward"), "{:.3f}"),
        ]
        if train:
            cells.append(_format(r.get("advantage"), "{:+.3f}"))
        table.add_row(*cells)
    return table


def _format(value: Any, spec: str) -> str:
    return "-" if value is None else spec.format(float(value))


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (what TensorBoard's text dashboard renders); ``|`` escaped and line
    breaks as ``<br>`` so that every row stays one table row."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# -- sinks ------------------------------------------------------------------------------------


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"logger.{extra}=true needs {module}; install it with "
            f"`pip install nrl-core[{extra}]` or set logger.{extra}=false"
        ) from None


class _TensorBoard:
    """Scalars, the config as HParams (written once per session into the run's own event
    files, not the sub-run ``add_hparams`` makes) and sample tables as Markdown text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, run_config: dict[str, Any], resume_step: int | None) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        folder = run_dir / TENSORBOARD_DIR
        if resume_step is None and folder.is_dir():
            # A fresh run in a used folder: metrics.jsonl starts empty, so do the curves.
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        # purge_step hides the events a killed session wrote after the checkpoint it resumes.
        self.writer = SummaryWriter(
            str(folder), purge_step=None if resume_step is None else resume_step + 1
        )
        self._end = None
        if run_config:
            flat = {k: _scalar(v) for k, v in flatten_config(run_config).items()}
            experiment, start, end = _hparams_summaries(flat, HPARAM_METRICS)
            self.writer.file_writer.add_summary(experiment)
            self.writer.file_writer.add_summary(start)
            self._end = end  # the session's end, written on close
            self.writer.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, split: str, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text(f"samples/{split}", markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        if self._end is not None:
            self.writer.file_writer.add_summary(self._end)
        self.writer.close()


def _hparams_summaries(hparams: dict[str, bool | int | float | str], metrics: Sequence[str]):
    """The HParams plugin's experiment, session-start and session-end summaries of
    ``hparams``. Built here rather than with ``torch.utils.tensorboard.summary.hparams``,
    which records booleans as the numbers 0 and 1."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    def summary(tag: str, **data: Any) -> Any:
        content = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **data)
        plugin = SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()
        )
        return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for name, value in hparams.items():
        if isinstance(value, bool):
            start.hparams[name].bool_value, kind = value, api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, int | float):
            start.hparams[name].number_value, kind = value, api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].string_value, kind = str(value), api_pb2.DATA_TYPE_STRING
        infos.append(api_pb2.HParamInfo(name=name, type=kind))
    experiment = api_pb2.Experiment(
        hparam_infos=infos,
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics],
    )
    return (
        summary(metadata.EXPERIMENT_TAG, experiment=experiment),
        summary(metadata.SESSION_START_INFO_TAG, session_start_info=start),
        summary(
            metadata.SESSION_END_INFO_TAG,
            session_end_info=plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS),
        ),
    )


class _WandB:
    """A W&B run (project ``logger.wandb_project``) with the run config; its files go to
    ``<run dir>/wandb`` unless ``$WANDB_DIR`` says otherwise. ``run_id``: the run to continue
    (``resume="allow"``: W&B creates it when it does not exist)."""

    name = "wandb"

    def __init__(
        self,
        config: LoggerConfig,
        run_dir: Path,
        run_config: dict[str, Any],
        run_id: str | None,
    ) -> None:
        self.wandb = _require("wandb", "wandb")
        options: dict[str, Any] = {
            "project": config.wandb_project or os.environ.get("WANDB_PROJECT") or "nrl",
            "entity": config.wandb_entity,
            "name": config.run_name,
            "dir": None if os.environ.get("WANDB_DIR") else str(run_dir),
        }
        if run_id:
            options.update(id=run_id, resume="allow")
        # Its "wandb: ..." lines (the run's folder at init; history and summary at finish) are
        # third-party output: to the run log, like Ray's (docs/runtime.md).
        with output_to_run_log("(wandb)"):
            self.run = self.wandb.init(**options)
        # Set after init: a resumed run's config may differ (e.g. a raised max_num_steps).
        self.run.config.update(run_config, allow_val_change=True)
        self.id = self.run.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, split: str, columns: list[str], rows: list[list]) -> None:
        table = self.wandb.Table(columns=columns, data=rows)
        self.run.log({f"samples/{split}": table}, step=step)

    def close(self) -> None:
        with output_to_run_log("(wandb)"):
            self.run.finish()


_MLFLOW_BAD_KEY = re.compile(r"[^\w\-. :/]")
"""Characters MLflow refuses in param and metric names (it raises mid-run on them)."""


def mlflow_key(key: str) -> str:
    """``key`` as an MLflow name: ``pass@4`` becomes ``pass_at_4``, any other character MLflow
    refuses ``_``, at most 250 characters."""
    return _MLFLOW_BAD_KEY.sub("_", key.replace("@", "_at_"))[:250]


class _MLflow:
    """An MLflow run in experiment ``logger.mlflow_experiment`` at ``logger.mlflow_tracking_uri``
    (both default to MLflow's environment variables). The flattened config becomes its params
    (values cut at :data:`MLFLOW_PARAM_VALUE_LIMIT` characters) and the full config its
    ``config.yaml`` artifact; sample tables are JSON artifacts ``samples/<split>/step_N.json``
    in the ``{"columns", "data"}`` layout of ``mlflow.log_table``. A client, not the fluent
    ``mlflow.start_run``: no process-wide active run to collide with."""

    name = "mlflow"

    def __init__(
        self,
        config: LoggerConfig,
        run_dir: Path,
        run_config: dict[str, Any],
        run_id: str | None,
    ) -> None:
        mlflow = _require("mlflow", "mlflow")
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=config.mlflow_tracking_uri)
        self.created = False
        """Whether this sink created its run (not one it continues): :meth:`discard` deletes it."""
        logged: dict[str, str] = {}
        run = self._existing(run_id) if run_id else None
        if run is not None:
            self.id = run.info.run_id
            self.client.update_run(self.id, status="RUNNING")
            logged = dict(run.data.params)
        else:
            if run_id:
                print(
                    f"warning: MLflow run {run_id} of {LOGGER_IDS_FILE} is gone; logging to "
                    "a new run",
                    file=sys.stderr,
                )
            name = config.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "nrl"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(name)
            )
            self.id = self.client.create_run(
                experiment_id, run_name=config.run_name, tags={"nrl.run_dir": str(run_dir)}
            ).info.run_id
            self.created = True
        # Params cannot change once logged: a resumed run adds only the keys it lacks (a
        # changed value shows in the config.yaml artifact, which is replaced).
        params = [
            Param(key, value) for key, value in self.params(run_config).items() if key not in logged
        ]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.id, params=params[start : start + MLFLOW_PARAMS_PER_BATCH])
        if run_config:
            import yaml

            text = yaml.safe_dump(run_config, sort_keys=False, default_flow_style=False)
            self.client.log_text(self.id, text, "config.yaml")

    def _existing(self, run_id: str) -> Any:
        try:
            return self.client.get_run(run_id)
        except Exception:  # MlflowException RESOURCE_DOES_NOT_EXIST, or another store
            return None

    @staticmethod
    def params(run_config: dict[str, Any]) -> dict[str, str]:
        """The flattened config as MLflow params: keys with MLflow's characters only, values
        as text of at most :data:`MLFLOW_PARAM_VALUE_LIMIT` characters."""
        params = {}
        for key, value in flatten_config(run_config).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > MLFLOW_PARAM_VALUE_LIMIT:
                text = text[: MLFLOW_PARAM_VALUE_LIMIT - 3] + "..."
            params[mlflow_key(key)] = text
        return params

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        numeric = [
            Metric(mlflow_key(k.replace("/", ".")), float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(v)
        ]
        for start in range(0, len(numeric), MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(
                self.id, metrics=numeric[start : start + MLFLOW_METRICS_PER_BATCH]
            )

    def log_samples(self, step: int, split: str, columns: list[str], rows: list[list]) -> None:
        self.client.log_dict(
            self.id, {"columns": columns, "data": rows}, f"samples/{split}/step_{step:06d}.json"
        )

    def close(self) -> None:
        self.client.set_terminated(self.id)

    def discard(self) -> None:
        """The run did not start after all: delete the MLflow run this sink created (one it
        continues is only marked finished)."""
        if self.created:
            self.client.delete_run(self.id)
        else:
            self.close()
