"""Your own GRPO prompts: the ``prompts`` dataset (``data.dataset: prompts``).

Rows come from a local JSONL file or a Hugging Face dataset (hub name or ``save_to_disk``
folder, read with the `datasets` library), exactly as for the core's ``chat`` and
``preference`` datasets (:mod:`nrl_core.chat_data`, whose row reader this module shares). Each
row becomes one :class:`~nrl_core.data.Sample`:

* ``messages``: the row's ``prompt_field``. Text becomes one user message (wrapped in
  ``prompt_template`` when one is set; nothing is added otherwise); a list of chat messages is
  used as is, after checking every role and content.
* ``answer``: the row's ``answer_field`` (any JSON value), or ``None`` when the row has none.
* ``task``: ``task`` (default ``prompts``; ``data.tasks`` replaces it with the task's name).
* ``metadata``: every other column under its own name. The core hands the environment
  ``{**metadata, "answer": answer, "task": task}`` at its first ``step``, so an environment
  reads ``metadata["my_column"]``. Those dicts travel to the environment's Ray actors (and to
  agents as JSON), so values must be JSON-like: text, numbers, booleans, null, lists and objects.

Unlike the math plugin's ``jsonl`` dataset (the one a ``data.dataset`` ending in ``.jsonl``
selects), nothing is hidden: no ``\\boxed{}`` instruction is added, and the task is not
``math``. Everything that shapes a prompt is an option under ``data.prompts`` that
``nrl config show`` lists.

A malformed row is a :class:`PromptDataError` (a ``ConfigError``: exit code 2) in one line
naming the row (``file:line``, or the Hugging Face split and row number), the field and the
option to set. A missing file or an unreadable hub dataset is the ``ChatDataError`` of
:mod:`nrl_core.chat_data` (also a ``ConfigError``).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from nrl_core.chat_data import ROLE_ALIASES, ChatDataError, split_rows
from nrl_core.config.schema import NON_EMPTY, Valid, each, ge, option, optional
from nrl_core.data import Message, Sample
from nrl_core.datasets import json_kind

NAME = "prompts"
"""The dataset's registered name (``data.dataset: prompts``; options under ``data.prompts``)."""

RESERVED_FIELDS = ("answer", "task")
"""Metadata keys the core sets itself when it hands a sample to its environment (see
:func:`nrl_core.algorithms.rollout.start_episodes`): a column of that name would be
overwritten, so it must be the answer field or be excluded."""

PROMPT_ROLES = ("system", "user", "assistant")
"""Roles a prompt's messages may have (ShareGPT names such as ``human`` / ``gpt`` are mapped
to these first, see :data:`nrl_core.chat_data.ROLE_ALIASES`)."""


class PromptDataError(ChatDataError):
    """A row of the ``prompts`` dataset is malformed, or its options do not fit the data (exit
    code 2: the user fixes the row or the option the message names)."""


def _template_ok(value: Any) -> bool:
    return isinstance(value, str) and "{prompt}" in value


@attrs.define
class PromptDataConfig:
    """Options of the ``prompts`` dataset (``data.prompts``): prompts for GRPO from a JSONL file
    or a Hugging Face dataset, with any extra columns handed to the environment.

    Validation comes from ``validation_path`` (JSONL) or ``validation_split`` (Hugging Face),
    else ``data.val_fraction`` of the training rows is held out (seeded by the run's seed).
    """

    path: str | None = option(
        None,
        "Training JSONL file (one prompt per line); `nrl://...` names a file shipped with "
        "nrl_core. Give this or `hf_dataset`, not both.",
    )
    validation_path: str | None = option(
        None,
        "Validation JSONL file (default: hold out `data.val_fraction` of the training rows). "
        "Use this rather than `data.val_dataset`, which reads a `.jsonl` with the math plugin's "
        "`jsonl` dataset.",
    )
    hf_dataset: str | None = option(
        None,
        "Hugging Face dataset name, or a local folder written by `DatasetDict.save_to_disk`, read "
        "with the `datasets` library (not a dependency of nrl-core: install it) instead of "
        "`path`.",
    )
    hf_subset: str | None = option(None, "Subset (configuration) name of `hf_dataset`.")
    train_split: str = option(
        "train", "Split of `hf_dataset` used for training.", validator=NON_EMPTY
    )
    validation_split: str | None = option(
        None,
        "Split of `hf_dataset` used for validation (default: held out of the training one).",
        validator=optional(NON_EMPTY),
    )
    prompt_field: str = option(
        "prompt",
        "Field of the prompt: text (one user message) or a list of chat messages "
        '(`[{"role": "system"|"user"|"assistant", "content": "..."}]`, used as is; the last may '
        "not be the assistant's).",
        validator=NON_EMPTY,
    )
    prompt_template: str | None = option(
        None,
        "Wraps a text prompt: `{prompt}` is replaced by the row's prompt (other braces are kept "
        "as they are). Unset: the prompt alone. Not applied to message-list prompts.",
        validator=optional(Valid("a string containing `{prompt}`", _template_ok)),
    )
    answer_field: str | None = option(
        "answer",
        "Field of the reference answer (any JSON value; the environment gets it as "
        "`metadata['answer']`). A row without it, or with null, has answer null; null here: "
        "the rows have no answer field.",
        validator=optional(NON_EMPTY),
    )
    require_answer: bool = option(
        False,
        "Refuse a row whose answer is missing or null (for environments that check answers, "
        "e.g. `exact_match`, which would compare with the text `None`).",
    )
    task: str = option(
        NAME,
        "Task name of every sample (names its metrics; `data.tasks` sets its own).",
        validator=NON_EMPTY,
    )
    exclude_fields: list[str] = option(
        [],
        "Columns NOT handed to the environment: large ones (they are sent to its actors with "
        "every batch), ones that are not JSON values, or ones named `answer` / `task` (the "
        "core sets those keys itself). Every other column is.",
        validator=each(NON_EMPTY, "a list of non-empty strings"),
    )
    max_samples: int | None = option(
        None, "Use at most this many rows per split (>= 1; unset: all).", validator=optional(ge(1))
    )

    def __attrs_post_init__(self) -> None:
        if self.path and self.hf_dataset:
            raise ValueError(
                f"path ({self.path}) and hf_dataset ({self.hf_dataset}) are both set; "
                "give one source of rows"
            )
        if self.require_answer and self.answer_field is None:
            raise ValueError("require_answer needs answer_field (the field holding the answer)")


# -- rows to samples ---------------------------------------------------------------------------


def is_json_like(value: Any) -> bool:
    """Whether ``value`` is made of JSON values only: text, numbers (not NaN), booleans, None,
    lists (or tuples) and dicts with text keys, to any depth."""
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return not math.isnan(value)  # NaN != NaN: such a value breaks equality checks
    if isinstance(value, list | tuple):
        return all(is_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_like(v) for k, v in value.items())
    return False


def _not_json(value: Any) -> str:
    """Words for a value :func:`is_json_like` refuses (for error messages)."""
    if isinstance(value, float):
        return "NaN"
    return f"a {type(value).__name__}"


class PromptDataset:
    """The ``prompts`` dataset (see :class:`PromptDataConfig` and the module docstring).

    Args:
        options: the ``data.prompts`` section (``None``: the defaults, which need a file).
        context: the run's :class:`~nrl_core.interfaces.ComponentContext` (its config's
            ``data`` section is read to refuse a ``.jsonl`` ``data.val_dataset``).
    """

    def __init__(self, options: PromptDataConfig | None, context: Any) -> None:
        self.options = options or PromptDataConfig()
        self.context = context

    def load(self, split: str) -> list[Sample]:
        """The samples of ``split`` (``train`` or ``validation``), one per row in file order.

        ``KeyError`` for another split, and for ``validation`` when neither
        ``validation_path`` nor ``validation_split`` is set (the core then holds out
        ``data.val_fraction`` of the training samples).
        """
        self._check_val_dataset()
        return [self.to_sample(row, where) for where, row in split_rows(self.options, split, NAME)]

    def _check_val_dataset(self) -> None:
        """Refuse a ``.jsonl`` ``data.val_dataset`` for this dataset: the core reads such a file
        with the math plugin's ``jsonl`` dataset (its ``\\boxed{}`` template, task ``math``), so
        validation prompts would silently differ from training ones."""
        data = getattr(getattr(self.context, "config", None), "data", None)
        if data is None:
            return
        named = [("data.val_dataset", data.dataset, data.val_dataset)]
        named += [
            (f"data.tasks[{i}].val_dataset", task.dataset, task.val_dataset)
            for i, task in enumerate(getattr(data, "tasks", []) or [])
        ]
        for key, dataset, val in named:
            if dataset == NAME and val and val.endswith(".jsonl"):
                raise PromptDataError(
                    f"{key}={val} would be read by the math plugin's `jsonl` dataset, not by "
                    f"`{NAME}`; set data.{NAME}.validation_path={val} instead"
                )

    def to_sample(self, row: dict[str, Any], where: str = "row") -> Sample:
        """One row as a sample (see the module docstring); ``where`` names the row in errors."""
        o = self.options
        if o.prompt_field not in row:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise PromptDataError(
                f"{where}: no field {o.prompt_field!r} (fields: {present}); set "
                f"data.{NAME}.prompt_field to the field holding the prompt"
            )
        messages = self._prompt(row[o.prompt_field], where)
        answer = row.get(o.answer_field) if o.answer_field is not None else None
        if answer is None and o.require_answer:
            raise PromptDataError(
                f"{where}: field {o.answer_field!r} is missing or null and "
                f"data.{NAME}.require_answer is set; add the answer, set "
                f"data.{NAME}.answer_field to the field holding it, or unset require_answer"
            )
        if not is_json_like(answer):
            raise PromptDataError(
                f"{where}: field {o.answer_field!r} holds {_not_json(answer)}, not a JSON value; "
                f"convert it, or set data.{NAME}.answer_field to another field"
            )
        metadata: dict[str, Any] = {}
        for key, value in row.items():
            if key in (o.prompt_field, o.answer_field) or key in o.exclude_fields:
                continue
            if key in RESERVED_FIELDS:
                raise PromptDataError(
                    f"{where}: field {key!r} would be overwritten (the environment gets "
                    f"metadata[{key!r}] = the sample's {key}); rename it, or add it to "
                    f"data.{NAME}.exclude_fields"
                    + (f" (or set data.{NAME}.answer_field={key})" if key == "answer" else "")
                )
            if not is_json_like(value):
                raise PromptDataError(
                    f"{where}: field {key!r} holds {_not_json(value)}, not a JSON value "
                    "(text, number, boolean, null, list or object), and every extra field travels "
                    f"to the environment's actors; add it to data.{NAME}.exclude_fields"
                )
            metadata[key] = value
        return Sample(messages=messages, answer=answer, task=o.task, metadata=metadata)

    def _prompt(self, value: Any, where: str) -> list[Message]:
        o = self.options
        field = o.prompt_field
        if isinstance(value, str):
            if not value.strip():
                raise PromptDataError(
                    f"{where}: field {field!r} is empty; every row needs a prompt"
                )
            # str.replace, not str.format: braces in templates (LaTeX, JSON) need no escaping.
            text = (
                value if o.prompt_template is None else o.prompt_template.replace("{prompt}", value)
            )
            return [{"role": "user", "content": text}]
        if isinstance(value, list):
            if o.prompt_template is not None:
                raise PromptDataError(
                    f"{where}: field {field!r} holds a list of messages, which is used as is; "
                    f"data.{NAME}.prompt_template applies to text prompts only: unset it"
                )
            return _prompt_messages(value, field, where)
        raise PromptDataError(
            f"{where}: field {field!r} must be text or a list of chat messages "
            f'([{{"role": "user", "content": "..."}}]), got {json_kind(value)}; set '
            f"data.{NAME}.prompt_field to the field holding the prompt"
        )


def _prompt_messages(value: list[Any], field: str, where: str) -> list[Message]:
    """A message-list prompt, checked: each an object with text ``role`` and ``content``, the
    role one of :data:`PROMPT_ROLES` (after :data:`ROLE_ALIASES`), the last not the assistant's
    (the policy answers the prompt). Keys other than role and content are dropped."""
    if not value:
        raise PromptDataError(
            f"{where}: field {field!r} is an empty list; a prompt needs a message"
        )
    out: list[Message] = []
    for index, message in enumerate(value):
        at = f"{where}: {field}[{index}]"
        if not isinstance(message, dict):
            raise PromptDataError(
                f'{at} must be a message ({{"role": "user", "content": "..."}}), got '
                f"{json_kind(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptDataError(
                f"{at} needs text `role` and `content`, got role {role!r:.40} and content "
                f"{content!r:.40}"
            )
        role = ROLE_ALIASES.get(role, role)
        if role not in PROMPT_ROLES:
            raise PromptDataError(
                f"{at} has role {role!r}; a prompt's roles are {', '.join(PROMPT_ROLES)}"
            )
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise PromptDataError(
            f"{where}: field {field!r} ends with an assistant message; the policy answers the "
            "prompt, so its last message is the user's (or the system's)"
        )
    return out
