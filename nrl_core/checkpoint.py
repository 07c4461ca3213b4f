"""Step checkpoints: writing, verifying, finding and reading them.

Layout of one checkpoint, ``<checkpoint_dir>/step_N/``::

    policy/             the policy plugin's own files (torch DCP, or one rank{N}.pt per rank)
    config.yaml         the resolved run config: the checkpoint describes itself
    trainer_state.json  step, data-stream position, RNG states (JSON: it cannot carry code)
    manifest.json       every other file's size and SHA-256; written last

The folder is filled under a temporary name and renamed into place once the manifest is
written, so a crash never leaves a ``step_N`` that resume could pick half-written. Resume
verifies the manifest and falls back to the newest checkpoint that passes, saying which it
skipped and why. Everything that reads checkpoints (resume, ``nrl convert``, ``nrl eval``) uses
the functions here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from nrl_core import atomic
from nrl_core.errors import ConfigError

STEP_PATTERN = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
POLICY_CHECKPOINT = "policy"
"""The sub-folder holding the policy plugin's own checkpoint files."""
CRITIC_CHECKPOINT = "critic"
"""The sub-folder holding a PPO critic's checkpoint (its backend's files, optimizer included)."""
CHECKPOINT_CONFIG = "config.yaml"
"""The resolved run config, saved inside every checkpoint folder."""
MEGATRON_RANK_FILE = "rank{}.pt"
"""The megatron policy's per-rank checkpoint file (``MegatronPolicyWorker.save_checkpoint``)."""
MANIFEST_FORMAT = 1
_HASH_CHUNK = 1 << 20


def step_of(path: Path) -> int | None:
    match = STEP_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


# -- manifest -------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _digests(folder: Path, names: Iterable[str]) -> dict[str, str]:
    names = list(names)
    # hashlib releases the GIL on large buffers: shards hash in parallel.
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _sha256(folder / n), names), strict=True))


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file in ``folder`` in its ``manifest.json``."""
    names = _files(folder)
    digests = _digests(folder, names)
    files = {n: {"size": (folder / n).stat().st_size, "sha256": digests[n]} for n in names}
    atomic.write_text(
        folder / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1)
    )


def verify(folder: Path) -> str | None:
    """What is wrong with checkpoint ``folder`` (a missing, resized or changed file, an
    unreadable manifest or trainer state), or ``None`` when it is intact.

    A checkpoint without ``manifest.json`` (written before manifests existed, or its manifest
    deleted) is checked for a readable trainer state and policy files only, without sizes or
    hashes; when it passes, a warning naming it says so (once per folder and process).
    """
    manifest_path = folder / MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
            expected = {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{MANIFEST} is unreadable ({exc})"
        except RecursionError:
            return f"{MANIFEST} is unreadable (nested too deeply)"
        for name in expected:
            if Path(name).is_absolute() or ".." in Path(name).parts:
                return f"{MANIFEST} names {name!r}, outside the checkpoint folder"
    link = _symlink_in(folder)
    if link is not None:
        return (
            f"{link} is a symbolic link; a checkpoint's files are read only from inside its "
            "folder (copy the files in instead)"
        )
    if manifest_path.is_file():
        for name, (size, _) in expected.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        actual = _digests(folder, expected)
        for name, (_, digest) in expected.items():
            if actual[name] != digest:
                return f"{name} does not match its SHA-256 in the manifest"
    try:
        read_state(folder)
    except ConfigError as exc:
        return str(exc)
    unsafe = unsafe_torch_file(folder / POLICY_CHECKPOINT)
    if unsafe is not None:
        return unsafe
    try:
        bad = nonfinite_dcp_tensor(folder / POLICY_CHECKPOINT)
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:  # a shard cut short or damaged (DCP's CheckpointException, ...)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{POLICY_CHECKPOINT}/ cannot be read ({type(exc).__name__}: {first[:200]})"
    if bad is not None:
        return f"{POLICY_CHECKPOINT}/ holds non-finite values (NaN or infinity in {bad})"
    if not manifest_path.is_file():
        _warn_unverified(folder)
    return None


_WARNED_UNVERIFIED: set[Path] = set()


def _warn_unverified(folder: Path) -> None:
    """Say (once per folder) that a checkpoint without its manifest was used unverified: a
    deleted ``manifest.json`` must not switch verification off in silence."""
    import sys

    key = folder.absolute()
    if key in _WARNED_UNVERIFIED:
        return
    _WARNED_UNVERIFIED.add(key)
    print(
        f"warning: checkpoint {folder} has no {MANIFEST}, so its files' sizes and SHA-256 "
        "cannot be checked (written before manifests, or the manifest was deleted); using it "
        "unverified",
        file=sys.stderr,
    )


def unsafe_torch_file(policy: Path) -> str | None:
    """What is wrong with the first ``*.pt`` file of ``policy`` (the per-rank scheduler/RNG
    states, megatron's ``rank{N}.pt`` and optimizer files) that does not load as plain data
    with ``torch.load(weights_only=True)``, or ``None``: a planted pickle is refused here,
    before any worker or Ray starts. Memory-mapped, so the tensors' bytes are not read."""
    if not policy.is_dir():
        return None
    from nrl_core.safe_pickle import UnsafePickleError, torch_load_data

    for path in sorted(policy.rglob("*.pt")):
        try:
            torch_load_data(path, mmap=True, map_location="cpu")
        except UnsafePickleError as exc:
            return str(exc)
    return None


_SCAN_BYTES = 256 << 20
"""Tensors read at once when scanning a checkpoint for non-finite values (bounds memory)."""


def nonfinite_dcp_tensor(policy: Path) -> str | None:
    """The first floating-point tensor of the torch.distributed.checkpoint folder ``policy``
    that holds a NaN or an infinity (its name), or ``None``: ``None`` too for another format
    (megatron's ``rank{N}.pt``: not scanned). Read in groups of at most 256 MiB, through
    :func:`nrl_core.safe_pickle.dcp_load` (nothing in the folder can run code)."""
    import warnings

    if not (policy / ".metadata").is_file():
        return None
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from nrl_core.safe_pickle import dcp_load, load_dcp_metadata

    tensors = [
        (name, meta)
        for name, meta in load_dcp_metadata(policy).state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and meta.properties.dtype.is_floating_point
    ]
    group: dict[str, Any] = {}
    size = 0
    for index, (name, meta) in enumerate(tensors):
        group[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        size += group[name].numel() * group[name].element_size()
        if size < _SCAN_BYTES and index + 1 < len(tensors):
            continue
        with warnings.catch_warnings():
            # DCP says it assumes a single-process load: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(group, policy)
        for key, tensor in group.items():
            if not bool(torch.isfinite(tensor).all()):
                return key
        group, size = {}, 0
    return None


def _symlink_in(folder: Path) -> str | None:
    """The first symbolic link inside ``folder`` (a file or a folder, not followed), relative
    to it, or ``None``."""
    for root, dirs, files in os.walk(folder):
        for name in sorted([*dirs, *files]):
            path = Path(root) / name
            if path.is_symlink():
                return str(path.relative_to(folder))
    return None


MAX_TRAINER_STATE_BYTES = 4 << 20
"""Largest ``trainer_state.json`` read (4 MiB). nrl writes about 60 KB (the step, the data
stream's counters, the Python and torch RNG states); a larger file is not nrl's, and is
refused before it is read."""
TRAINER_STATE_KEYS = frozenset({"step", "data", "rng", "val"})
"""The keys of a trainer state (:meth:`CheckpointManager.save` and
:meth:`~nrl_core.algorithms.session.run_folder.RunFolder.save_checkpoint` write them)."""
_RNG_KEYS = frozenset({"python", "torch"})


def read_state(folder: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``folder``; a :class:`ConfigError` when it is missing,
    over :data:`MAX_TRAINER_STATE_BYTES`, or not a JSON object with an integer ``step`` and
    only the :data:`TRAINER_STATE_KEYS`."""
    path = folder / TRAINER_STATE
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_TRAINER_STATE_BYTES:
                raise ConfigError(
                    f"{path} is {size >> 20} MiB, over the {MAX_TRAINER_STATE_BYTES >> 20} MiB "
                    "a trainer state may be (nrl writes about 60 KB); it was not written by nrl"
                )
            raw = handle.read(MAX_TRAINER_STATE_BYTES + 1)  # a file still growing: bounded
        if len(raw) > MAX_TRAINER_STATE_BYTES:
            raise ConfigError(f"{path} is over {MAX_TRAINER_STATE_BYTES >> 20} MiB; not nrl's")
        state = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path} is not a trainer state (JSON nested too deeply)") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{path} holds no integer `step` >= 0")
    problem = _state_problem(state)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}; it was not written by nrl")
    return state


def finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (a metric a checkpoint can record)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _counters(value: Any) -> bool:
    """A data-stream position: integers >= 0, in objects keyed by names (nested for several
    tasks)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _counters(v) for k, v in value.items())
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _state_problem(state: dict[str, Any]) -> str | None:
    """What is malformed in a trainer state's ``data`` and ``rng`` (the shapes
    :meth:`~nrl_core.algorithms.runtime.RunSession.save_checkpoint` writes), or ``None``."""
    unknown = sorted(set(state) - TRAINER_STATE_KEYS)
    if unknown:
        return f"unknown key {unknown[0]!r} (a trainer state holds {', '.join(sorted(TRAINER_STATE_KEYS))})"
    data = state.get("data")
    if data is not None and not (isinstance(data, dict) and _counters(data)):
        return "`data` must be the data stream's position (integers >= 0)"
    val = state.get("val")
    if val is not None and not (
        isinstance(val, dict) and all(isinstance(k, str) and finite(v) for k, v in val.items())
    ):
        return "`val` must map validation metric names to finite numbers"
    rng = state.get("rng")
    if rng is None:
        return None
    if not isinstance(rng, dict):
        return "`rng` must be an object"
    unknown = sorted(set(rng) - _RNG_KEYS)
    if unknown:
        return f"unknown key 'rng.{unknown[0]}' (`rng` holds python, torch)"
    python = rng.get("python")
    if python is not None and not (
        isinstance(python, list)
        and len(python) == 3
        and isinstance(python[0], int)
        and isinstance(python[1], list)
        and len(python[1]) == 625
        and all(isinstance(i, int) and 0 <= i < 2**32 for i in python[1])
        and (python[2] is None or isinstance(python[2], float))
    ):
        return "`rng.python` is not a Python random state ([version, 625 integers, gauss])"
    torch_state = rng.get("torch")
    if torch_state is not None and not (
        isinstance(torch_state, list)
        and all(isinstance(i, int) and 0 <= i < 256 for i in torch_state)
    ):
        return "`rng.torch` is not a torch RNG state (a list of bytes)"
    return None


# -- the checkpoints of one run -------------------------------------------------------------


@attrs.frozen
class ResumePoint:
    """Where a run resumes: ``path`` (``None``: start fresh) and the newer checkpoints that
    failed verification, as ``(folder, problem)``."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...] = ()


class CheckpointManager:
    """Writes, finds, verifies, ranks and prunes the step checkpoints of one run.

    Args:
        root: the checkpoint folder (``checkpointing.checkpoint_dir``).
        keep_last: keep only the newest N complete checkpoints (None keeps all; >= 1), and
            besides them the :meth:`best`.
        metric: the validation metric that ranks checkpoints (``checkpointing.metric_name``,
            recorded in the trainer state of a checkpoint saved at a validation step); None
            ranks by age only.
        higher_is_better: the direction of ``metric``.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int | None = None,
        metric: str | None = None,
        higher_is_better: bool = True,
    ) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.metric = metric
        self.higher_is_better = higher_is_better

    def complete(self) -> list[Path]:
        """Checkpoints that were renamed into place (not yet verified), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if step_of(p) is not None and is_step_folder(p)]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, unverified (cheap: for summaries)."""
        complete = self.complete()
        return complete[-1] if complete else None

    def scores(self) -> list[tuple[Path, float]]:
        """``(checkpoint, its metric)`` of the complete checkpoints that recorded
        :attr:`metric`, oldest first (none without a metric; an unreadable trainer state
        counts as unscored: :func:`verify` reports it where it matters)."""
        if self.metric is None:
            return []
        scored = []
        for folder in self.complete():
            try:
                value = (read_state(folder).get("val") or {}).get(self.metric)
            except ConfigError:
                continue
            if value is not None:
                scored.append((folder, float(value)))
        return scored

    def best(self) -> tuple[Path, float] | None:
        """The checkpoint with the best :attr:`metric` and its value (the newest of equals),
        or None when none recorded it."""
        scored = self.scores()
        if not scored:
            return None
        sign = 1.0 if self.higher_is_better else -1.0
        # max() keeps the first of equals: scan newest first so the newest of equals wins.
        return max(reversed(scored), key=lambda item: sign * item[1])

    def newest_good(self) -> ResumePoint:
        """The newest checkpoint that passes :func:`verify`, and the newer ones that failed."""
        skipped = []
        for folder in reversed(self.complete()):
            problem = verify(folder)
            if problem is None:
                return ResumePoint(folder, tuple(skipped))
            skipped.append((folder, problem))
        return ResumePoint(None, tuple(skipped))

    def resume_from(self, resume: str) -> ResumePoint:
        """The checkpoint ``checkpointing.resume`` asks for: ``auto`` (the newest good one, or
        none), ``never``, or a path to a ``step_N`` folder (which must pass verification)."""
        if resume == "never":
            return ResumePoint(None)
        if resume == "auto":
            return self.newest_good()
        path = Path(resume)
        if not is_step_folder(path):
            raise ConfigError(
                f"checkpointing.resume={resume}: not a complete nrl checkpoint (no {MANIFEST}); "
                "use auto, never or a step_N folder"
            )
        problem = verify(path)
        if problem is not None:
            raise ConfigError(
                f"checkpointing.resume={resume} is damaged: {problem}; pick an older step_N "
                "folder, or checkpointing.resume=auto to take the newest intact one"
            )
        return ResumePoint(path)

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: ``write(folder)`` fills it, then the trainer state and
        the manifest are written and the folder renamed into place (replacing an older
        attempt at the same step). Returns the final folder."""
        final = self.root / f"step_{step}"
        with atomic.new_dir(final) as tmp:
            write(tmp)
            (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, **state}, indent=2))
            write_manifest(tmp)
        self._prune()
        return final

    def _prune(self) -> None:
        # Leftovers of this run's interrupted saves: the run folder lock makes them ours.
        for pattern in (".tmp_step_*", ".replaced_step_*"):
            for stale in self.root.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last is None:
            return
        best = self.best()
        for old in self.complete()[: -self.keep_last]:
            if best is not None and old == best[0]:
                continue  # the best by metric survives however old
            shutil.rmtree(old, ignore_errors=True)


# -- reading a checkpoint (resume, convert, eval) -------------------------------------------


def find_step_folder(
    path: str | Path, metric: str | None = None, higher_is_better: bool = True
) -> Path:
    """The checkpoint at ``path``: ``path`` itself (refused when damaged), its parent when
    ``path`` is the ``policy/`` folder inside one (the ``critic/`` folder is refused), or, in a checkpoint folder, the intact
    ``step_N`` with the best ``metric`` (saying so on stderr) or, without one that recorded
    it, the newest intact one (naming, on stderr, newer ones skipped as damaged)."""
    import sys

    path = Path(path)
    if metric is not None and not is_step_folder(path):
        best = CheckpointManager(path, metric=metric, higher_is_better=higher_is_better).best()
        if best is not None and verify(best[0]) is None:
            print(
                f"{best[0].name}: the best {metric} ({best[1]:.4g}) of the checkpoints in "
                f"{path} (checkpointing.metric_name; pass a step_N folder for another)",
                file=sys.stderr,
            )
            return best[0]
    if path.name == POLICY_CHECKPOINT and is_step_folder(path.parent):
        path = path.parent
    if path.name == CRITIC_CHECKPOINT and is_step_folder(path.parent):
        # Exporting or evaluating it as a policy would read a value head as an LM.
        raise ConfigError(
            f"{path} is a PPO critic (a value head, no language-model head), which nrl "
            f"exports and evaluates only as part of its run; pass {path.parent} for the policy"
        )
    if is_step_folder(path):
        problem = verify(path)
        if problem is not None:
            raise ConfigError(
                f"checkpoint {path} is damaged: {problem}; pass an older step_N folder, or the "
                "checkpoint folder to take its newest intact step"
            )
        return path
    point = CheckpointManager(path).newest_good()
    for folder, problem in point.skipped:
        print(f"warning: skipping damaged checkpoint {folder}: {problem}", file=sys.stderr)
    if point.path is not None:
        return point.path
    raise ConfigError(
        f"{path} is not an nrl checkpoint (no {MANIFEST} or {TRAINER_STATE}, and no intact "
        "step_N folder in it); pass a step_N folder written by `nrl run` (under the run "
        "folder's checkpoints/)"
    )


def is_step_folder(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (renamed into place: it has its manifest, or the
    trainer state of a checkpoint from before manifests)."""
    return (path / MANIFEST).is_file() or (path / TRAINER_STATE).is_file()


def detect_format(step: Path, backend: str) -> str:
    """The policy checkpoint format in ``step/policy``: ``torch_dcp`` (the dtensor policy's
    ``torch.distributed.checkpoint``) or ``megatron_rank`` (one ``rank{N}.pt`` per rank),
    checked against the config's ``policy.backend``."""
    folder = step / POLICY_CHECKPOINT
    found = None
    if (folder / ".metadata").is_file():
        found, expected = "torch_dcp", "dtensor"
        what = "a dtensor (torch.distributed.checkpoint)"
    elif (folder / MEGATRON_RANK_FILE.format(0)).is_file():
        found, expected = "megatron_rank", "megatron"
        what = "a megatron (rank{N}.pt)"
    if found is None:
        raise ConfigError(
            f"{folder} holds no known policy checkpoint (expected a torch.distributed.checkpoint "
            "`.metadata` file from the dtensor policy or rank0.pt from the megatron policy)"
        )
    if backend != expected:
        raise ConfigError(
            f"{folder} is {what} checkpoint but its config names policy.backend={backend}; pass "
            "the right run config with --config"
        )
    return found


def megatron_ranks(step: Path) -> int:
    """How many ranks wrote the megatron checkpoint in ``step`` (``rank0.pt`` .. contiguous)."""
    folder, ranks = step / POLICY_CHECKPOINT, 0
    while (folder / MEGATRON_RANK_FILE.format(ranks)).is_file():
        ranks += 1
    return ranks


def saved_algorithm(config_path: Path) -> tuple[str, dict[str, Any]]:
    """``(algorithm, raw mapping)`` of a saved run config: the algorithm is its one section
    named like an algorithm (``grpo``, ``sft``, ...)."""
    from nrl_core.config.loader import read_yaml
    from nrl_core.config.schema import ALGORITHM_CONFIGS

    raw = read_yaml(config_path)
    algorithms = [a for a in ALGORITHM_CONFIGS if a in raw]
    if len(algorithms) != 1:
        raise ConfigError(
            f"{config_path}: cannot tell the algorithm (expected exactly one of the sections "
            f"{', '.join(ALGORITHM_CONFIGS)})"
        )
    return algorithms[0], raw


RUNTIME_SECTIONS = ("cluster", "logger", "checkpointing", "server")
"""Sections of a saved config that say how and where a run ran, not what model it trained:
never taken from a checkpoint (this machine's defaults apply instead)."""
RUNTIME_KEYS = ("actor_env",)
"""Keys, at any depth of a saved config, that name something to execute (an interpreter, a
venv): never taken from a checkpoint."""


def _strip_runtime(data: Any, path: str, dropped: list[str]) -> Any:
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        name = f"{path}.{key}" if path else str(key)
        if key in RUNTIME_KEYS:
            if value not in (None, ""):
                dropped.append(f"{name}={value}")
            continue
        if not path and key in RUNTIME_SECTIONS:
            if isinstance(value, dict) and value.get("actor_env") not in (None, ""):
                dropped.append(f"{name}.actor_env={value['actor_env']}")
            continue
        kept[key] = _strip_runtime(value, name, dropped)
    return kept


def checkpoint_config_data(step: Path) -> tuple[str, dict[str, Any], list[str]]:
    """``(algorithm, mapping, dropped)`` of the config saved in checkpoint ``step``, read as
    data: without its ``defaults:`` (a saved config names no other file), without any
    :data:`RUNTIME_KEYS` (``actor_env`` of every section) and without the
    :data:`RUNTIME_SECTIONS`. ``dropped`` lists the executable settings it carried
    (``policy.actor_env=/path``), for a notice.

    A checkpoint is data that anyone may hand over; what runs (which interpreter, which venv,
    which cluster) is chosen by whoever runs nrl, never by a file inside the checkpoint."""
    from nrl_core.config.loader import DEFAULTS_KEY

    path = step / CHECKPOINT_CONFIG
    algorithm, raw = saved_algorithm(path)
    if DEFAULTS_KEY in raw:
        raise ConfigError(
            f"{path} names `{DEFAULTS_KEY}:` (other files); a checkpoint's config is the "
            "resolved run config and reads nothing else: pass the run's config with --config"
        )
    dropped: list[str] = []
    return algorithm, _strip_runtime(raw, "", dropped), dropped


def saved_config(step: Path, registry: Any, config_file: str | None = None) -> tuple[str, Any]:
    """``(algorithm, config)`` of the run that wrote ``step``, from the config saved in it
    (read as data, see :func:`checkpoint_config_data`: where and with what interpreter
    anything runs is left at this machine's defaults) or from ``config_file`` (the user's
    own file, taken whole)."""
    from nrl_core.config.loader import resolve_config

    path = Path(config_file) if config_file else step / CHECKPOINT_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{step} carries no {CHECKPOINT_CONFIG} (written by nrl since checkpoints became "
            "self-describing); pass the run's config with --config (the run directory's "
            "config.yaml)"
        )
    if config_file:
        algorithm, _ = saved_algorithm(path)
        return algorithm, resolve_config(algorithm, path, (), registry)
    algorithm, data, _ = checkpoint_config_data(step)
    return algorithm, resolve_config(algorithm, None, (), registry, defaults=data)


def check_same_run(step: Path, algorithm: str, model_name: str, resume: str = "auto") -> None:
    """Refuse to continue checkpoint ``step`` in a run of another algorithm or model: its
    saved config must name ``algorithm`` and ``policy.model_name`` (``resume`` is the
    ``checkpointing.resume`` value, for the message). Checkpoints without a saved config
    (older nrl) are not checked."""
    path = step / CHECKPOINT_CONFIG
    if not path.is_file():
        return
    saved, raw = saved_algorithm(path)
    policy = raw.get("policy") if isinstance(raw.get("policy"), dict) else {}
    saved_model = policy.get("model_name")
    if saved == algorithm and (saved_model is None or saved_model == model_name):
        return
    raise ConfigError(
        f"checkpointing.resume={resume} found {step}, written by `nrl run {saved}` with "
        f"policy.model_name={saved_model}, but this is `nrl run {algorithm}` with "
        f"policy.model_name={model_name}; give this run its own folder (logger.run_name=...), "
        "or start fresh here with checkpointing.resume=never"
    )


def nonfinite_weights(folder: Path) -> str | None:
    """The first tensor of a Hugging Face folder's ``*.safetensors`` files holding a NaN or an
    infinity (``"model.safetensors: lm_head.weight"``), or ``None`` when all are finite."""
    import torch
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensor = tensors.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return f"{path.name}: {name}"
    return None


def refuse_nonfinite_export(folder: Path, step: Path) -> None:
    """A :class:`ConfigError` when the model exported from checkpoint ``step`` into
    ``folder`` has non-finite weights: such a model only ever produces NaN."""
    found = nonfinite_weights(folder)
    if found is not None:
        raise ConfigError(
            f"checkpoint {step} holds non-finite weights (NaN or infinity in {found}); nothing "
            "was written: convert an earlier step_N folder"
        )
