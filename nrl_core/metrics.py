"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard / W&B / MLflow on request."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from nrl_core.config.schema import LoggerConfig
from nrl_core.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN or inf; they are written as null (and never silently as 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors it to the sinks
    enabled in ``logger``.

    On resume the lines of steps after the checkpoint are dropped first, so the file never
    holds two records of one step.
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
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            self._truncate_after(resume_step)
        self._sinks: list[Any] = []
        if config.tensorboard:
            self._sinks.append(_TensorBoard(run_dir))
        if config.wandb:
            self._sinks.append(_WandB(config, run_config))
        if config.mlflow:
            self._sinks.append(_MLflow(config, run_config))

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [
            json.dumps(record)
            for record in _records(self.path.read_text())
            if record.get("step", 0) <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self._sinks:
            sink.log(step, metrics)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        with (self.run_dir / SAMPLES_FILE).open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, in order."""
    return _records((Path(run_dir) / METRICS_FILE).read_text())


def _records(text: str) -> list[dict[str, Any]]:
    """The JSON records of a ``metrics.jsonl`` text. A last line that does not parse is the
    torn write of a run killed mid-line, and is left out; a bad line before it is corruption
    and an error naming the line."""
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ConfigError(
                f"{METRICS_FILE} line {number} is not JSON; the file is corrupt (only a torn "
                "last line is tolerated)"
            ) from None
        if isinstance(record, dict):
            records.append(record)
    return records


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
    def __init__(self, run_dir: Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, config: LoggerConfig, run_config: dict[str, Any] | None) -> None:
        self.wandb = _require("wandb", "wandb")
        self.run = self.wandb.init(name=config.run_name, config=run_config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, config: LoggerConfig, run_config: dict[str, Any] | None) -> None:
        self.mlflow = _require("mlflow", "mlflow")
        self.mlflow.start_run(run_name=config.run_name)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numeric = {
            k.replace("/", "."): v
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(v)
        }
        self.mlflow.log_metrics(numeric, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
