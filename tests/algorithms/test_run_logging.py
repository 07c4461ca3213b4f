"""A run's set-up hands its resolved config to the logging sinks (read back from TensorBoard's
event files), before any cluster starts."""

from __future__ import annotations

import pytest
from rich.console import Console

from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.loader import resolve_config
from nrl_core.plugins import PluginHost


class _ClusterReached(Exception):
    """Raised where the run would start its cluster: the set-up before it is what is tested."""


def _no_cluster():
    raise _ClusterReached


def test_the_sinks_get_the_resolved_run_config(tmp_path, tiny_model_path):
    pytest.importorskip("tensorboard", reason="logger.tensorboard needs the tensorboard extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    registry = PluginHost.discover().registry()
    config = resolve_config(
        "grpo",
        None,
        [
            f"policy.model_name={tiny_model_path}",
            f"logger.log_dir={tmp_path}",
            "logger.run_name=run",
            "logger.tensorboard=true",
            "grpo.num_prompts_per_step=3",
        ],
        registry,
    )
    session = RunSession(config, registry, algorithm="grpo", console=Console(quiet=True))
    session.components.start_cluster = _no_cluster
    with pytest.raises(_ClusterReached):
        session._setup()
    session.close()

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info.hparams
    assert start["policy.model_name"].string_value == str(tiny_model_path)
    assert start["grpo.num_prompts_per_step"].number_value == 3
    assert start["logger.tensorboard"].bool_value is True
    assert "env.name" in start  # every section, not just the ones overridden
