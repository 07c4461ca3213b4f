"""Prompts too long for `policy.max_total_sequence_length` at data loading (RunSession), in the
step-0 metrics of GRPO, and as a one-line CLI error when no prompt fits."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from nrl_core.algorithms.grpo import GRPOTrainer
from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.loader import resolve_config
from nrl_core.config.schema import GRPOConfig
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginHost


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


def write_problems(path, lengths):
    path.write_text(
        "".join(json.dumps({"problem": "7" * n, "answer": "7"}) + "\n" for n in lengths)
    )
    return path


def grpo_config(tmp_path, registry, tiny_model_path, *overrides):
    # The tiny template renders a prompt as <|bos|><|user|>{problem}<|eos|><|assistant|>:
    # len(problem) + 4 tokens. 20 - 6 leaves room for prompts of up to 14 tokens, i.e.
    # problems of up to 10 characters.
    return resolve_config(
        "grpo",
        None,
        [
            f"policy.model_name={tiny_model_path}",
            "policy.max_total_sequence_length=20",
            "generation.max_new_tokens=6",
            "data.jsonl.prompt_template={problem}",
            f"logger.log_dir={tmp_path / 'runs'}",
            *overrides,
        ],
        registry,
    )


def test_overlong_prompts_are_dropped_and_counted_per_split(
    tmp_path, registry, tiny_model_path, capsys
):
    train = write_problems(tmp_path / "train.jsonl", [2, 5, 10, 11, 15])
    val = write_problems(tmp_path / "val.jsonl", [3, 12])
    config = grpo_config(
        tmp_path,
        registry,
        tiny_model_path,
        f"data.dataset={train}",
        f"data.val_dataset={val}",
        "data.shuffle=false",
    )
    session = RunSession(config, registry, algorithm="grpo", console=Console())
    session.data.load()

    problems = [s.metadata["problem"] for s in session.train_stream.take(3)]
    assert problems == ["7" * 2, "7" * 5, "7" * 10]
    assert [s.metadata["problem"] for s in session.val_samples] == ["7" * 3]
    assert session.data_metrics == {
        "data/prompts_dropped_overlong": 2.0,
        "data/val_prompts_dropped_overlong": 1.0,
    }
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1
    assert warning[0].startswith("warning: dropped 2 of 5 training and 1 of 2 validation prompts")
    assert "policy.max_total_sequence_length" in warning[0]
    # Nothing started: loading the data needs only the driver's tokenizer.
    assert session.cluster is None and session.policy is None


def test_a_dataset_with_no_prompt_that_fits_is_a_config_error(tmp_path, registry, tiny_model_path):
    train = write_problems(tmp_path / "train.jsonl", [11, 12, 30])
    config = grpo_config(tmp_path, registry, tiny_model_path, f"data.dataset={train}")
    session = RunSession(config, registry, algorithm="grpo", console=Console(quiet=True))
    with pytest.raises(ConfigError) as error:
        session.data.load()
    message = str(error.value)
    assert "\n" not in message
    assert "every one of the" in message and "longer than 14 tokens" in message
    assert "policy.max_total_sequence_length=20" in message
    assert "generation.max_new_tokens=6" in message


def test_grpo_logs_the_drop_counts_with_the_step_0_metrics():
    logged = []

    @contextlib.contextmanager
    def progress(total, completed, fields=None):
        yield lambda metrics: None

    config = GRPOConfig()
    config.grpo.max_num_steps = 1
    config.grpo.val_period = 0
    session = SimpleNamespace(
        config=config,
        start_step=0,
        data_metrics={"data/prompts_dropped_overlong": 3.0},
        val_samples=[],  # no validation: the progress line names the reward
        env_pool=None,
        log=lambda step, metrics: logged.append((step, dict(metrics))),
        progress=progress,
        should_checkpoint=lambda step, last: False,
        gate=None,
        summary=lambda: None,
    )

    class NoTraining(GRPOTrainer):
        def train_step(self, step):
            return {"train/reward_mean": 0.0}

    assert NoTraining(session).fit() == 0
    assert logged[0] == (0, {"data/prompts_dropped_overlong": 3.0})
    assert logged[1][0] == 1 and "data/prompts_dropped_overlong" not in logged[1][1]


def test_cli_exits_2_with_one_line_before_anything_starts(tmp_path):
    # The embedded recipe's arithmetic prompts ("3+4=") are 8 tokens; with 8 - 4 = 4 tokens
    # left for a prompt none fits.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nrl_core.cli",
            "run",
            "grpo",
            "-q",
            f"logger.log_dir={tmp_path}",
            "logger.run_name=run",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "policy.max_total_sequence_length=8",
            "generation.max_new_tokens=4",
            # Were the prompts kept, one small step and no more.
            "grpo.max_num_steps=1",
            "grpo.val_period=0",
            "grpo.sft_warmup_steps=0",
            "grpo.num_prompts_per_step=1",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=2",
            "policy.train_micro_batch_size=2",
            "policy.num_workers=1",
            "checkpointing.enabled=false",
            "cluster.num_cpus=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: every one of the ")
    assert "training prompts of data.dataset=arithmetic" in lines[0]
    assert "raise policy.max_total_sequence_length" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    # Reported before the run directory (and so before Ray and the workers) was created.
    assert not (tmp_path / "run").exists()
