"""Options of the NeMo Gym agent (``agent.nemo_gym``) and dataset (``data.nemo_gym_jsonl``)."""

from __future__ import annotations

import attrs

from nrl_core.config.schema import NON_EMPTY, ge, gt, option

EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
TRAINING_MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"


@attrs.define
class NemoGymAgentConfig:
    """How NeMo Gym's servers are found or started, and how rows are sent to them."""

    config_paths: list[str] = option(
        [],
        (
            "NeMo Gym config files of the environments (resources server + agent), absolute or "
            "relative to the installed Gym package, shared by every Gym task; each task's own "
            "(`data.tasks[i].agent_configs`) are added, and one `ng_run` serves them all, with "
            f"the training model server (`{TRAINING_MODEL_CONFIG}`) pointed at nrl's "
            f"endpoint. With none anywhere: `{EXAMPLE_CONFIG}`."
        ),
    )
    head_server_url: str | None = option(
        None,
        (
            "Join a running NeMo Gym head server (e.g. http://127.0.0.1:11000) instead of "
            "starting one; its model server must already point at this run's endpoint."
        ),
    )
    nemo_gym_version: str = option(
        "0.7.0", "The nemo-gym release installed in the Gym virtualenv.", validator=NON_EMPTY
    )
    gym_python: str | None = option(
        None,
        (
            "The Python the Gym virtualenvs are built with (default: the run's own). Gym's "
            "processes join the run's Ray cluster, so it must be the run's Python version."
        ),
    )
    host: str = option(
        "127.0.0.1",
        (
            "Address Gym's head server and servers bind (its `default_host`): loopback by "
            "default, which serves a 1-node cluster (they are started beside the agent actor). "
            "Bind a reachable address only on a trusted network: Gym's servers take no key."
        ),
        validator=NON_EMPTY,
    )
    max_concurrency: int = option(
        32, "Rows in flight at once, over all of an actor's share of a batch.", validator=ge(1)
    )
    startup_timeout_s: float = option(
        600.0, "Longest wait for Gym's servers to be ready, in seconds (> 0).", validator=gt(0)
    )
    request_timeout_s: float = option(
        600.0,
        (
            "Longest one row's /run may take, in seconds (> 0); then the row fails (counted "
            "in agent_failures). Keep it below agent.run_timeout_s (900 s), the limit on an "
            "actor's whole share of a batch, which ends the run: at 600 s a hung row fails "
            "alone and the rows still running keep 300 s. A stall is reported after a minute "
            "either way (the driver's waiting line); raise both for rollouts that take longer."
        ),
        validator=gt(0),
    )


@attrs.define
class NemoGymDataConfig:
    """A NeMo Gym JSONL file: one row per line, ``{"responses_create_params": {"input": [...],
    "tools": [...], ...}, "agent_ref": {"name": ...}, ...}``."""

    path: str = option("", "The training rows (a .jsonl file).", validator=NON_EMPTY)
    val_path: str | None = option(None, "Validation rows (default: a held-out share of path).")
