"""``nrl convert CHECKPOINT_DIR --to hf OUT_DIR``: a training checkpoint as a Hugging Face folder.

The checkpoint describes itself: every ``step_N`` folder written by
:class:`~nrl_core.algorithms.runtime.RunSession` holds the resolved run config
(``config.yaml``) next to the policy's own files (``policy/``); reading it (step-folder
lookup, format detection, saved config) is :mod:`nrl_core.checkpoint`'s job. The command rebuilds that
policy's worker(s) from the config (any algorithm: GRPO, SFT, DPO, RM), loads the checkpoint
into them and calls their ``export_hf``. The format is detected from the folder's files and
checked against the config's ``policy.backend``: the ``dtensor`` policy's
``torch.distributed.checkpoint`` (reshardable: ``--num-workers`` may differ from training) or
the ``megatron`` policy's one ``rank{N}.pt`` per rank (loaded with as many ranks as wrote it).

Where the worker runs: a reshardable checkpoint whose policy imports here (its extras and the
modules its options need are installed in this interpreter) is loaded by one worker built in
this process, with no Ray and no actor venv (seconds instead of a cluster start); the same
worker methods run either way, so the folder written is the same. Otherwise (a megatron
checkpoint, a policy whose dependencies live only in its actor venv, or ``--num-workers``) the
policy's workers start on Ray as in training.

A LoRA policy's checkpoint converts to the merged model (``--lora merged``, the default: the
policy's ``export_hf``) or to its adapters alone (``--lora adapters``): a PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base_model, OUT_DIR)`` loads on the base model. The adapters
come from the policy workers' ``lora_adapter_tensors()`` and ``lora_adapter(version)`` (the two
methods every policy backend that trains adapters implements), so this module stays
backend-neutral.

Imports stay lazy: ``nrl --help`` must not import torch, ray or transformers.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMATS = ("hf",)
LORA_EXPORTS = ("merged", "adapters")
"""``--lora`` values: the adapters merged into the base weights (a full model), or the
adapters alone (a PEFT folder)."""


def add_parser(subparsers: Any) -> None:
    """Register ``nrl convert`` on the CLI's sub-command parsers."""
    parser = subparsers.add_parser(
        "convert",
        help="turn a training checkpoint into a Hugging Face folder",
        description=(
            "Convert a step_N checkpoint folder (or a checkpoint directory: its newest step) "
            "into a Hugging Face folder loadable with from_pretrained."
        ),
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a step_N folder")
    parser.add_argument("--to", choices=FORMATS, default="hf", help="output format (hf)")
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the model folder")
    parser.add_argument(
        "--lora",
        choices=LORA_EXPORTS,
        default="merged",
        help="for a LoRA policy: `merged` (default) writes the model with the adapters merged "
        "into its base weights; `adapters` writes only the adapters, as a PEFT folder "
        "(adapter_config.json, adapter_model.safetensors) for PeftModel.from_pretrained",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an OUT_DIR that already holds files (or is a symbolic link to a "
        "folder): convert's own files replace those of the same name; nothing else there is "
        "removed",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the run's config, for checkpoints that carry none (default: CHECKPOINT/config.yaml)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        metavar="N",
        help="load with N policy ranks on Ray (default: one worker in this process when the "
        "policy allows it, else as trained; only the dtensor format reshards)",
    )
    from nrl_core.cli import _plugin_option

    _plugin_option(parser)
    parser.set_defaults(handler=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from nrl_core.plugins import PluginHost, parse_selection

    registry = PluginHost.discover(parse_selection(args.plugin)).registry()
    out = convert(
        args.checkpoint,
        args.out,
        registry=registry,
        config_file=args.config,
        num_workers=args.num_workers,
        quiet=bool(getattr(args, "quiet", False)),
        overwrite=args.overwrite,
        lora=args.lora,
    )
    if not getattr(args, "quiet", False):
        print(f"wrote {out}")
    return 0


def convert(
    checkpoint: str | Path,
    out: str | Path,
    *,
    registry: Any,
    config_file: str | None = None,
    num_workers: int | None = None,
    quiet: bool = True,
    overwrite: bool = False,
    lora: str = "merged",
) -> Path:
    """Write the policy of ``checkpoint`` as a Hugging Face folder ``out``; return ``out``.

    ``lora`` (one of :data:`LORA_EXPORTS`): ``adapters`` writes only a LoRA policy's
    adapters, as a PEFT folder; a checkpoint of a policy without LoRA refuses it (a
    :class:`~nrl_core.errors.ConfigError`, before any worker starts).

    ``out`` must be new or an empty folder; with ``overwrite`` it may also be a folder that
    holds files, or a symbolic link to a folder: the export's files then replace those of
    the same names and nothing else in it is removed (:func:`nrl_core.atomic.fill_dir`).
    Anything else is a :class:`~nrl_core.errors.ConfigError`, raised before the checkpoint
    is read.
    """
    _check_out_dir(Path(out), overwrite)
    import tempfile

    import attrs
    from rich.console import Console

    from nrl_core.checkpoint import (
        POLICY_CHECKPOINT,
        detect_format,
        find_step_folder,
        megatron_ranks,
        refuse_nonfinite_export,
        saved_config,
    )

    _check_writable(Path(out))
    step = find_step_folder(checkpoint)
    algorithm, config = saved_config(step, registry, config_file)
    if config_file is None:
        _warn_dropped_settings(step)
    _check_lora_export(lora, config, step)
    fmt = detect_format(step, config.policy.backend)
    out = Path(out).resolve()
    policy = config.policy
    if fmt == "megatron_rank":
        # One file per rank, no resharding: load with exactly the ranks that wrote it.
        from nrl_core.errors import ConfigError

        ranks = megatron_ranks(step)
        if num_workers is not None and num_workers != ranks:
            raise ConfigError(
                f"{step} is a megatron checkpoint written by {ranks} ranks and cannot be "
                f"resharded; drop --num-workers or pass --num-workers {ranks}"
            )
        num_workers = ranks
    spec = registry.get("policy", policy.backend, key="policy.backend")
    if num_workers is None and loads_in_process(fmt, spec, policy.options_for()):
        _export_in_process(spec, config, step / POLICY_CHECKPOINT, out, lora)
        return out
    from nrl_core.algorithms.runtime import RunSession  # imports Ray: only on this path

    if num_workers is not None:
        policy = attrs.evolve(policy, num_workers=num_workers)
    with tempfile.TemporaryDirectory(prefix="nrl-convert-") as scratch:
        # The cluster may keep logs under the run directory: use a scratch one, never the
        # original run's.
        logger = attrs.evolve(config.logger, log_dir=scratch, run_name="convert")
        config = attrs.evolve(config, policy=policy, logger=logger)
        session = RunSession(config, registry, algorithm=algorithm, console=Console(quiet=quiet))
        try:
            session.start_policy_only()
            session.policy.load_checkpoint(str(step.resolve() / POLICY_CHECKPOINT))
            # Exported next to OUT and moved in: OUT never holds a half-written export.
            with _filled(out) as tmp:
                _export(session.policy, tmp, lora, config)
                refuse_nonfinite_export(tmp, step)
        finally:
            session.close()
    return out


def _check_lora_export(lora: str, config: Any, step: Path) -> None:
    """Refuse ``--lora`` values that ``config``'s policy cannot give (said before any worker
    starts)."""
    from nrl_core.errors import ConfigError
    from nrl_core.weight_sync.adapters import policy_lora_rank

    if lora not in LORA_EXPORTS:
        raise ConfigError(f"--lora {lora} is not one of {', '.join(LORA_EXPORTS)}")
    if lora == "adapters" and policy_lora_rank(config) <= 0:
        backend = config.policy.backend
        raise ConfigError(
            f"--lora adapters: {step} is a policy without LoRA (policy.{backend}.lora_rank is "
            "0), so it has no adapters to export; drop --lora to convert the full model"
        )


def _export(policy: Any, folder: Path, lora: str, config: Any) -> None:
    """Write the loaded ``policy`` (a :class:`~nrl_core.policy.Policy`) into ``folder``: its
    ``export_hf``, or with ``lora="adapters"`` its adapters as a PEFT folder, from the
    workers' ``lora_adapter_tensors()`` (a collective: every rank takes part; rank 0's full
    tensors are written) and ``lora_adapter(version)`` (the settings)."""
    if lora != "adapters":
        policy.export_hf(str(folder))
        return
    from nrl_core.testing.tiny import resolve_model_name
    from nrl_core.weight_sync.adapters import write_peft_folder

    policy.onload()
    tensors = policy.group.run_all("lora_adapter_tensors")[0]
    # A version is what engines cache adapters by; a folder on disk has none of its own.
    adapter = policy.group.run_one(0, "lora_adapter", 1)
    base_model = resolve_model_name(config.policy.model_name)
    write_peft_folder(folder, tensors, adapter, base_model=base_model)


@contextlib.contextmanager
def _filled(out: Path) -> Iterator[Path]:
    """:func:`nrl_core.atomic.fill_dir`, with a name clash against the user's own entries
    (possible with ``--overwrite`` only) said in one line."""
    from nrl_core import atomic
    from nrl_core.errors import ConfigError

    try:
        with atomic.fill_dir(out) as tmp:
            yield tmp
    except atomic.EntryConflict as exc:
        raise ConfigError(
            f"nothing written to OUT_DIR {out}: {exc}; move it aside or choose another OUT_DIR"
        ) from None


def _check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that convert would have to write over (the user's files): a file, a
    folder that holds anything, or a symbolic link, unless ``overwrite`` (then only a link to
    something other than a folder, a file, or the file system root is refused). Checked with
    ``lstat``: a link is never followed into its target to decide."""
    import os

    from nrl_core.errors import ConfigError

    if out.is_symlink():
        target = os.readlink(out)
        if not overwrite:
            raise ConfigError(
                f"OUT_DIR {out} is a symbolic link (to {target}); name a new or empty folder, "
                "or pass --overwrite to write into the folder it points to (only convert's own "
                "files are replaced)"
            )
        if not out.is_dir():
            raise ConfigError(
                f"OUT_DIR {out} is a symbolic link to {target}, which is not a folder; name a "
                "new or empty folder"
            )
        return
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"OUT_DIR {out} is a file; name a new or empty folder")
    resolved = out.resolve()
    if resolved.parent == resolved:
        raise ConfigError(f"OUT_DIR {out} is the file system root; name a new or empty folder")
    try:
        with os.scandir(out) as entries:
            names = sorted(entry.name for entry in entries)
    except OSError as exc:
        raise ConfigError(
            f"cannot list OUT_DIR {out} ({exc.strerror or exc}); name a new or empty folder"
        ) from None
    if names and not overwrite:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"OUT_DIR {out} is not empty (it holds {shown}); name a new or empty folder, or "
            "pass --overwrite to replace only the files convert writes (nothing else there is "
            "removed)"
        )


def _check_writable(out: Path) -> None:
    """A :class:`~nrl_core.errors.ConfigError` when ``out``'s parent folder cannot be created
    or written (read-only, a file in the way): said before the checkpoint is loaded."""
    import os
    import tempfile

    from nrl_core.errors import ConfigError

    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".nrl-write-check-", dir=parent))
    except OSError as exc:
        raise ConfigError(
            f"cannot write {out} ({exc.strerror or exc}); choose an OUT_DIR in a writable folder"
        ) from None


def _warn_dropped_settings(step: Path) -> None:
    """One stderr line naming the interpreter settings the checkpoint's config carried and
    that were not used (:func:`nrl_core.checkpoint.checkpoint_config_data`)."""
    import sys

    from nrl_core.checkpoint import CHECKPOINT_CONFIG, checkpoint_config_data

    _, _, dropped = checkpoint_config_data(step)
    if dropped:
        print(
            f"warning: ignoring {', '.join(dropped)} from {step / CHECKPOINT_CONFIG} (a "
            "checkpoint never chooses what runs); if the policy needs another interpreter, "
            "set $NRL_ACTOR_ENV or pass your own --config",
            file=sys.stderr,
        )


def loads_in_process(fmt: str, spec: Any, options: Any) -> bool:
    """Whether one worker of policy ``spec`` built in this process can load and export a
    checkpoint of format ``fmt``: the format reshards (``torch_dcp``), no launcher set up a
    process group for this process (``WORLD_SIZE``), the extras the policy registers are
    installed here, the modules its ``options`` need (``required_modules()``, e.g. ``peft``
    for LoRA) import here, and so does its worker class."""
    import importlib.util
    import os

    from nrl_core.cli.doctor import extra_requirements, missing_requirements
    from nrl_core.errors import ComponentLoadError

    if fmt != "torch_dcp" or "WORLD_SIZE" in os.environ or spec.distribution is None:
        return False
    for extra in spec.extras:
        if missing_requirements(extra_requirements(spec.distribution, extra)):
            return False
    required = getattr(options, "required_modules", None)
    if callable(required) and any(importlib.util.find_spec(m) is None for m in required()):
        return False
    try:
        spec.load()
    except ComponentLoadError:
        return False
    return True


def _export_in_process(
    spec: Any, config: Any, checkpoint: Path, out: Path, lora: str = "merged"
) -> None:
    """Load ``checkpoint`` into one worker of ``spec`` built here and write ``out`` with its
    ``export_hf`` (or its adapters, ``lora="adapters"``): the calls the Ray path makes,
    through the same policy facade."""
    import warnings

    from nrl_core.checkpoint import refuse_nonfinite_export
    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    # The worker reads the DCP folder through nrl_core.safe_pickle.dcp_load (load_checkpoint):
    # nothing in it can run code, whichever path loads it.
    worker = spec.load()(config.policy.options_for(), ComponentContext(config, seed=config.seed))
    policy = Policy.from_config(InProcessGroup(worker, name="policy"), config.policy)
    try:
        with warnings.catch_warnings():
            # DCP says it assumes a single-process load: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            policy.load_checkpoint(str(checkpoint.resolve()))
        with _filled(out) as tmp:
            _export(policy, tmp, lora, config)
            refuse_nonfinite_export(tmp, checkpoint.parent)
    finally:
        policy.shutdown()
