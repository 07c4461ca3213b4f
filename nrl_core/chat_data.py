"""Chat and preference data for SFT, DPO and reward models: loading rows, encoding with masks.

Two registered datasets read local JSONL files (or, with the `datasets` library, a Hugging Face
dataset) and map their fields onto :class:`~nrl_core.data.Sample`:

* ``chat`` (SFT): ``Sample.messages`` holds the WHOLE conversation, assistant turns included.
* ``preference`` (DPO, reward models): ``Sample.messages`` holds the prompt, and
  ``Sample.metadata["chosen"]`` / ``["rejected"]`` the two responses as message lists.

:func:`encode_conversation` turns a conversation into token ids with the tokenizer's chat
template and a loss mask that covers exactly the assistant messages' tokens.

This module imports no torch: the config classes are structured by the driver's CLI, and the
encoders run wherever a tokenizer is at hand (driver, environment actors).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from nrl_core.config.schema import ge, option, optional
from nrl_core.data import Message, Sample
from nrl_core.datasets import SHIPPED_PREFIX, read_jsonl_rows, require_text, shipped_path
from nrl_core.errors import ConfigError

ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
"""ShareGPT-style role names and what they mean."""


class ChatDataError(ConfigError):
    """A chat or preference data file is missing or malformed (exit code 2, like any other
    input the user can fix)."""


@attrs.define
class ChatDataConfig:
    """Options of the ``chat`` dataset (``data.chat``): conversations for SFT.

    Each row holds a list of messages (``messages_field``), or a prompt and a response
    (``prompt_field`` and ``response_field``) that become one user and one assistant message.
    """

    path: str | None = option(
        None,
        "Training JSONL file (one conversation per line); `nrl://...` names a file shipped "
        "with nrl_core.",
    )
    validation_path: str | None = option(
        None, "Validation JSONL file (default: hold out `data.val_fraction` of the training rows)."
    )
    hf_dataset: str | None = option(
        None,
        "Hugging Face dataset name or local dataset folder, read with the `datasets` library "
        "instead of `path`.",
    )
    hf_subset: str | None = option(None, "Subset (configuration) name of `hf_dataset`.")
    train_split: str = option("train", "Split of `hf_dataset` used for training.")
    validation_split: str | None = option(
        None, "Split of `hf_dataset` used for validation (default: held out of the training one)."
    )
    messages_field: str = option("messages", "Field holding the list of messages.")
    role_field: str = option("role", "Key of a message's role (ShareGPT: `from`).")
    content_field: str = option("content", "Key of a message's text (ShareGPT: `value`).")
    prompt_field: str | None = option(
        None, "Instruction-style rows: field of the user prompt (used with `response_field`)."
    )
    response_field: str | None = option(
        None, "Instruction-style rows: field of the assistant response."
    )
    max_samples: int | None = option(
        None, "Use at most this many rows per split.", validator=optional(ge(1))
    )


@attrs.define
class PreferenceDataConfig:
    """Options of the ``preference`` dataset (``data.preference``): pairs for DPO and RMs.

    ``prompt`` may be a string or a list of messages; ``chosen`` and ``rejected`` a string (the
    assistant's reply) or a list of messages. A chosen/rejected conversation that repeats the
    prompt (the Anthropic HH / UltraFeedback layout) has the prompt stripped.
    """

    path: str | None = option(
        None,
        "Training JSONL file (one pair per line); `nrl://...` names a file shipped with nrl_core.",
    )
    validation_path: str | None = option(
        None, "Validation JSONL file (default: hold out `data.val_fraction` of the training rows)."
    )
    hf_dataset: str | None = option(
        None, "Hugging Face dataset name or local dataset folder (needs the `datasets` library)."
    )
    hf_subset: str | None = option(None, "Subset (configuration) name of `hf_dataset`.")
    train_split: str = option("train", "Split of `hf_dataset` used for training.")
    validation_split: str | None = option(
        None, "Split of `hf_dataset` used for validation (default: held out of the training one)."
    )
    prompt_field: str = option("prompt", "Field of the prompt (a string or a message list).")
    chosen_field: str = option("chosen", "Field of the preferred response.")
    rejected_field: str = option("rejected", "Field of the dispreferred response.")
    max_samples: int | None = option(
        None, "Use at most this many rows per split.", validator=optional(ge(1))
    )


# -- reading rows ------------------------------------------------------------------------------


def resolve_path(path: str | Path, key: str = "") -> Path:
    """``nrl://recipes/data/x.jsonl`` is a file shipped with nrl_core (confined to that package:
    see :func:`nrl_core.datasets.shipped_path`); other paths pass through."""
    text = str(path)
    if text.startswith(SHIPPED_PREFIX):
        return shipped_path(text, key=key, error=ChatDataError)
    return Path(path)


def read_jsonl(path: str | Path, key: str = "") -> list[dict[str, Any]]:
    """The objects of a JSON Lines file (blank lines skipped); see :func:`resolve_path`.
    Every line must be a JSON object (see :func:`nrl_core.datasets.read_jsonl_rows`)."""
    return [
        row for _, row in read_jsonl_rows(resolve_path(path, key), key=key, error=ChatDataError)
    ]


def _hub_rows(name: str, subset: str | None, split: str, key: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ChatDataError(
            f"{key}={name} needs the `datasets` library (pip install datasets), or convert the "
            "dataset to JSONL and set the `path` option"
        ) from None
    try:
        if Path(name).is_dir() and (Path(name) / "dataset_dict.json").is_file():
            return [dict(r) for r in datasets.load_from_disk(name)[split]]
        return [dict(r) for r in datasets.load_dataset(name, subset, split=split)]
    except Exception as exc:  # offline hub, unknown name or split: one line, not a traceback
        message = " ".join(str(exc).split())[:300]
        raise ChatDataError(
            f"{key}={name} (split {split!r}) cannot be loaded: {type(exc).__name__}: {message}; "
            "check the name and split, or convert the dataset to JSONL and set the `path` option"
        ) from None


def split_rows(options: Any, split: str, seed_key: str) -> list[tuple[str, dict]]:
    """The raw rows of ``split`` from a JSONL file or a hub dataset, as ``(where, row)`` pairs
    (``where``: ``file:line``, or the hub split and row number); ``KeyError`` for a validation
    split that the source lacks (the core then holds one out of training)."""
    if split not in ("train", "validation"):
        raise KeyError(split)
    if options.hf_dataset:
        key = f"data.{seed_key}.hf_dataset"
        hub_split = options.train_split if split == "train" else options.validation_split
        if not hub_split:
            raise KeyError(split)
        hub = _hub_rows(options.hf_dataset, options.hf_subset, hub_split, key)
        where = f"{options.hf_dataset} [{hub_split}] row"
        rows = [(f"{where} {i}", row) for i, row in enumerate(hub, 1)]
    elif options.path:
        if split == "validation":
            if not options.validation_path:
                raise KeyError(split)
            path, key = options.validation_path, f"data.{seed_key}.validation_path"
        else:
            path, key = options.path, f"data.{seed_key}.path"
        rows = read_jsonl_rows(resolve_path(path, key), key=key, error=ChatDataError)
    else:
        raise ChatDataError(
            f"the {seed_key} dataset needs data: set data.{seed_key}.path to a JSONL file "
            f"or data.{seed_key}.hf_dataset"
        )
    return rows[: options.max_samples] if options.max_samples else rows


def _messages(value: Any, role_field: str, content_field: str, where: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ChatDataError(
            f"{where}: expected a string or a list of messages "
            f'([{{"{role_field}": "user", "{content_field}": "..."}}, ...]), got {value!r:.80}'
        )
    out: list[Message] = []
    for m in value:
        if role_field not in m or content_field not in m:
            raise ChatDataError(
                f"{where}: a message lacks {role_field!r} or {content_field!r}; set "
                "role_field / content_field to the file's keys"
            )
        role, content = m[role_field], m[content_field]
        if not isinstance(role, str) or not isinstance(content, str):
            raise ChatDataError(
                f"{where}: a message's {role_field!r} and {content_field!r} must be text (JSON "
                f"strings), got {role!r:.40} and {content!r:.40}"
            )
        out.append({"role": ROLE_ALIASES.get(role, role), "content": content})
    return out


class ChatDataset:
    """The ``chat`` dataset (see :class:`ChatDataConfig`); samples carry whole conversations."""

    def __init__(self, options: ChatDataConfig | None, context: Any) -> None:
        self.options = options or ChatDataConfig()
        self.context = context

    def load(self, split: str) -> list[Sample]:
        """The conversations of ``split``; every one must hold an assistant message."""
        return [
            self.to_sample(row, where) for where, row in split_rows(self.options, split, "chat")
        ]

    def to_sample(self, row: dict[str, Any], where: str = "row") -> Sample:
        """One row as a sample whose ``messages`` is the whole conversation."""
        o = self.options
        if o.prompt_field and o.response_field:
            fix = "set data.chat.prompt_field / response_field to the file's field names"
            messages: list[Message] = [
                {
                    "role": "user",
                    "content": require_text(row, o.prompt_field, where, fix, ChatDataError),
                },
                {
                    "role": "assistant",
                    "content": require_text(row, o.response_field, where, fix, ChatDataError),
                },
            ]
        else:
            if o.messages_field not in row:
                raise ChatDataError(
                    f"{where} has no field {o.messages_field!r}; set data.chat.messages_field, "
                    "or data.chat.prompt_field and response_field"
                )
            messages = _messages(row[o.messages_field], o.role_field, o.content_field, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ChatDataError(f"{where} has no assistant message: nothing to train on")
        return Sample(messages=messages, task="sft")


class PreferenceDataset:
    """The ``preference`` dataset (see :class:`PreferenceDataConfig`)."""

    def __init__(self, options: PreferenceDataConfig | None, context: Any) -> None:
        self.options = options or PreferenceDataConfig()
        self.context = context

    def load(self, split: str) -> list[Sample]:
        """The pairs of ``split``: prompt messages, chosen and rejected responses in metadata."""
        rows = split_rows(self.options, split, "preference")
        return [self.to_sample(row, where) for where, row in rows]

    def to_sample(self, row: dict[str, Any], where: str = "row") -> Sample:
        """One row as a sample (see the module docstring)."""
        o = self.options
        for key in (o.chosen_field, o.rejected_field):
            if key not in row:
                raise ChatDataError(
                    f"{where} has no field {key!r}; set data.preference.chosen_field / "
                    "rejected_field to the file's field names"
                )
        prompt = _messages(row.get(o.prompt_field, []), "role", "content", where)
        responses = []
        for key in (o.chosen_field, o.rejected_field):
            value = row[key]
            if isinstance(value, str):
                response = [{"role": "assistant", "content": value}]
            else:
                response = _messages(value, "role", "content", where)
                if response[: len(prompt)] == prompt:
                    response = response[len(prompt) :]
                elif not prompt and len(response) > 1:
                    # Only full conversations: the prompt is everything before the last reply.
                    prompt, response = response[:-1], response[-1:]
            if not response or response[-1]["role"] != "assistant":
                raise ChatDataError(f"{where}: {key!r} must end with an assistant message")
            responses.append(response)
        if not prompt:
            raise ChatDataError(f"{where} has no prompt (field {o.prompt_field!r})")
        return Sample(
            messages=prompt,
            task="preference",
            metadata={"chosen": responses[0], "rejected": responses[1]},
        )


# -- encoding ----------------------------------------------------------------------------------


def apply_template(tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool) -> str:
    """``tokenizer.apply_chat_template`` as text. A template that jinja2's sandbox refuses
    (it reaches for ``__class__``, changes a list, ...) is a :class:`ConfigError` naming the
    tokenizer's folder: the template is the model folder's input, and it is not fixed by
    retrying."""
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:
        from jinja2.exceptions import SecurityError

        if not isinstance(exc, SecurityError):
            raise
        where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ConfigError(
            f"the chat template of {where} was refused by jinja2's sandbox ({exc}); fix the "
            "template (chat_template.jinja or tokenizer_config.json), or set "
            "data.apply_chat_template=false"
        ) from None


def render(
    tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool, use_template: bool
) -> str:
    """The conversation as text: the chat template, or the contents joined by newlines."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    if use_template:
        return apply_template(tokenizer, plain, add_generation_prompt)
    return "".join(m["content"] + "\n" for m in plain)


def encode_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    use_template: bool = True,
    max_length: int | None = None,
) -> tuple[list[int], list[float]]:
    """Token ids of a conversation and a mask that is 1 exactly on the assistant messages'
    tokens (their content and end-of-turn glue, e.g. the EOS the model must learn to emit),
    and 0 on system/user messages and on the role header the generation prompt adds.

    The conversation is rendered incrementally: the text each message adds to the rendered
    prefix is tokenised on its own, so the ids of an assistant turn are exactly those that
    follow the generation prompt at inference. Templates that rewrite earlier turns (and so are
    not prefix-stable) fall back to training on the last assistant message only. Without a chat
    template, messages are joined by newlines and an assistant message is followed by EOS.
    """

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    use_template = bool(use_template and getattr(tokenizer, "chat_template", None))
    ids: list[int] = []
    mask: list[float] = []

    def add(text: str, trained: bool) -> None:
        piece = encode(text)
        ids.extend(piece)
        mask.extend([1.0 if trained else 0.0] * len(piece))

    if not use_template:
        for m in messages:
            if m["role"] == "assistant":
                add(m["content"], True)
                ids.append(tokenizer.eos_token_id)
                mask.append(1.0)
            else:
                add(m["content"] + "\n", False)
        return _truncate(ids, mask, max_length)

    done = ""  # text already encoded
    stable = True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], True, True)
        full = render(tokenizer, messages[: i + 1], False, True)
        if not (head.startswith(done) and full.startswith(head)):
            stable = False
            break
        add(head[len(done) :], False)
        add(full[len(head) :], True)
        done = full
    if stable:
        add(render(tokenizer, messages, False, True)[len(done) :], False)
        return _truncate(ids, mask, max_length)

    ids, mask = [], []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = render(tokenizer, messages[:last], True, True)
    full = render(tokenizer, messages[: last + 1], False, True)
    if not full.startswith(head):
        raise ChatDataError(
            "the tokenizer's chat template does not render an assistant turn after its "
            "generation prompt; set data.apply_chat_template=false or fix the template"
        )
    add(head, False)
    add(full[len(head) :], True)
    return _truncate(ids, mask, max_length)


def _truncate(
    ids: list[int], mask: list[float], max_length: int | None
) -> tuple[list[int], list[float]]:
    if max_length is not None and len(ids) > max_length:
        return ids[:max_length], mask[:max_length]
    return ids, mask
