"""Settings that contradict each other across sections are refused when the config is loaded
(nrl_core.config.validation), as one line and exit code 2 from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nrl_core.config.loader import resolve_config
from nrl_core.config.validation import optimizer_steps_per_rollout
from nrl_core.errors import ConfigError
from nrl_core.losses.config import resolved_clipped_pg_config
from nrl_core.plugins import PluginHost

# 4 prompts x 8 generations = 32 samples per rollout; micro batches of 8 (the recipe's 128
# would be larger than the global batches tried here, which is refused).
ROLLOUT = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=8",
    "policy.train_micro_batch_size=8",
]


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


def nrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


@pytest.mark.parametrize(("batch_size", "steps"), [(32, 1), (64, 1), (16, 2), (10, 4)])
def test_optimizer_steps_per_rollout(registry, batch_size, steps):
    config = resolve_config(
        "grpo", None, [*ROLLOUT, f"policy.train_global_batch_size={batch_size}"], registry
    )
    assert optimizer_steps_per_rollout(config) == steps


def test_on_policy_shortcut_with_several_optimizer_steps_is_refused(registry):
    with pytest.raises(ConfigError) as error:
        resolve_config(
            "grpo",
            None,
            [
                *ROLLOUT,
                "policy.train_global_batch_size=16",
                "loss.clipped_pg.on_policy_shortcut=true",
            ],
            registry,
        )
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("loss.clipped_pg.on_policy_shortcut=true needs one optimizer step")
    assert "policy.train_global_batch_size=16" in message
    assert "grpo.num_prompts_per_step x grpo.num_generations_per_prompt = 32" in message
    assert "set policy.train_global_batch_size=32 or loss.clipped_pg.on_policy_shortcut=false" in (
        message
    )


@pytest.mark.parametrize(
    ("batch_size", "value", "skips_prev_logprobs"),
    [
        # auto: skip exactly when one optimizer step takes the whole rollout.
        (32, None, True),
        (64, None, True),
        (16, None, False),
        (10, None, False),
        # An explicit choice stands.
        (32, "false", False),
        (64, "true", True),
    ],
)
def test_on_policy_shortcut_auto_skips_prev_logprobs_only_with_one_optimizer_step(
    registry, batch_size, value, skips_prev_logprobs
):
    from nrl_core.algorithms.runtime import loss_options
    from nrl_core.losses.clipped_pg import ClippedPGLoss

    overrides = [*ROLLOUT, f"policy.train_global_batch_size={batch_size}"]
    if value is not None:
        overrides.append(f"loss.clipped_pg.on_policy_shortcut={value}")
    config = resolve_config("grpo", None, overrides, registry)
    assert config.loss.options_for().on_policy_shortcut == (
        "auto" if value is None else value == "true"
    )
    # What the driver builds the run's loss from (Components.build_loss).
    options = loss_options(config, registry)
    assert options.on_policy_shortcut is skips_prev_logprobs
    assert ClippedPGLoss(options).needs_prev_logprobs is not skips_prev_logprobs
    # The loss alone, with `auto` unresolved, recomputes: the safe side.
    assert ClippedPGLoss(config.loss.options_for()).needs_prev_logprobs is (value != "true")


def test_on_policy_shortcut_refuses_other_values(registry):
    with pytest.raises(ConfigError) as error:
        resolve_config("grpo", None, ["loss.clipped_pg.on_policy_shortcut=sometimes"], registry)
    assert "on_policy_shortcut" in str(error.value) and "auto" in str(error.value)


@pytest.mark.parametrize(
    "overrides",
    [
        # One optimizer step per rollout (the batch may be larger than a rollout).
        ["policy.train_global_batch_size=32", "loss.clipped_pg.on_policy_shortcut=true"],
        ["policy.train_global_batch_size=64", "loss.clipped_pg.on_policy_shortcut=true"],
        # Several steps, but prev_logprobs are recomputed (explicitly, or by `auto`).
        ["policy.train_global_batch_size=16", "loss.clipped_pg.on_policy_shortcut=false"],
        ["policy.train_global_batch_size=16"],
    ],
)
def test_consistent_settings_load(registry, overrides):
    resolve_config("grpo", None, [*ROLLOUT, *overrides], registry)


def test_gspo_aggregates_per_sequence_by_default_and_refuses_token_mean(registry):
    config = resolve_config("grpo", None, ["loss.clipped_pg.ratio_level=sequence"], registry)
    options = config.loss.options_for()
    assert options.aggregation == "auto"
    assert resolved_clipped_pg_config(options, colocated=True).aggregation == (
        "seq_mean_token_mean"
    )
    with pytest.raises(ConfigError) as error:
        resolve_config(
            "grpo",
            None,
            ["loss.clipped_pg.ratio_level=sequence", "loss.clipped_pg.aggregation=token_mean"],
            registry,
        )
    assert str(error.value).startswith(
        "loss.clipped_pg: aggregation=token_mean cannot be used with ratio_level=sequence"
    )


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (
            ["policy.train_global_batch_size=16", "loss.clipped_pg.on_policy_shortcut=true"],
            "error: loss.clipped_pg.on_policy_shortcut=true needs one optimizer step per rollout",
        ),
        (
            ["loss.clipped_pg.ratio_level=sequence", "loss.clipped_pg.aggregation=token_mean"],
            "error: loss.clipped_pg: aggregation=token_mean cannot be used with ratio_level",
        ),
    ],
)
def test_cli_refuses_with_one_line_and_exit_2(tmp_path, overrides, start):
    # max_num_steps=0: were the config accepted, the run would end at once, with no worker.
    safe = [f"logger.log_dir={tmp_path}", "checkpointing.enabled=false", "grpo.max_num_steps=0"]
    result = nrl("run", "grpo", *ROLLOUT, *safe, *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(start)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("backend", ["torch", "vllm", "sglang"])
def test_async_grpo_on_colocated_engines_names_the_backends_own_key(registry, backend):
    """The message names the key that exists (``generation.<backend>.colocated``), and setting
    what it says makes the config load."""
    overrides = [f"generation.backend={backend}", "grpo.async.enabled=true"]
    with pytest.raises(ConfigError) as error:
        resolve_config("grpo", None, overrides, registry)
    key = f"generation.{backend}.colocated"
    assert f"set {key}=false" in str(error.value)
    assert "generation.colocated" not in str(error.value)
    config = resolve_config("grpo", None, [*overrides, f"{key}=false"], registry)
    assert config.generation.options_for().colocated is False


@pytest.mark.parametrize("gpus", ["cluster.gpus_per_node=8", "cluster.gpu_memory_gib=79.6"])
def test_nccl_refit_into_colocated_engines_is_refused_when_the_config_has_gpus(registry, gpus):
    nccl = ["generation.backend=vllm", "generation.vllm.refit_transport=nccl"]
    with pytest.raises(ConfigError) as error:
        resolve_config("grpo", None, [*nccl, gpus], registry)
    assert "generation.vllm.refit_transport=nccl with generation.vllm.colocated=true" in str(
        error.value
    )
    # Separate engines, or a config that does not say it has GPUs: accepted at load.
    resolve_config("grpo", None, [*nccl, gpus, "generation.vllm.colocated=false"], registry)
    resolve_config("grpo", None, nccl, registry)
