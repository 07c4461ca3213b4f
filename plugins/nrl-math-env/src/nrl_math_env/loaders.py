"""Math datasets: JSONL files, the shipped word problems, and Hugging Face hub datasets.

Every loader is ``rows -> samples``: it reads raw rows (a JSONL file, or the hub through the
`datasets` library) and maps each with ``to_sample(row)``, which is plain Python and testable on
rows built by hand. Validation splits that a source lacks are held out from its training rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from nrl_core.config.schema import DataConfig
from nrl_core.data import Sample
from nrl_core.datasets import read_jsonl_rows, require_text
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_math_env.config import HFDatasetConfig, JsonlDataConfig, WordProblemsDataConfig

T = TypeVar("T")


class DataFileError(ConfigError):
    """A data file is missing or malformed (exit code 2: the user fixes the file or the key)."""


class DatasetUnavailableError(ConfigError):
    """A hub dataset cannot be loaded (no `datasets` library, or no hub)."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSON Lines file (blank lines skipped); every line is checked to be a
    JSON object first (see :func:`nrl_core.datasets.read_jsonl_rows`)."""
    return [row for _, row in read_jsonl_rows(path, error=DataFileError)]


def hold_out(items: list[T], split: str, fraction: float) -> list[T]:
    """The ``train`` or ``validation`` part of ``items``, validation being ``fraction`` of them.

    The held-out items are chosen by a fixed shuffle (the same for every run seed, so runs stay
    comparable) and both parts keep the original order. Raises ``KeyError`` for a validation
    split when ``fraction`` is 0, as a dataset without that split does.
    """
    if split not in ("train", "validation") or (split == "validation" and fraction <= 0):
        raise KeyError(split)
    size = min(len(items) - 1, max(1, round(len(items) * fraction))) if fraction > 0 else 0
    held_out = set(random.Random("validation-split").sample(range(len(items)), max(size, 0)))
    return [item for i, item in enumerate(items) if (i in held_out) == (split == "validation")]


def local_split(
    samples_of: Callable[[str], list[T]], path: str, split: str, data: DataConfig
) -> list[T]:
    """``split`` of a local file: with ``data.val_dataset`` set, the training file or that
    file whole; otherwise the training file's part (see :func:`hold_out`)."""
    if data.val_dataset:
        return samples_of({"train": path, "validation": data.val_dataset}[split])
    return hold_out(samples_of(path), split, data.val_fraction)


def make_sample(problem: str, answer: Any, template: str, task: str = "math", **metadata) -> Sample:
    """A one-message sample: ``template`` with ``{problem}`` replaced, the answer as a string.

    ``{problem}`` is substituted with ``str.replace`` rather than ``str.format`` so that LaTeX
    braces (``\\boxed{}``) in templates need no escaping. The raw problem stays in metadata.
    """
    content = template.replace("{problem}", problem)
    return Sample(
        messages=[{"role": "user", "content": content}],
        answer=str(answer).strip(),
        task=task,
        metadata={"problem": problem, **metadata},
    )


def _data_section(context: ComponentContext) -> DataConfig:
    return getattr(context.config, "data", None) or DataConfig()


class JsonlDataset:
    """The ``jsonl`` dataset: one JSON object per line, with a problem and an answer field.

    Validation comes from ``data.val_dataset`` when it names a file, else it is a
    ``data.val_fraction`` share of the file (see :func:`hold_out`).
    """

    def __init__(self, options: JsonlDataConfig, context: ComponentContext) -> None:
        self.options = options
        self.data = _data_section(context)

    def path(self) -> str:
        """The training file: ``options.path``, else ``data.dataset`` when it is a path."""
        path = self.options.path or self.data.dataset
        if not path or path == "jsonl":
            raise DataFileError("the jsonl dataset needs a file: set data.jsonl.path")
        return path

    def load(self, split: str) -> list[Sample]:
        """The samples of ``split`` (``train`` or ``validation``)."""
        return local_split(self._samples, self.path(), split, self.data)

    def _samples(self, path: str | Path) -> list[Sample]:
        o = self.options
        fix = "set data.jsonl.problem_field / answer_field to the file's field names"
        samples = []
        for where, row in read_jsonl_rows(path, error=DataFileError):
            problem = require_text(row, o.problem_field, where, fix, DataFileError)
            if not problem.strip():
                raise DataFileError(
                    f"{where}: field {o.problem_field!r} is blank; every row needs a problem"
                )
            if o.answer_field not in row:
                require_text(
                    row, o.answer_field, where, fix, DataFileError
                )  # raises: names the fields
            answer = row[o.answer_field]
            # bool is an int to Python, and JSON's true/false is no answer a verifier can match.
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise DataFileError(
                    f"{where}: field {o.answer_field!r} must be text or a number, got "
                    f"{row[o.answer_field]!r:.60}"
                )
            samples.append(self.to_sample(row))
        return samples

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """One row as a sample: its problem and answer fields, any others kept as metadata."""
        o = self.options
        extra = {k: v for k, v in row.items() if k not in (o.problem_field, o.answer_field)}
        return make_sample(
            row[o.problem_field], row[o.answer_field], o.prompt_template, o.task, **extra
        )


WORD_PROBLEMS_FILE = resources.files("nrl_math_env") / "data" / "word_problems.jsonl"
"""The shipped generated word problems (see :mod:`nrl_math_env.word_problems`)."""


class WordProblemsDataset(JsonlDataset):
    """The ``word_problems`` dataset: 400 generated grade-school word problems shipped in the
    package (no network needed), split like a JSONL file."""

    def __init__(self, options: WordProblemsDataConfig, context: ComponentContext) -> None:
        super().__init__(JsonlDataConfig(prompt_template=options.prompt_template), context)

    def path(self) -> str:
        """The shipped file."""
        return str(WORD_PROBLEMS_FILE)


class HubDataset:
    """Base of the Hugging Face hub datasets: ``rows(split)`` then ``to_sample(row)``.

    Rows come from ``options.path`` (a JSONL file of the dataset's rows in their hub format,
    split like the ``jsonl`` dataset) or from the hub. Identical problems are kept once (some
    sets hold several solutions per problem); a validation split the hub lacks is held out from
    the training split after that, so no problem is in both.
    """

    name: ClassVar[str]
    """The dataset's registered name, quoted in errors (``data.<name>.path``)."""
    hub_name: ClassVar[str]
    hub_subset: ClassVar[str | None] = None
    hub_splits: ClassVar[dict[str, str]]
    """Our split -> the hub's; a missing ``validation`` is held out from ``train``."""

    def __init__(self, options: HFDatasetConfig, context: ComponentContext) -> None:
        self.options = options
        self.data = _data_section(context)

    def load(self, split: str) -> list[Sample]:
        """The samples of ``split`` (``train`` or ``validation``)."""
        if self.options.path:
            samples = local_split(
                lambda path: self._samples(read_jsonl(path)), self.options.path, split, self.data
            )
        elif split in self.hub_splits and "validation" in self.hub_splits:
            samples = self._samples(self.hub_rows(self.hub_splits[split]))
        elif "train" in self.hub_splits:  # no validation on the hub: hold it out of train
            rows = self.hub_rows(self.hub_splits["train"])
            samples = hold_out(self._samples(rows), split, self.data.val_fraction)
        else:
            raise KeyError(split)
        return samples[: self.options.max_samples]

    def _samples(self, rows: list[dict[str, Any]]) -> list[Sample]:
        unique: dict[str, Sample] = {}
        for row in rows:
            sample = self.to_sample(row)
            unique.setdefault(sample.messages[0]["content"], sample)
        return list(unique.values())

    def hub_rows(self, hub_split: str) -> list[dict[str, Any]]:
        """The rows of one hub split, through the `datasets` library."""
        fix = (
            f"download {self.hub_name} and set data.{self.name}.path to a JSONL file of its rows "
            "(or convert it to problem/answer JSONL and use data.dataset=jsonl)"
        )
        try:
            import datasets
        except ImportError:
            raise DatasetUnavailableError(
                f"data.{self.name}: the `datasets` library is not installed; install "
                f"nrl-math-env[hf], or {fix}"
            ) from None
        try:
            return list(datasets.load_dataset(self.hub_name, self.hub_subset, split=hub_split))
        except Exception as exc:
            raise DatasetUnavailableError(
                f"data.{self.name}: cannot load {self.hub_name} from the Hugging Face hub "
                f"({type(exc).__name__}: {exc}); if the hub is unreachable, {fix}"
            ) from exc

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """One hub row as a sample."""
        raise NotImplementedError


class GSM8KDataset(HubDataset):
    """``gsm8k``: openai/gsm8k (main); the answer is the number after ``####`` in the
    solution, without thousands separators. Validation is the hub's test split."""

    name = "gsm8k"
    hub_name, hub_subset = "openai/gsm8k", "main"
    hub_splits = {"train": "train", "validation": "test"}

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """``question`` -> problem; ``answer``'s ``#### 72`` -> answer ``72``."""
        answer = row["answer"].rpartition("####")[2].strip().replace(",", "")
        return make_sample(row["question"], answer, self.options.prompt_template)


class Math500Dataset(HubDataset):
    """``math500``: HuggingFaceH4/MATH-500, a test set: it has a validation split only."""

    name = "math500"
    hub_name = "HuggingFaceH4/MATH-500"
    hub_splits = {"validation": "test"}

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """``problem``/``answer`` (LaTeX); ``subject``, ``level`` and ``unique_id`` as metadata."""
        extra = {k: row[k] for k in ("subject", "level", "unique_id") if k in row}
        return make_sample(row["problem"], row["answer"], self.options.prompt_template, **extra)


class OpenMathInstruct2Dataset(HubDataset):
    """``openmathinstruct2``: nvidia/OpenMathInstruct-2, its ``train_1M`` split (one row per
    generated solution; problems are kept once)."""

    name = "openmathinstruct2"
    hub_name = "nvidia/OpenMathInstruct-2"
    hub_splits = {"train": "train_1M"}

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """``problem``/``expected_answer``; ``problem_source`` as metadata."""
        return make_sample(
            row["problem"],
            row["expected_answer"],
            self.options.prompt_template,
            problem_source=row.get("problem_source"),
        )


DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


class DapoMath17kDataset(HubDataset):
    """``dapo_math_17k``: BytedTsinghua-SIA/DAPO-Math-17k. Its rows hold a ready chat prompt
    with DAPO's "Answer:" instruction; that instruction is removed so that the problem gets
    ``prompt_template`` like every other math set. Each problem appears many times in the hub
    rows and is kept once."""

    name = "dapo_math_17k"
    hub_name = "BytedTsinghua-SIA/DAPO-Math-17k"
    hub_splits = {"train": "train"}

    def to_sample(self, row: dict[str, Any]) -> Sample:
        """``prompt[-1].content`` without DAPO's instruction; ``reward_model.ground_truth``."""
        problem = row["prompt"][-1]["content"].removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX)
        answer = row["reward_model"]["ground_truth"]
        return make_sample(problem.strip(), answer, self.options.prompt_template)
