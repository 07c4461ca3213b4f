"""``metrics.jsonl`` (a run killed mid-write leaves a torn last line; resume and plots read
on), ``samples.jsonl``, the console sample table, and what TensorBoard, W&B (offline mode) and
MLflow (a local store) receive, read back with their own readers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.config.schema import LoggerConfig
from nrl_core.errors import ConfigError
from nrl_core.metrics import (
    LOGGER_IDS_FILE,
    METRICS_FILE,
    MetricsLogger,
    read_metrics,
    read_samples,
    samples_console_table,
    samples_due,
    shorten,
)


def _write(run_dir, *records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / METRICS_FILE).write_text(text)


def test_resume_drops_a_torn_last_line_and_later_steps(tmp_path):
    _write(
        tmp_path, {"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3}, tail='{"step": 4, "x"'
    )
    logger = MetricsLogger(tmp_path, LoggerConfig(), resume_step=2)
    logger.log(3, {"x": 3.5})
    assert read_metrics(tmp_path) == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
        {"step": 3, "x": 3.5},
    ]


def test_read_metrics_tolerates_only_a_torn_last_line(tmp_path):
    _write(tmp_path, {"step": 1}, tail='{"step": 2, "trunc')
    assert read_metrics(tmp_path) == [{"step": 1}]
    _write(tmp_path, {"step": 1}, tail='not json\n{"step": 3}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_metrics(tmp_path)


# -- samples.jsonl ----------------------------------------------------------------------------

SAMPLE = {
    "task": "arithmetic",
    "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}],
    "completion": "7",
    "answer": "7",
    "reward": 1.0,
    "advantage": 0.5,
    "finish_reason": "stop",
}
TRAIN_COLUMNS = [
    *("step", "task", "prompt", "completion", "answer", "reward", "advantage", "finish_reason")
]
TRAIN_ROW = [1, "arithmetic", "system: Add.\nuser: 3+4=", "7", "7", 1.0, 0.5, "stop"]
"""SAMPLE as a sink's table row at step 1: the prompt's messages as text."""
RUN_CONFIG = {
    "seed": 42,
    "policy": {"model_name": "tiny", "optimizer": {"lr": 1e-3}, "tokenizer_name": None},
    "generation": {"stop_strings": ["\n"]},
    "grpo": {"max_num_steps": 3, "normalize_rewards": True},
    "data": {"options": {}},
}


def test_samples_start_empty_on_a_fresh_run_and_lose_later_steps_on_resume(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig())
    for step in (1, 2, 3):
        logger.log_samples(step, [SAMPLE])
    logger.log_samples(2, [{**SAMPLE, "advantage": None}], split="validation")
    records = read_samples(tmp_path)
    assert [(r["step"], r["split"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (2, "validation"),
    ]
    assert list(records[0]) == ["step", "split", *SAMPLE]  # step and split first
    assert records[0]["prompt"] == SAMPLE["prompt"] and records[0]["answer"] == "7"

    MetricsLogger(tmp_path, LoggerConfig(), resume_step=2)
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 2, 2]
    MetricsLogger(tmp_path, LoggerConfig())  # checkpointing.resume=never: a new run
    assert read_samples(tmp_path) == []


def test_samples_are_due_at_step_1_every_period_and_the_last_step():
    assert [s for s in range(1, 8) if samples_due(s, 3, 7)] == [1, 3, 6, 7]
    assert [s for s in range(1, 3) if samples_due(s, 10, 2)] == [1, 2]  # shorter than period
    assert not any(samples_due(s, 0, 5) for s in range(1, 6))


def test_the_console_table_shortens_text_and_shows_reward_and_advantage():
    from rich.console import Console

    long = "step " * 100 + "so the answer is 42"
    records = [
        {"step": 5, "split": "train", **SAMPLE, "completion": long, "advantage": -0.25},
        *[{"step": 5, "split": "train", **SAMPLE, "completion": f"row {i}"} for i in range(5)],
    ]
    console = Console(record=True, width=500)  # wide enough that no cell wraps
    console.print(samples_console_table(5, records, max_rows=4))
    text = console.export_text()
    assert "samples at step 5 (train)" in text
    assert "3+4=" in text and "Add." not in text  # the prompt's last message
    assert "…" in text and "the answer is 42" in text  # head … tail of a long completion
    assert "-0.250" in text and "+0.500" in text and "1.000" in text
    assert "row 2" in text and "row 3" not in text  # at most max_rows rows
    assert shorten("a\n\nb   c", 10) == "a b c"
    assert len(shorten("x" * 50, 20)) == 20


# -- sinks, read back with their own readers ----------------------------------------------------


def _tensorboard_events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return events


def test_tensorboard_gets_hyperparameters_scalars_and_sample_tables(tmp_path):
    pytest.importorskip("tensorboard", reason="logger.tensorboard needs the tensorboard extra")
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = MetricsLogger(tmp_path, LoggerConfig(tensorboard=True), run_config=RUN_CONFIG)
    logger.log(1, {"train/reward_mean": 0.5, "train/kl": float("nan")})
    logger.log_samples(1, [{**SAMPLE, "completion": "a | b\nc"}])
    logger.close()

    events = _tensorboard_events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("train/reward_mean")] == [(1, 0.5)]
    assert "train/kl" not in events.Tags()["scalars"]  # NaN is not a point
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info.hparams
    assert start["policy.optimizer.lr"].number_value == pytest.approx(1e-3)
    assert start["policy.model_name"].string_value == "tiny"
    assert start["grpo.normalize_rewards"].bool_value is True
    assert start["policy.tokenizer_name"].string_value == "null"
    assert start["generation.stop_strings"].string_value == '["\\n"]'
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    assert {m.name.tag for m in experiment.metric_infos} >= {"val/accuracy"}
    assert "_hparams_/session_end_info" in content  # written on close
    (text,) = events.Tensors("samples/train/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 1
    assert table.splitlines()[0] == (
        "| step | task | prompt | completion | answer | reward | advantage | finish_reason |"
    )
    assert "| a \\| b<br>c |" in table and "system: Add.<br>user: 3+4=" in table


def test_tensorboard_resume_hides_the_events_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard", reason="logger.tensorboard needs the tensorboard extra")
    logger = MetricsLogger(tmp_path, LoggerConfig(tensorboard=True))
    for step in (1, 2, 3):
        logger.log(step, {"x": float(step)})
    logger.close()
    logger = MetricsLogger(tmp_path, LoggerConfig(tensorboard=True), resume_step=1)
    logger.log(2, {"x": 20.0})
    logger.close()
    points = _tensorboard_events(tmp_path / "tensorboard").Scalars("x")
    assert [(p.step, p.value) for p in points] == [(1, 1.0), (2, 20.0)]

    MetricsLogger(tmp_path, LoggerConfig(tensorboard=True)).close()  # a fresh run
    assert "x" not in _tensorboard_events(tmp_path / "tensorboard").Tags()["scalars"]


def _wandb_records(path):
    """The records of a ``.wandb`` file. wandb >= 0.2x no longer ships a Python reader for its
    offline files: they are a LevelDB-style log (32 KiB blocks; each chunk a 4-byte CRC, a
    2-byte length and a type: 1 full, 2 first, 3 middle, 4 last) of ``Record`` protobufs after
    a 7-byte header."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, pos = [], [], 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def _wandb_run(run_dir):
    """What the offline runs in ``run_dir/wandb`` hold, in order: (run id, project, display
    name, config, {step: history}) per session."""
    import wandb

    # wandb-core writes the offline file asynchronously; stopping it flushes everything.
    wandb.teardown()
    sessions = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        config, history, run = {}, {}, None
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config.update({u.key: json.loads(u.value_json) for u in run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in record.history.item}
                history[record.history.step.num] = items
        sessions.append((run.run_id, run.project, run.display_name, config, history))
    return sessions


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="logger.wandb needs the wandb extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def test_wandb_gets_the_config_project_name_metrics_and_tables_and_resume_continues_it(
    tmp_path, wandb_offline
):
    run_dir = tmp_path / "run"
    config = LoggerConfig(wandb=True, run_name="grpo-7", wandb_project="my-project")
    logger = MetricsLogger(run_dir, config, run_config=RUN_CONFIG)
    logger.log_samples(1, [SAMPLE])
    logger.log(1, {"train/reward_mean": 0.25})
    logger.log(2, {"train/reward_mean": 0.5})
    logger.close()
    run_id = json.loads((run_dir / LOGGER_IDS_FILE).read_text())["wandb"]

    ((first_id, project, name, seen, history),) = _wandb_run(run_dir)
    assert (first_id, project, name) == (run_id, "my-project", "grpo-7")
    assert seen["policy"] == RUN_CONFIG["policy"] and seen["grpo"]["max_num_steps"] == 3
    assert json.loads(history[1]["train/reward_mean"]) == 0.25
    assert json.loads(history[1]["samples/train/_type"]) == "table-file"
    (table_file,) = (run_dir / "wandb").glob(
        "offline-run-*/files/media/table/samples/train_*.table.json"
    )
    table = json.loads(table_file.read_text())
    assert table["columns"] == TRAIN_COLUMNS
    assert table["data"] == [TRAIN_ROW]

    # Resumed from the step-1 checkpoint with a raised max_num_steps: the same W&B run.
    raised = {**RUN_CONFIG, "grpo": {**RUN_CONFIG["grpo"], "max_num_steps": 5}}
    logger = MetricsLogger(run_dir, config, run_config=raised, resume_step=1)
    logger.log(2, {"train/reward_mean": 0.75})
    logger.close()
    _, second = _wandb_run(run_dir)
    assert second[0] == first_id and second[2] == "grpo-7"
    assert second[3]["grpo"]["max_num_steps"] == 5
    assert json.loads(second[4][2]["train/reward_mean"]) == 0.75
    assert json.loads((run_dir / LOGGER_IDS_FILE).read_text())["wandb"] == run_id

    # A fresh start in the same folder (resume=never) is a new W&B run.
    MetricsLogger(run_dir, config, run_config=RUN_CONFIG).close()
    assert json.loads((run_dir / LOGGER_IDS_FILE).read_text())["wandb"] != run_id


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="logger.mlflow needs the mlflow extra")
    # MLflow 3 keeps its file store only on request; it needs no database package.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return f"file:{tmp_path / 'mlruns'}"


def test_mlflow_gets_params_config_metrics_and_tables_and_resume_continues_it(
    tmp_path, mlflow_store
):
    import mlflow
    import yaml

    run_dir = tmp_path / "run"
    long_value = "x" * 700
    run_config = {**RUN_CONFIG, "data": {"options": {}, "system_prompt": long_value}}
    run_config["extra"] = {f"k{i}": i for i in range(120)}  # more than one batch of params
    config = LoggerConfig(
        mlflow=True,
        run_name="grpo-7",
        mlflow_experiment="nrl-tests",
        mlflow_tracking_uri=mlflow_store,
    )
    logger = MetricsLogger(run_dir, config, run_config=run_config)
    logger.log(1, {"train/reward_mean": 0.25, "train/kl": float("nan"), "val/pass@4": 0.5})
    logger.log_samples(1, [SAMPLE])
    logger.log_samples(
        1, [{k: v for k, v in SAMPLE.items() if k != "advantage"}], split="validation"
    )
    logger.close()

    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    run_id = json.loads((run_dir / LOGGER_IDS_FILE).read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "grpo-7" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "nrl-tests"
    assert run.data.tags["nrl.run_dir"] == str(run_dir)
    params = run.data.params
    assert params["policy.optimizer.lr"] == "0.001" and params["policy.model_name"] == "tiny"
    assert params["policy.tokenizer_name"] == "null" and params["data.options"] == "{}"
    assert params["generation.stop_strings"] == '["\\n"]'
    assert params["extra.k119"] == "119"  # the second batch
    assert len(params["data.system_prompt"]) == 500 and params["data.system_prompt"].endswith("...")
    # NaN is not a point; `@` is not an MLflow name character.
    assert run.data.metrics == {"train.reward_mean": 0.25, "val.pass_at_4": 0.5}
    artifacts = client.download_artifacts(run_id, "", str(tmp_path / "artifacts"))
    assert yaml.safe_load((Path(artifacts) / "config.yaml").read_text()) == run_config
    train = json.loads((Path(artifacts) / "samples/train/step_000001.json").read_text())
    assert train == {"columns": TRAIN_COLUMNS, "data": [TRAIN_ROW]}
    validation = json.loads((Path(artifacts) / "samples/validation/step_000001.json").read_text())
    assert "advantage" not in validation["columns"]

    # Resumed: the same run, new metrics after the old ones, a changed param left as it was.
    raised = {**run_config, "grpo": {**run_config["grpo"], "max_num_steps": 5}, "new": 1}
    logger = MetricsLogger(run_dir, config, run_config=raised, resume_step=1)
    assert client.get_run(run_id).info.status == "RUNNING"
    logger.log(2, {"train/reward_mean": 0.75})
    logger.close()
    assert json.loads((run_dir / LOGGER_IDS_FILE).read_text())["mlflow"] == run_id
    history = client.get_metric_history(run_id, "train.reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    params = client.get_run(run_id).data.params
    assert params["new"] == "1" and params["grpo.max_num_steps"] == "3"
    artifacts = client.download_artifacts(run_id, "config.yaml", str(tmp_path / "again"))
    assert yaml.safe_load(Path(artifacts).read_text())["grpo"]["max_num_steps"] == 5


def test_a_sink_that_cannot_start_is_one_config_error_line(tmp_path, mlflow_store):
    config = LoggerConfig(mlflow=True, mlflow_tracking_uri="nosuch://tracking")
    with pytest.raises(ConfigError) as error:
        MetricsLogger(tmp_path, config, run_config=RUN_CONFIG)
    message = str(error.value)
    assert message.startswith("logger.mlflow=true: could not start logging:")
    assert "nosuch://tracking" in message and "\n" not in message


def test_mlflow_refusing_to_start_leaves_no_wandb_run(tmp_path, wandb_offline, mlflow_store):
    """Issue 39: MLflow refusing its store left behind the W&B run started just before."""
    config = LoggerConfig(wandb=True, mlflow=True, mlflow_tracking_uri="nosuch://tracking")
    with pytest.raises(ConfigError, match=r"logger\.mlflow=true: could not start logging"):
        MetricsLogger(tmp_path / "run", config, run_config=RUN_CONFIG)
    assert not (tmp_path / "run" / "wandb").exists()


def test_wandb_refusing_to_start_deletes_the_mlflow_run_it_followed(
    tmp_path, wandb_offline, mlflow_store, monkeypatch
):
    import mlflow

    # A W&B that refuses its settings (as it refuses a mode it does not know); teardown() makes
    # it read the environment again (an earlier test's W&B keeps its settings otherwise).
    import wandb

    monkeypatch.setenv("WANDB_MODE", "no-such-mode")
    wandb.teardown()
    config = LoggerConfig(wandb=True, mlflow=True, mlflow_tracking_uri=mlflow_store)
    try:
        with pytest.raises(ConfigError, match=r"logger\.wandb=true: could not start logging"):
            MetricsLogger(tmp_path / "run", config, run_config=RUN_CONFIG)
    finally:
        monkeypatch.setenv("WANDB_MODE", "offline")
        wandb.teardown()  # the next test's W&B reads its own environment
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    experiment = client.get_experiment_by_name("nrl")
    runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
    assert runs == []  # the run MLflow had created is deleted


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logger.num_samples=0", "logger.num_samples must be >= 1, got 0"),
        ("logger.wandb_project=''", "logger.wandb_project must be a non-empty string or null"),
        ("logger.mlflow_experiment=''", "logger.mlflow_experiment must be a non-empty string"),
    ],
)
def test_logger_options_out_of_range_are_config_errors(override, message):
    from nrl_core.config.loader import resolve_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_config("grpo", None, [override], None)


def test_wandb_lines_go_to_the_run_log_not_the_console(tmp_path, wandb_offline):
    """Issue 39: W&B's "wandb: ..." lines (its folder at init, the run's history and summary at
    finish) reached the console of a run, which keeps third-party output in nrl.log."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from nrl_core.config.schema import LoggerConfig\n"
        "from nrl_core.metrics import MetricsLogger\n"
        "from nrl_core.run_log import open_run_log\n"
        "run_dir = Path(sys.argv[1])\n"
        "run_dir.mkdir(parents=True)\n"
        "close_log = open_run_log(run_dir)\n"
        "config = LoggerConfig(wandb=True, run_name='r', wandb_project='p')\n"
        "logger = MetricsLogger(run_dir, config, run_config={'seed': 1})\n"
        "logger.log(1, {'train/reward_mean': 0.25})\n"
        "logger.close()\n"
        "close_log()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}  # W&B as users have it
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wandb" not in done.stdout + done.stderr, done.stdout + done.stderr
    log = (tmp_path / "run" / "nrl.log").read_text()
    assert "(wandb) wandb: Run summary:" in log and "offline-run-" in log
