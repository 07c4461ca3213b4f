"""Checks that run before anything heavy starts (no Ray, no worker, no run folder).

Everything a user can get wrong in a config or a data file is found here, in the driver, in
seconds, and reported as one :class:`~nrl_core.errors.ConfigError` line naming the key or file
and the fix. :class:`~nrl_core.algorithms.runtime.RunSession` and ``nrl eval`` call
:func:`preflight` first.

What is checked (each in well under a second; no model or data is loaded here):

* every selected component is registered (:func:`check_components`), and so is
  ``server.tool_parser`` (:func:`check_tool_parser`);
* the settings that span sections (:func:`~nrl_core.config.validation.validate_run_config`,
  again: a config may have been built or changed in code);
* the model and tokenizer (:func:`check_model_source`): ``tiny``, a Hugging Face folder with
  ``config.json``, weights and tokenizer files, or a hub name found in the local cache or, when
  online, on the hub (one request with a short timeout; offline says so at once);
* an ``actor_env`` that names an interpreter names an executable one, and the Python modules
  the selected components' options need are in their actor environment
  (:func:`check_component_requirements`, e.g. ``peft`` for LoRA);
* the files and folders the options name (a dataset's ``path``, ``data.val_dataset``...) exist,
  and options classes with a ``preflight(key)`` method check their own
  (:func:`check_component_options`: ``env.reward_fn.path``'s file and function);
* ``logger.log_dir`` (and ``checkpointing.checkpoint_dir``, ``eval.output``) can be written;
* a ``checkpointing.resume`` path exists, with checkpointing on (the checkpoint itself is verified when the run looks
  for its resume point, still before anything starts);
* the policy's static memory per GPU fits the device (:func:`check_memory_plan`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import attrs

from nrl_core.config.schema import NO_ENVIRONMENT, ComponentSection
from nrl_core.distributed.inprocess import check_inprocess
from nrl_core.errors import ConfigError
from nrl_core.memory_plan import check_memory_plan
from nrl_core.registry import Registry

HUB_TIMEOUT_S = 3.0
"""The one request that asks the hub whether a model exists gives up after this long."""
INTERPRETER_TIMEOUT_S = 4.0
"""Asking another interpreter (a ``*.actor_env`` path) whether it imports a module."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


def check_components(config: Any, registry: Registry) -> None:
    """Fail when the config selects a component nobody registers."""
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        name = section.selected
        if section.component_kind == "dataset" and name.endswith(".jsonl"):
            continue  # a file, read by the registered `jsonl` dataset
        if section.component_kind == "dataset" and (section.component_kind, name) not in registry:
            # Not a dataset name but perhaps a path: a FIFO or a device is said as such (not
            # as an unknown dataset).
            _refuse_special_file(f"{field.name}.{section.selector}", name, Path(name).expanduser())
        if section.component_kind == "environment" and name == NO_ENVIRONMENT:
            if not hasattr(config, "teacher"):
                raise ConfigError(
                    f"env.name={NO_ENVIRONMENT}: only `nrl run distill` runs without an "
                    "environment; name a registered environment (see `nrl plugins`)"
                )
            continue
        registry.get(section.component_kind, name, key=f"{field.name}.{section.selector}")


def check_tool_parser(config: Any, registry: Registry) -> None:
    """Fail when ``server.tool_parser`` names a parser nobody registers (the endpoint would
    fail on its first request otherwise)."""
    from nrl_core.serving.tool_calls import KEYWORDS, unknown_parser_message

    name = getattr(getattr(config, "server", None), "tool_parser", None)
    if name is None or name in KEYWORDS or ("tool_parser", name) in registry:
        return
    raise ConfigError(unknown_parser_message(name, registry.names("tool_parser")))


def preflight(config: Any, registry: Registry, *, verbose: bool = False) -> list[str]:
    """Every check that needs only the driver: raise ``ConfigError`` on the first problem.
    Returns the lines worth showing before anything starts (the memory plan, or its warning);
    the CLI prints them (with ``verbose``, also why there is no memory plan)."""
    from nrl_core.config.validation import validate_run_config

    check_components(config, registry)
    check_tool_parser(config, registry)
    validate_run_config(config)
    check_pipeline_generation(config, registry)
    check_router_replay(config, registry)
    for key in ("policy", "teacher", "critic"):  # teacher: `nrl run distill`; critic: `ppo`
        model = getattr(config, key, None)
        if model is None:
            continue
        check_sequence_packing(model, key, registry)
        check_model_source(
            model.model_name,
            f"{key}.model_name",
            weights=True,
            tokenizer=model.tokenizer_name is None,
        )
        if model.tokenizer_name is not None:
            check_model_source(
                model.tokenizer_name, f"{key}.tokenizer_name", weights=False, tokenizer=True
            )
    check_local_resources(config)
    notes = [note for note in [check_memory_plan(config, registry, verbose=verbose)] if note]
    check_inprocess(config, registry)
    check_actor_envs(config)
    check_component_requirements(config, registry)
    check_component_options(config)
    check_named_files(config)
    check_output_folders(config)
    check_resume_path(config)
    return notes


def check_pipeline_generation(config: Any, registry: Registry) -> None:
    """Refuse generation inside the policy workers (``torch``, colocated) when the policy is
    split into pipeline stages: that generation runs the whole model on each rank, and a stage
    holds only some of its layers. Separate engines take the weights of every stage (refit)."""
    policy, generation = getattr(config, "policy", None), getattr(config, "generation", None)
    if policy is None or generation is None or not hasattr(policy, "options_for"):
        return
    options = policy.options_for()
    # The option names nrl_core.policy.policy_layout reads (that module imports torch).
    sizes = [
        getattr(options, n, None)
        for n in ("pipeline_parallel_size", "pipeline_model_parallel_size")
    ]
    if not any(isinstance(size, int) and size > 1 for size in sizes):
        return
    from nrl_core.generation import runs_in_policy_workers

    spec = registry.get("generation", generation.backend, key="generation.backend")
    if runs_in_policy_workers(spec, generation):
        key = f"generation.{generation.backend}.colocated"
        raise ConfigError(
            f"generation.backend={generation.backend} generates inside the policy workers, "
            f"which pipeline stages split (policy.{policy.selected} pipeline size > 1); set "
            f"{key}=false (separate engines, refitted from every stage) or use one stage"
        )


_MOE_ARCHS = ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "llama4")
"""The tiny model's mixture-of-experts architectures (nrl_core.testing.tiny.build_tiny_model)."""


def _has_experts(model_name: str) -> bool | None:
    """Whether ``model_name`` is a mixture of experts: a tiny named size by its architecture,
    a local folder by its ``config.json`` (an expert count, top level or ``text_config``);
    None when it cannot be known without the hub."""
    from nrl_core.testing.tiny import NAMED_SIZES

    if model_name in NAMED_SIZES:
        return NAMED_SIZES[model_name].get("arch") in _MOE_ARCHS
    file = Path(model_name).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # check_model_source says what is wrong with the file
    sections = [data, data.get("text_config") or {}] if isinstance(data, dict) else []
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(isinstance(sec.get(k), int) and sec[k] > 1 for sec in sections for k in keys)


def _model_type(model_name: str) -> str | None:
    """The Hugging Face ``model_type`` of ``model_name``: a tiny named size's architecture, a
    local folder's ``config.json``; None when it cannot be known without the hub."""
    from nrl_core.testing.tiny import NAMED_SIZES

    if model_name in NAMED_SIZES:
        return NAMED_SIZES[model_name].get("arch")
    try:
        data = json.loads((Path(model_name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = data.get("model_type") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None


def check_router_replay(config: Any, registry: Registry) -> None:
    """``policy.moe.router_replay`` / ``record_routing`` need a mixture-of-experts model, a
    policy backend that replays and measures routing (registered ``router_replay``; replay
    itself only for the model types it registers as ``router_replay_models``, where it does)
    and a generation backend whose engines record it (registered ``records_routing``)."""
    policy, generation = getattr(config, "policy", None), getattr(config, "generation", None)
    moe = getattr(policy, "moe", None)
    if moe is None or not moe.records_routing:
        return
    key = "policy.moe.router_replay" if moe.router_replay else "policy.moe.record_routing"
    if _has_experts(policy.model_name) is False:
        raise ConfigError(
            f"{key}=true needs a mixture-of-experts model, and policy.model_name="
            f"{policy.model_name} has no experts; use a MoE model (e.g. tiny-moe) or set "
            f"{key}=false"
        )
    backend = registry.get("policy", policy.backend, key="policy.backend")
    if not backend.metadata.get("router_replay"):
        raise ConfigError(
            f"{key}=true, and policy.backend={policy.backend} cannot replay or compare the "
            f"engine's routing; use policy.backend=dtensor or set {key}=false"
        )
    replayable = backend.metadata.get("router_replay_models")
    model_type = _model_type(policy.model_name)
    if moe.router_replay and replayable and model_type and model_type not in replayable:
        raise ConfigError(
            f"policy.moe.router_replay=true, and policy.backend={policy.backend} replays the "
            f"routers of {', '.join(replayable)} models only (policy.model_name="
            f"{policy.model_name} is {model_type}); set policy.moe.router_replay=false "
            "(policy.moe.record_routing=true still measures the routing agreement)"
        )
    if generation is None:
        return
    engine = registry.get("generation", generation.backend, key="generation.backend")
    if not engine.metadata.get("records_routing"):
        raise ConfigError(
            f"{key}=true, and generation.backend={generation.backend} does not record which "
            f"experts it routes each token to; use generation.backend=torch or vllm, or set "
            f"{key}=false"
        )


# The least CPU share each worker asks Ray for on a CPU-only machine (nrl_core.algorithms.runtime:
# policy ranks shrink to 0.1 CPU, ENV_CPUS_PER_WORKER; nrl_core.generation: ENGINE_CPUS_ON_CPU),
# copied here so that the driver need not import Ray to know that a layout cannot start.
_LEAST_CPUS = {"policy": 0.1, "env": 0.25, "generation": 0.5}


def check_local_resources(config: Any) -> None:
    """On the local cluster (``cluster.backend=local``), refuse worker counts that cannot fit
    the CPUs Ray will have (``cluster.num_cpus``, else this machine's) and
    ``cluster.gpus_per_node`` above the GPUs the driver lists, before Ray starts."""
    cluster = getattr(config, "cluster", None)
    if cluster is None or cluster.backend not in ("local", "auto"):
        return
    cpus = cluster.num_cpus or os.cpu_count() or 1
    source = f"cluster.num_cpus={cluster.num_cpus}" if cluster.num_cpus else "this machine"
    counts = []
    policy = getattr(config, "policy", None)
    if policy is not None and hasattr(policy, "num_workers"):
        counts.append(("policy.num_workers", policy.num_workers, _LEAST_CPUS["policy"]))
    env = getattr(config, "env", None)
    if env is not None and hasattr(env, "num_workers"):
        counts.append(("env.num_workers", env.num_workers, _LEAST_CPUS["env"]))
    generation = getattr(config, "generation", None)
    options = generation.options_for() if generation is not None else None
    engines = getattr(options, "num_engines", None)
    if isinstance(engines, int) and getattr(options, "colocated", False) is False:
        key = f"generation.{generation.backend}.num_engines"
        counts.append((key, engines, _LEAST_CPUS["generation"]))
    need = sum(n * share for _, n, share in counts)
    if need > cpus:
        key, n, _ = max(counts, key=lambda c: c[1] * c[2])
        raise ConfigError(
            f"{key}={n}: the workers need at least {need:g} CPUs and the local cluster has "
            f"{cpus} ({source}); lower {key} or set cluster.num_cpus (or use cluster.backend=ray)"
        )
    if cluster.gpus_per_node:
        from nrl_core.distributed.devices import nvidia_gpus

        found = len(nvidia_gpus() or [])
        if cluster.gpus_per_node > found:
            raise ConfigError(
                f"cluster.gpus_per_node={cluster.gpus_per_node}, and this machine has {found} "
                "NVIDIA GPUs; set cluster.gpus_per_node to at most that, or leave it unset "
                "(null) for what Ray detects"
            )


def check_sequence_packing(section: Any, key: str, registry: Registry) -> None:
    """``sequence_packing=true`` needs a backend that registers ``sequence_packing`` support
    (the worker still has the last word, e.g. a reward model's scalar head: see
    :attr:`nrl_core.policy.Policy.packing`)."""
    if section.sequence_packing is not True:
        return
    backend = registry.get("policy", section.backend, key=f"{key}.backend")
    if not backend.metadata.get("sequence_packing"):
        raise ConfigError(
            f"{key}.sequence_packing=true, and {key}.backend={section.backend} does not pack "
            f"sequences; set {key}.sequence_packing=auto (packs where supported) or false"
        )


# -- model and tokenizer --------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when the Hugging Face libraries are told to stay offline (``HF_HUB_OFFLINE`` or
    ``TRANSFORMERS_OFFLINE``), read now rather than when ``huggingface_hub`` was imported."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")
    )


def check_model_source(name: str, key: str, *, weights: bool, tokenizer: bool) -> None:
    """``name`` (the value of ``key``) can be loaded: ``tiny``, a local folder holding what a
    Hugging Face model folder holds (``config.json`` and weights with ``weights``, tokenizer
    files with ``tokenizer``), or a hub name that is cached locally or, online, exists."""
    from nrl_core.testing.tiny import NAMED_SIZES  # stdlib-only at import

    if name in NAMED_SIZES:
        return
    path = Path(name).expanduser()
    if path.exists():
        _check_model_folder(path, name, key, weights=weights, tokenizer=tokenizer)
        return
    if not _HUB_ID.match(name) or name.startswith((".", "~")):
        raise ConfigError(
            f"{key}={name}: no such folder; give a Hugging Face model folder, a hub name "
            "(org/model), or `tiny`"
        )
    _check_hub_model(name, key)


def _check_model_folder(path: Path, name: str, key: str, *, weights: bool, tokenizer: bool) -> None:
    if not path.is_dir():
        raise ConfigError(f"{key}={name} is a file; give the model's folder (with config.json)")
    if weights:
        config = path / "config.json"
        if not config.is_file():
            hint = (
                "it is an nrl checkpoint: export it with `nrl convert` first, or resume it with "
                "checkpointing.resume"
                if (path / "trainer_state.json").is_file() or (path / "manifest.json").is_file()
                else "give a Hugging Face model folder (config.json, weights, tokenizer files)"
            )
            raise ConfigError(f"{key}={name} has no config.json; {hint}")
        _check_json_file(config, key, name)
        if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
            raise ConfigError(
                f"{key}={name} has no weights (model.safetensors or pytorch_model.bin); give "
                "a complete Hugging Face model folder"
            )
        _check_weight_files(path, key, name)
    if tokenizer:
        present = [f for f in _TOKENIZER_FILES if (path / f).is_file()]
        if not present:
            fix = "set policy.tokenizer_name" if weights else "give a tokenizer folder"
            raise ConfigError(
                f"{key}={name} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}); {fix}"
            )
        for file in ("tokenizer_config.json", "tokenizer.json"):
            if (path / file).is_file():
                _check_json_file(path / file, key, name)


MAX_MODEL_JSON_BYTES = 64 << 20
"""Largest JSON file of a model folder read here (a large tokenizer.json is about 20 MB)."""
MAX_SAFETENSORS_HEADER = 100_000_000
"""Largest header of a ``.safetensors`` file (the limit the safetensors library itself sets)."""


def _check_json_file(file: Path, key: str, name: str) -> Any:
    """The JSON object in ``file`` of the model folder ``name``; a damaged file (not JSON, over
    :data:`MAX_MODEL_JSON_BYTES`, nested deeper than Python's parser goes) is one line naming
    it."""
    fix = "the folder is damaged, copy or download it again"
    try:
        with file.open("rb") as handle:
            raw = handle.read(MAX_MODEL_JSON_BYTES + 1)
        if len(raw) > MAX_MODEL_JSON_BYTES:
            raise ConfigError(
                f"{key}={name}: {file} is over {MAX_MODEL_JSON_BYTES >> 20} MiB, too large for "
                f"a model folder's JSON file; {fix}"
            )
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:120]
        raise ConfigError(
            f"{key}={name}: {file.name} is not valid JSON ({reason}); {fix}"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{key}={name}: {file} is nested too deeply to be read (not a model's JSON); {fix}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}={name}: {file.name} does not hold a JSON object")
    return data


def _check_weight_files(path: Path, key: str, name: str) -> None:
    """The weight files of model folder ``path`` can be opened: each ``*.safetensors`` has a
    readable header whose tensors lie inside the file, an index names files that exist, and
    no ``*.bin`` file is empty. Headers only: no tensor is read (a worker would fail on these
    after Ray started, as ``policy rank 0 failed in construct``)."""
    fix = "the folder is damaged, copy or download it again"
    indexes = [*path.glob("*.safetensors.index.json"), *path.glob("*.bin.index.json")]
    for index_file in sorted(indexes):
        index = _check_json_file(index_file, key, name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ConfigError(
                f"{key}={name}: {index_file.name} has no `weight_map` of tensor names to files; "
                f"{fix}"
            )
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or not (path / shard).is_file():
                raise ConfigError(
                    f"{key}={name}: {index_file.name} names {shard!r}, which is not a file in "
                    f"the folder; {fix}"
                )
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem is not None:
            raise ConfigError(f"{key}={name}: {file} {problem}; {fix}")
    for file in sorted(path.glob("*.bin")):
        if file.is_file() and file.stat().st_size == 0:
            raise ConfigError(f"{key}={name}: {file} is empty; {fix}")


def _safetensors_problem(file: Path) -> str | None:
    """What makes ``file`` no safetensors file (its 8-byte header length, JSON header, and
    every tensor's byte range against the file's size), or ``None``."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or length > min(MAX_SAFETENSORS_HEADER, size - 8):
                return "is not a safetensors file (no readable header; cut short?)"
            header = json.loads(handle.read(length))
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    except (ValueError, RecursionError):
        return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    data_size = size - 8 - length
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"has no valid byte range for tensor {tensor!r} (not a safetensors file)"
        if offsets[1] > data_size:
            return (
                f"is cut short: tensor {tensor!r} ends at byte {offsets[1]} of the data, which "
                f"holds {data_size} bytes"
            )
    return None


def check_model_configs(config: Any) -> None:
    """Each local model folder's ``config.json`` loads with transformers' ``AutoConfig`` (an
    unknown ``model_type``, a field of the wrong kind), as the policy workers will load it.
    Imports transformers (and torch): called by the run session before the data is loaded,
    not by the CLI's early :func:`preflight`."""
    from nrl_core.testing.tiny import NAMED_SIZES

    for key in ("policy", "teacher", "critic"):
        model = getattr(config, key, None)
        if model is None or model.model_name in NAMED_SIZES:
            continue
        path = Path(model.model_name).expanduser()
        if not (path / "config.json").is_file():
            continue  # a hub name: the cache's copy was written by the hub
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(str(path))
        except Exception as exc:  # transformers' ValueError, KeyError, TypeError, OSError...
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                f"{key}.model_name={model.model_name}: {path / 'config.json'} does not load "
                f"as a model config ({type(exc).__name__}: {first[:200]}); fix the file, or "
                "copy or download the model again"
            ) from None


def _check_hub_model(name: str, key: str) -> None:
    try:
        from huggingface_hub import HfApi, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # an id the cache layout cannot hold; the hub check below says why
        cached = None
    if isinstance(cached, str):
        return  # in the local Hugging Face cache: loads offline
    fix = f"download it first (`hf download {name}`) or set {key} to a local folder"
    if hub_offline():
        raise ConfigError(
            f"{key}={name} is not a local folder and not in the Hugging Face cache, and the hub "
            f"is off (HF_HUB_OFFLINE); {fix}"
        )
    from huggingface_hub import errors

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        HfApi(endpoint=endpoint).model_info(name, timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        raise ConfigError(
            f"{key}={name} is a gated model on the Hugging Face hub; accept its terms on the "
            "hub and log in (`hf auth login`) or set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(
            f"{key}={name}: no such folder here and no such model on the Hugging Face hub "
            "(or it is private: log in with `hf auth login`); check the name"
        ) from None
    except errors.HFValidationError:
        raise ConfigError(
            f"{key}={name}: no such folder, and not a valid hub name (org/model)"
        ) from None
    except Exception as exc:  # no network, DNS, proxy, timeout, hub error: all "unreachable"
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise ConfigError(
            f"{key}={name} is not a local folder and not in the Hugging Face cache, and the hub "
            f"cannot be reached ({reason}); {fix}, or set HF_HUB_OFFLINE=1 when working offline"
        ) from None


# -- what the components' options need -------------------------------------------------------


def check_actor_envs(config: Any) -> None:
    """An ``actor_env`` (of a section, of ``cluster``, or ``$NRL_ACTOR_ENV``) that names an
    interpreter names an executable file; otherwise the run would stop when its actors
    start, after Ray."""
    from nrl_core.distributed.actor_env import ACTOR_ENV_VAR, actor_env_setting

    cluster_value = getattr(getattr(config, "cluster", None), "actor_env", None)
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        setting = actor_env_setting(section.actor_env, cluster_value)
        if setting in ("system", "venv", "auto"):
            continue
        path = Path(setting).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            if section.actor_env:
                key = f"{field.name}.actor_env"
            elif cluster_value:
                key = "cluster.actor_env"
            else:
                key = f"${ACTOR_ENV_VAR}"
            raise ConfigError(
                f"{key}={setting} is not an executable Python interpreter; use `system`, the "
                "path of a python, or leave it unset for the plugin's venv"
            )


def check_component_requirements(config: Any, registry: Registry) -> None:
    """Each selected component's options may declare ``required_modules()``: ``{module:
    (extra, setting)}``, the Python modules its actors must import for these settings, the
    extra of the component's distribution that installs each, and the setting that asks for it
    (``lora_rank=8``). Fail when the actor environment the component will run in cannot have
    them, saying how to get them there."""
    from nrl_core.distributed.actor_env import actor_env_setting

    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        name = section.selected
        options = section.options_for(name)
        required = getattr(options, "required_modules", None)
        spec = registry.find(section.component_kind, name)
        if not callable(required) or spec is None:
            continue
        setting = actor_env_setting(
            section.actor_env, getattr(getattr(config, "cluster", None), "actor_env", None)
        )
        dist = spec.distribution or "nrl-core"
        for module, (extra, because) in required().items():
            what = f"{field.name}.{name}.{because} needs `{module}`"
            here = importlib.util.find_spec(module) is not None
            if setting == "system" or spec.distribution is None:
                if not here:
                    raise ConfigError(
                        f"{what}, which this interpreter (where the {spec.kind} runs: "
                        f"actor_env=system) lacks; install it here: pip install '{dist}[{extra}]'"
                    )
            elif setting not in ("venv", "auto") and not _interpreter_has(setting, module):
                raise ConfigError(
                    f"{what}, which the {spec.kind}'s actor_env={setting} cannot import; "
                    f"install '{dist}[{extra}]' into that environment, or point "
                    f"{field.name}.actor_env at one that has it"
                )
            # In the plugin's own venv (venv/auto) nothing to check: it is built with the
            # extras the options require (actor_env.component_extras).


def _interpreter_has(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        result = subprocess.run(
            [python, "-c", code], capture_output=True, timeout=INTERPRETER_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return True  # the interpreter itself is checked (and reported) when actors start
    return result.returncode == 0


# -- files and folders -----------------------------------------------------------------------


def _resolve(path: str, key: str) -> Path:
    from nrl_core.datasets import SHIPPED_PREFIX, shipped_path  # light: no torch

    if path.startswith(SHIPPED_PREFIX):
        return shipped_path(path, key=key)
    return Path(path).expanduser()


def _refuse_special_file(key: str, value: str, path: Path) -> None:
    """Refuse ``path`` when it exists and is a FIFO, a device or a socket (``os.stat`` only:
    opening a FIFO would block). Missing paths and folders pass: the caller says those."""
    from nrl_core.datasets import not_a_regular_file

    try:
        kind = not_a_regular_file(path)
    except OSError:
        return
    if kind is not None and kind != "a folder":
        raise ConfigError(f"{key}={value} is {kind}, not a regular file; name a .jsonl data file")


def _named_files(config: Any) -> list[tuple[str, str]]:
    """``(key, path)`` of every input file or folder the config names."""
    found: list[tuple[str, str]] = []
    data = getattr(config, "data", None)
    if data is not None:
        if data.dataset.endswith(".jsonl"):
            found.append(("data.dataset", data.dataset))
        if data.val_dataset:
            found.append(("data.val_dataset", data.val_dataset))
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        options = section.options_for()
        if options is None or not attrs.has(type(options)) or _checks_itself(options):
            continue
        for name in ("path", "validation_path"):
            value = getattr(options, name, None)
            if isinstance(value, str) and value:
                found.append((f"{field.name}.{section.selected}.{name}", value))
    return found


def _checks_itself(options: Any) -> bool:
    return callable(getattr(options, "preflight", None))


def check_component_options(config: Any) -> None:
    """Options classes that check their own inputs: a selected component's options object with
    a ``preflight(key)`` method (``key``: its section, e.g. ``env.reward_fn``) is asked here,
    and raises ``ConfigError`` (a file it names, such as ``env.reward_fn.path``, is then not
    checked as a plain path: the option's value is its own)."""
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        if not isinstance(section, ComponentSection):
            continue
        options = section.options_for()
        if options is not None and _checks_itself(options):
            options.preflight(f"{field.name}.{section.selected}")


def check_named_files(config: Any) -> None:
    """The data files (and other inputs) the config names exist. Their contents are checked
    line by line when the data is loaded, still before any worker starts."""
    for key, value in _named_files(config):
        path = _resolve(value, key)
        if not path.exists():
            raise ConfigError(f"{key}={value} does not exist; check the path")
        # Before any size check: a FIFO or /dev/zero has size 0 but is not "empty".
        _refuse_special_file(key, value, path)
        if path.suffix == ".jsonl":
            if path.is_dir():
                raise ConfigError(f"{key}={value} is a folder; name a .jsonl file")
            if path.stat().st_size == 0:
                raise ConfigError(f"{key}={value} is empty; it needs one JSON object per line")


def check_writable_folder(value: str | Path, key: str) -> None:
    """``value`` is, or can be created as, a folder this process may write to."""
    path = Path(value).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(
            f"{key}={value}: {probe} is a file, not a folder; choose another {key.split('.')[-1]}"
        )
    action = "write to" if probe == path else f"create {path} in"
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}={value}: cannot {action} {probe} (permission denied); choose a folder you "
            "can write to"
        )
    # os.access trusts the mode bits (always "yes" for root); a real, empty, removed folder
    # also finds read-only mounts and pseudo file systems such as /proc.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nrl-preflight-", dir=probe))
    except OSError as exc:
        raise ConfigError(
            f"{key}={value}: cannot {action} {probe} ({exc.strerror}); choose a folder you can "
            "write to"
        ) from None


def check_output_folders(config: Any) -> None:
    """The run folder, the checkpoint folder and an ``eval.output`` file can be written."""
    logger = getattr(config, "logger", None)
    if logger is not None:
        check_writable_folder(logger.log_dir, "logger.log_dir")
        run_dir = Path(logger.log_dir).expanduser() / logger.run_name
        if run_dir.exists():
            check_writable_folder(run_dir, "logger.run_name")
    checkpointing = getattr(config, "checkpointing", None)
    if checkpointing is not None and checkpointing.enabled and checkpointing.checkpoint_dir:
        check_writable_folder(checkpointing.checkpoint_dir, "checkpointing.checkpoint_dir")
    output = getattr(getattr(config, "eval", None), "output", None)
    if output:
        if Path(output).is_dir():
            raise ConfigError(f"eval.output={output} is a folder; name the eval.json file")
        check_writable_folder(Path(output).expanduser().absolute().parent, "eval.output")


def check_resume_path(config: Any) -> None:
    """A ``checkpointing.resume`` that names a path exists (``auto``/``never`` pass), and
    checkpointing is on: ``checkpointing.enabled=false`` turns resuming off too (as in NeMo
    RL), so a path given with it would be ignored in silence."""
    checkpointing = getattr(config, "checkpointing", None)
    if checkpointing is None or checkpointing.resume in ("auto", "never"):
        return
    if not checkpointing.enabled:
        raise ConfigError(
            f"checkpointing.resume={checkpointing.resume} is ignored with "
            "checkpointing.enabled=false (which turns off reading checkpoints as well as "
            "writing them); set checkpointing.enabled=true to resume, or drop "
            "checkpointing.resume"
        )
    path = Path(checkpointing.resume).expanduser()
    if not path.exists():
        raise ConfigError(
            f"checkpointing.resume={checkpointing.resume}: no such folder; use auto, never or "
            "the path of a step_N checkpoint folder"
        )
    if not path.is_dir():
        raise ConfigError(
            f"checkpointing.resume={checkpointing.resume} is a file; give its step_N folder"
        )
