"""Loading a run's samples through the registered dataset loaders, and drawing them in a
resumable, seeded order."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nrl_core.config.schema import DataConfig
from nrl_core.data import Sample
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.registry import Registry

JSONL_DATASET = "jsonl"
"""The registered dataset that reads ``data.dataset`` when it is a path to a JSONL file."""


def reading_dataset(name: str) -> str:
    """The registered dataset that reads ``data.dataset=name``: ``name`` itself,
    :data:`JSONL_DATASET` for a path to a ``.jsonl`` file, or ``<dataset>`` for
    ``<dataset>:<file>`` (that registered dataset reading that file, e.g.
    ``nemo_gym_jsonl:rows.jsonl``: several tasks may each read their own file with it)."""
    named = dataset_file(name)
    if named is not None:
        return named[0]
    return JSONL_DATASET if name.endswith(".jsonl") else name


def dataset_file(name: str) -> tuple[str, str] | None:
    """``(dataset, file)`` for ``<dataset>:<file>``, else None."""
    head, sep, tail = name.partition(":")
    if sep and tail and head.replace("_", "a").replace("-", "a").isalnum():
        return head, tail
    return None


# -- JSONL files ---------------------------------------------------------------------------------


SHIPPED_PREFIX = "nrl://"
"""Paths starting with this name files shipped inside the nrl_core package (the demo data,
``nrl://recipes/data/chat_train.jsonl``); nothing outside that package folder."""


def shipped_path(text: str, *, key: str = "", error: type[ConfigError] = ConfigError) -> Path:
    """The file that ``nrl://REL`` names inside the installed nrl_core package.

    ``REL`` is confined to the package folder: an absolute ``REL``, a ``..`` component, or a
    path that leaves the folder once resolved (a symbolic link) is ``error`` (a
    :class:`~nrl_core.errors.ConfigError`, exit 2), naming ``key`` when given. Checked on the
    name alone: nothing is opened.
    """
    from importlib import resources

    rel = text[len(SHIPPED_PREFIX) :]
    named = f"{key}={text}" if key else text
    root = Path(str(resources.files("nrl_core"))).resolve()
    parts = rel.replace("\\", "/").split("/")
    if not rel or rel.startswith(("/", "\\")) or ".." in parts or Path(rel).is_absolute():
        raise error(_outside_message(named))
    resolved = (root / rel).resolve()
    if not resolved.is_relative_to(root):
        raise error(_outside_message(named))
    return resolved


def _outside_message(named: str) -> str:
    return (
        f"{named}: an {SHIPPED_PREFIX} path names a file shipped inside nrl_core (e.g. "
        f"{SHIPPED_PREFIX}recipes/data/chat_train.jsonl), without '..' or a leading '/'; "
        "give a plain path for your own files"
    )


def not_a_regular_file(path: str | Path) -> str | None:
    """What ``path`` is when it is not a regular file ("a folder", "a FIFO (named pipe)", "a
    character device"...), or None for a regular file (symbolic links followed). Uses
    ``os.stat`` only, so a FIFO is never opened (opening one blocks until a writer comes).
    Raises ``OSError`` (``FileNotFoundError``...) when ``path`` cannot be looked up."""
    import os
    import stat

    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a file")


def read_jsonl_rows(
    path: str | Path, *, key: str = "", error: type[ConfigError] = ConfigError
) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a JSON Lines file as ``(where, row)`` pairs, ``where`` being ``file:line``.

    Every line is checked before any is used: a missing or empty file, a folder, bytes that
    are not UTF-8, a line that is not JSON, or a line that is not a JSON object (a list, a
    number...) is a :class:`~nrl_core.errors.ConfigError` naming the file and line, the
    expected shape, and ``key`` (the config key that named the file) when given; ``error``
    is the exception class raised (a loader's own subclass of ``ConfigError``). Blank lines
    are skipped.
    """
    path = Path(path)
    named = f" ({key})" if key else ""
    try:
        kind = not_a_regular_file(path)
    except OSError:
        kind = None  # missing or unreadable: said by the read below
    if kind == "a folder":
        raise error(f"data file {path}{named} is a folder; name a .jsonl file")
    if kind is not None:
        # A FIFO would block the read for ever, a device (/dev/zero) fill memory.
        raise error(f"data file {path}{named} is {kind}, not a regular file; name a .jsonl file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(
            f"data file {path}{named} does not exist; check the path in your data config"
        ) from None
    except OSError as exc:
        raise error(f"cannot read data file {path}{named}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); a JSONL data file "
            "holds one UTF-8 JSON object per line"
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys, parse_constant=_Constant)
        except _DuplicateKey as exc:
            raise error(
                f"{path}:{number}: duplicate key {exc.args[0]!r} in one object (JSON readers keep "
                "either value); keep one"
            ) from None
        except RecursionError:
            raise error(
                f"{path}:{number}: JSON nested too deeply; one flat object per line"
            ) from None
        except json.JSONDecodeError as exc:
            raise error(
                f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one JSON "
                'object, e.g. {"problem": "...", "answer": "..."}'
            ) from None
        except ValueError:  # Python's limit on the digits of an int read from text
            raise error(
                f"{path}:{number}: a number with more than {sys.get_int_max_str_digits()} digits; "
                'write it as a string ("answer": "123...")'
            ) from None
        if not isinstance(row, dict):
            raise error(
                f"{path}:{number}: expected a JSON object ({{...}}) per line, got {json_kind(row)}"
            )
        # NaN/Infinity (Python's json takes them) or an escaped lone surrogate may be in there:
        # the cheap test on the text first, the walk through the row only then.
        if "NaN" in line or "Infinity" in line or "\\ud" in line.lower():
            _check_values(row, f"{path}:{number}", error)
        rows.append((f"{path}:{number}", row))
    if not rows:
        raise error(f"data file {path}{named} is empty; it needs one JSON object per line")
    return rows


class _DuplicateKey(ValueError):
    pass


class _Constant:
    """Where a line held ``NaN``, ``Infinity`` or ``-Infinity`` (Python's json accepts them;
    JSON does not), kept so that the error can name the field."""

    def __init__(self, name: str) -> None:
        self.name = name


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return row


def _bad_value(value: Any) -> str | None:
    # What in `value` is not JSON text a model or tokenizer can take, in words (or None).
    if isinstance(value, _Constant):
        return f"{value.name}, which is not a JSON value"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = value[exc.start]
            return f"a lone surrogate (\\u{ord(char):04x}), which is not text"
        return None
    if isinstance(value, dict):
        items: Any = list(value.keys()) + list(value.values())
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        found = _bad_value(item)
        if found:
            return found
    return None


def _check_values(row: dict[str, Any], where: str, error: type[ConfigError]) -> None:
    for key, value in row.items():
        try:
            found = _bad_value(key) or _bad_value(value)
        except RecursionError:
            raise error(f"{where}: JSON nested too deeply; one flat object per line") from None
        if found:
            raise error(f"{where}: field {key!r} holds {found}; fix or drop that row")


def json_kind(value: Any) -> str:
    """How an error message names the JSON type of ``value`` ("an object", "a list", ...)."""
    kinds = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }
    return kinds.get(type(value), f"a number ({value})" if isinstance(value, int | float) else "?")


def require_text(
    row: dict[str, Any],
    field: str,
    where: str,
    fix: str = "",
    error: type[ConfigError] = ConfigError,
) -> str:
    """``row[field]``, which must be a string; otherwise ``error`` (a ``ConfigError``) naming
    ``where`` (``file:line``), the field and what it holds, and ``fix`` (how to point at
    another field)."""
    if field not in row:
        present = ", ".join(sorted(map(str, row))) or "none"
        raise error(
            f"{where}: no field {field!r} (fields: {present})" + (f"; {fix}" if fix else "")
        )
    value = row[field]
    if not isinstance(value, str):
        raise error(
            f"{where}: field {field!r} must be text (a JSON string), got {json_kind(value)}"
        )
    return value


def _loader(
    name: str, data: DataConfig, registry: Registry, context: ComponentContext, key: str
) -> Any:
    registered = reading_dataset(name)
    spec = registry.get("dataset", registered, key=key)
    if registered == name:
        options = data.options_or_defaults(name, spec)
    else:  # a file: the options of the dataset that reads it (data.<dataset>), with its path
        import attrs

        named = dataset_file(name)
        path = named[1] if named is not None else name
        options = data.options_for(registered)
        try:
            options = (
                attrs.evolve(options, path=path)
                if options is not None
                else spec.load_config_class()(path=path)
            )
        except TypeError:
            raise ConfigError(
                f"{key}={name}: dataset {registered!r} does not read a file (it has no `path` "
                "option); name a dataset that does, or the dataset alone"
            ) from None
    return spec.load()(options, context)


PromptFilter = Callable[[list[Sample], str], list[Sample]]
"""Called with a split's samples and its name (``"train"`` / ``"validation"``); returns those
kept (see :class:`PromptLengthFilter`)."""


def load_splits(
    data: DataConfig,
    registry: Registry,
    context: ComponentContext,
    *,
    prompt_filter: PromptFilter | None = None,
    key_prefix: str = "data.",
) -> tuple[list[Sample], list[Sample]]:
    """The train and validation samples of ``data``.

    Validation comes from ``data.val_dataset``, else from the dataset's own ``validation``
    split, else from a seeded ``data.val_fraction`` of the training samples.
    ``prompt_filter`` runs on each split after the hold-out (so which samples are held out
    does not depend on it) and before validation is cut to ``data.max_val_samples`` (so the
    validation set stays full when some prompts are dropped). The training split may come
    back empty then; the caller says why. ``key_prefix``: where ``dataset`` and
    ``val_dataset`` are in the config (for error messages; ``data.tasks[i].`` for a task).
    """
    loader = _loader(data.dataset, data, registry, context, f"{key_prefix}dataset")
    train = list(loader.load("train"))
    if not train:
        raise ConfigError(f"{key_prefix}dataset={data.dataset} has no training samples")
    if data.val_dataset:
        val = list(
            _loader(data.val_dataset, data, registry, context, f"{key_prefix}val_dataset").load(
                "validation"
            )
        )
    else:
        try:
            val = list(loader.load("validation"))
        except KeyError:
            order = list(range(len(train)))
            random.Random(context.seed).shuffle(order)
            cut = max(1, int(len(train) * data.val_fraction)) if data.val_fraction > 0 else 0
            val = [train[i] for i in order[:cut]]
            held = set(order[:cut])
            train = [s for i, s in enumerate(train) if i not in held]
    if prompt_filter is not None:
        train = prompt_filter(train, "train")
        val = prompt_filter(val, "validation")
    return train, val[: data.max_val_samples]


def load_task_splits(
    data: DataConfig,
    registry: Registry,
    context: ComponentContext,
    *,
    prompt_filter: PromptFilter | None = None,
) -> dict[str, tuple[list[Sample], list[Sample]]]:
    """``data.tasks``: each task's ``(train, validation)`` samples, loaded as
    :func:`load_splits` loads one dataset, every sample's ``task`` set to the task's name (which
    routes it to the task's environment or agent and names its metrics)."""
    import attrs

    names = [task.name for task in data.tasks]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(
                f"data.tasks has two tasks named {name!r}; give each task its own name"
            )
    out = {}
    for index, task in enumerate(data.tasks):
        view = attrs.evolve(data, dataset=task.dataset, val_dataset=task.val_dataset, tasks=[])
        train, val = load_splits(
            view, registry, context, prompt_filter=prompt_filter, key_prefix=f"data.tasks[{index}]."
        )
        out[task.name] = (
            [attrs.evolve(s, task=task.name) for s in train],
            [attrs.evolve(s, task=task.name) for s in val],
        )
    return out


def drop_overlong_prompts(
    samples: Sequence[Sample], prompt_lengths: Sequence[int], max_prompt_length: int
) -> tuple[list[Sample], int]:
    """``(kept, dropped)``: the samples whose prompt has at most ``max_prompt_length`` tokens,
    in order, and how many were dropped. ``prompt_lengths[i]`` is sample i's encoded length."""
    if len(samples) != len(prompt_lengths):
        raise ValueError(f"{len(samples)} samples but {len(prompt_lengths)} prompt lengths")
    kept = [
        sample
        for sample, length in zip(samples, prompt_lengths, strict=True)
        if length <= max_prompt_length
    ]
    return kept, len(samples) - len(kept)


class PromptLengthFilter:
    """Drops the prompts that leave too little room for a response, and counts them.

    A GRPO sequence is the prompt plus at most ``policy.max_total_sequence_length`` tokens in
    all; a prompt longer than that minus ``generation.max_new_tokens`` cannot get a full
    response, and one at or over the limit none at all. Such samples would only add truncated
    (or empty) responses, so they are dropped when the data is loaded.

    Args:
        prompt_lengths: the encoded prompt length of each sample (as the rollout encodes it).
        max_prompt_length: the longest prompt kept, in tokens (may be <= 0: nothing is kept).
    """

    def __init__(
        self, prompt_lengths: Callable[[Sequence[Sample]], list[int]], max_prompt_length: int
    ) -> None:
        self.prompt_lengths = prompt_lengths
        self.max_prompt_length = max_prompt_length
        self.dropped: dict[str, int] = {}
        """Prompts dropped per split name."""
        self.total: dict[str, int] = {}
        """Prompts seen per split name."""
        self.shortest: dict[str, int] = {}
        """The shortest prompt seen per split name (tokens), for the error message."""

    def __call__(self, samples: list[Sample], split: str) -> list[Sample]:
        lengths = self.prompt_lengths(samples)
        kept, dropped = drop_overlong_prompts(samples, lengths, self.max_prompt_length)
        self.dropped[split] = self.dropped.get(split, 0) + dropped
        self.total[split] = self.total.get(split, 0) + len(samples)
        if lengths:
            self.shortest[split] = min(self.shortest.get(split, lengths[0]), *lengths)
        return kept


class DataStream:
    """Draws training samples epoch by epoch in a seeded order; its position is resumable."""

    def __init__(self, samples: list[Sample], *, seed: int, shuffle: bool = True) -> None:
        self.samples = samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[Sample]:
        out = []
        while len(out) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._order_of(self.epoch)
            out.append(self.samples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)

    def rewind(self) -> None:
        """Back to the first sample of the first epoch."""
        self.load_state({"epoch": 0, "position": 0})


class MixedStream:
    """Draws from several tasks' streams in proportion to their weights (``data.tasks``).

    Each draw picks a task with probabilities proportional to the weights, from a random
    stream seeded by the run seed and the draw's index, so the sequence of draws depends only
    on the seed and is exactly resumable (the state is the number of draws and each task's
    stream position).
    """

    def __init__(self, streams: dict[str, DataStream], weights: dict[str, float], *, seed: int):
        self.streams = streams
        self.names = list(streams)
        self.weights = [float(weights[name]) for name in self.names]
        self.seed = seed
        self.draws = 0

    def take(self, count: int) -> list[Sample]:
        out = []
        for _ in range(count):
            rng = random.Random(f"{self.seed}-mix-{self.draws}")
            name = rng.choices(self.names, self.weights)[0]
            out.extend(self.streams[name].take(1))
            self.draws += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"draws": self.draws, "streams": {n: s.state() for n, s in self.streams.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        for name, stream_state in state["streams"].items():
            self.streams[name].load_state(stream_state)

    def rewind(self) -> None:
        self.draws = 0
        for stream in self.streams.values():
            stream.rewind()
