"""Loading splits and dropping prompts too long to leave room for a response (nrl_core.datasets)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from nrl_core.config.schema import DataConfig
from nrl_core.data import Sample
from nrl_core.datasets import (
    PromptLengthFilter,
    drop_overlong_prompts,
    load_splits,
    read_jsonl_rows,
    require_text,
)
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext


def sample(text: str) -> Sample:
    return Sample([{"role": "user", "content": text}], answer="")


def content_lengths(samples):
    """Stands in for the chat codec: a prompt's length is its text's length."""
    return [len(s.messages[0]["content"]) for s in samples]


def test_drop_overlong_prompts_keeps_order_and_counts():
    samples = [sample(t) for t in ("a", "bbbb", "cc", "ddddd", "eee")]
    kept, dropped = drop_overlong_prompts(samples, [1, 4, 2, 5, 3], max_prompt_length=3)
    assert [s.messages[0]["content"] for s in kept] == ["a", "cc", "eee"]
    assert dropped == 2
    # The limit itself is allowed; a non-positive limit keeps nothing.
    assert drop_overlong_prompts(samples, [3] * 5, 3) == (samples, 0)
    assert drop_overlong_prompts(samples, [1] * 5, 0) == ([], 5)
    with pytest.raises(ValueError, match="prompt lengths"):
        drop_overlong_prompts(samples, [1, 2], 3)


class FakeDataset:
    """A registered dataset with only a training split (validation is held out of it)."""

    rows: list[str] = []

    def __init__(self, options, context) -> None:
        pass

    def load(self, split: str):
        if split != "train":
            raise KeyError(split)
        return [sample(t) for t in self.rows]


def fake_registry():
    spec = SimpleNamespace(config=None, load=lambda: FakeDataset)
    return SimpleNamespace(get=lambda kind, name, key=None: spec)


def test_load_splits_filters_each_split_after_the_hold_out_and_before_the_cut(monkeypatch):
    # 20 prompts of lengths 1..20; 25% held out for validation; prompts over 10 are dropped.
    monkeypatch.setattr(FakeDataset, "rows", ["x" * n for n in range(1, 21)])
    data = DataConfig(dataset="fake", val_fraction=0.25, max_val_samples=3)
    context = ComponentContext(config=None, seed=7)
    plain_train, plain_val = load_splits(data, fake_registry(), context)
    prompt_filter = PromptLengthFilter(content_lengths, max_prompt_length=10)
    train, val = load_splits(data, fake_registry(), context, prompt_filter=prompt_filter)

    # The filter does not change which prompts are held out...
    data_all = DataConfig(dataset="fake", val_fraction=0.25, max_val_samples=100)
    _, held_out = load_splits(data_all, fake_registry(), context)
    assert len(held_out) == 5
    assert [s.messages for s in plain_val] == [s.messages for s in held_out[:3]]
    # ...each split loses exactly its long prompts, and validation is cut after filtering.
    short_held = [s for s in held_out if len(s.messages[0]["content"]) <= 10]
    assert [s.messages for s in val] == [s.messages for s in short_held[:3]]
    assert [s.messages for s in train] == [
        s.messages for s in plain_train if len(s.messages[0]["content"]) <= 10
    ]
    assert prompt_filter.dropped == {
        "train": 15 - len(train),
        "validation": 5 - len(short_held),
    }
    assert prompt_filter.dropped["train"] + prompt_filter.dropped["validation"] == 10
    assert prompt_filter.total == {"train": 15, "validation": 5}
    assert prompt_filter.shortest["train"] == min(content_lengths(plain_train))


def test_every_prompt_too_long_leaves_an_empty_training_split(monkeypatch):
    monkeypatch.setattr(FakeDataset, "rows", ["x" * n for n in range(5, 9)])
    prompt_filter = PromptLengthFilter(content_lengths, max_prompt_length=4)
    train, val = load_splits(
        DataConfig(dataset="fake", val_fraction=0.25),
        fake_registry(),
        ComponentContext(config=None, seed=0),
        prompt_filter=prompt_filter,
    )
    assert train == [] and val == []
    assert prompt_filter.dropped == {"train": 3, "validation": 1}
    assert prompt_filter.shortest["train"] >= 5


# -- JSONL files: every line checked, one line per problem ----------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"data file .*d\.jsonl \(data\.x\.path\) is empty; it needs one JSON object per line"),
        (b"\n \n", r"is empty"),
        (b'{"a": "1"}\n{a: 1}\n', r"d\.jsonl:2: not valid JSON \(Expecting property name"),
        (b'{"a": "1"}\n\n["a", 1]\n', r"d\.jsonl:3: expected a JSON object \(\{\.\.\.\}\) per line, got a list"),
        (b"7\n", r"d\.jsonl:1: expected a JSON object .*got a number \(7\)"),
        (b'"text"\n', r"d\.jsonl:1: expected a JSON object .*got a string"),
        (b'{"a": "1"}\n{"a": "\xff"}\n', r"d\.jsonl:2: not UTF-8 text \(byte 0xff\)"),
    ],
)  # fmt: skip
def test_read_jsonl_rows_checks_every_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as error:
        read_jsonl_rows(path, key="data.x.path")
    assert "\n" not in str(error.value)


def test_read_jsonl_rows_names_each_row_by_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": "1"}\n\n{"a": "2"}\n')
    assert read_jsonl_rows(path) == [(f"{path}:1", {"a": "1"}), (f"{path}:3", {"a": "2"})]
    with pytest.raises(ConfigError, match=r"is a folder"):
        read_jsonl_rows(tmp_path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        read_jsonl_rows(tmp_path / "nope.jsonl")


def test_a_fifo_or_a_device_is_named_for_what_it_is_without_being_opened(tmp_path):
    """Issue 47: a FIFO or /dev/zero as a data file was "not a regular file" at load time
    (and "empty" at preflight); now the line says what it is, found by ``os.stat`` alone (no
    writer ever opens this FIFO: an ``open`` would block the test for ever)."""
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(
        ConfigError,
        match=r"rows\.jsonl \(data\.x\.path\) is a FIFO \(named pipe\), not a regular file",
    ):
        read_jsonl_rows(fifo, key="data.x.path")
    with pytest.raises(ConfigError, match=r"/dev/zero is a character device, not a regular file"):
        read_jsonl_rows("/dev/zero")


def test_nrl_paths_name_only_files_shipped_inside_nrl_core():
    """Issue 47: ``nrl://`` took ``..`` and absolute paths (``nrl:///etc/passwd``) to any file
    on the machine. Now only names inside the package resolve."""
    from importlib import resources

    from nrl_core.datasets import shipped_path

    root = Path(str(resources.files("nrl_core"))).resolve()
    good = shipped_path("nrl://recipes/data/chat_train.jsonl")
    assert good == root / "recipes" / "data" / "chat_train.jsonl" and good.is_file()
    escapes = ["nrl://../pyproject.toml", "nrl://recipes/../../etc/passwd", "nrl:///etc/passwd",
               "nrl://" + "../" * 12 + "etc/passwd", "nrl://"]  # fmt: skip
    for text in escapes:
        with pytest.raises(ConfigError, match=r"data\.chat\.path=nrl://.*names a file shipped inside nrl_core") as error:  # fmt: skip
            shipped_path(text, key="data.chat.path")
        assert "\n" not in str(error.value)


def test_require_text_refuses_numbers_and_names_the_fields():
    assert require_text({"problem": "1+1"}, "problem", "f:1") == "1+1"
    with pytest.raises(
        ConfigError,
        match=r"^f:2: field 'problem' must be text \(a JSON string\), got a number \(3\)$",
    ):
        require_text({"problem": 3}, "problem", "f:2")  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^f:3: no field 'problem' \(fields: answer, q\); set x$"
    ):
        require_text({"q": "?", "answer": "1"}, "problem", "f:3", "set x")


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ('{"messages": [{"role": "user", "content": 3}]}', {}, r"d\.jsonl:1: a message's 'role' and 'content' must be text"),
        ('{"messages": "hi"}', {}, r"d\.jsonl:1 has no assistant message"),
        ('{"messages": 5}', {}, r"d\.jsonl:1: expected a string or a list of messages"),
        ('{"q": "hi", "a": 2}', {"prompt_field": "q", "response_field": "a"}, r"d\.jsonl:1: field 'a' must be text"),
        ('{"q": "hi"}', {"prompt_field": "q", "response_field": "a"}, r"d\.jsonl:1: no field 'a' \(fields: q\); set data\.chat\.prompt_field"),
    ],
)  # fmt: skip
def test_chat_rows_are_checked_and_exit_2(tmp_path, rows, options, message):
    from nrl_core.chat_data import ChatDataConfig, ChatDataError, ChatDataset

    path = tmp_path / "d.jsonl"
    path.write_text(rows + "\n")
    dataset = ChatDataset(ChatDataConfig(path=str(path), **options), None)
    with pytest.raises(ChatDataError, match=message) as error:
        dataset.load("train")
    assert isinstance(error.value, ConfigError) and error.value.exit_code == 2


def test_preference_rows_are_checked(tmp_path):
    from nrl_core.chat_data import ChatDataError, PreferenceDataConfig, PreferenceDataset

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n{"prompt": "hi", "chosen": 1, "rejected": "b"}\n')  # fmt: skip
    dataset = PreferenceDataset(PreferenceDataConfig(path=str(path)), None)
    with pytest.raises(ChatDataError, match=r"p\.jsonl:2: expected a string or a list of messages"):
        dataset.load("train")


# -- several tasks (data.tasks) ------------------------------------------------------------------


def _stream(name: str, size: int):
    from nrl_core.data import Sample
    from nrl_core.datasets import DataStream

    samples = [Sample([{"role": "user", "content": f"{name}{i}"}], task=name) for i in range(size)]
    return DataStream(samples, seed=3)


def test_tasks_are_drawn_in_proportion_to_their_weights():
    from nrl_core.datasets import MixedStream

    mixed = MixedStream(
        {"a": _stream("a", 50), "b": _stream("b", 50)}, {"a": 1.0, "b": 3.0}, seed=1
    )
    drawn = [s.task for s in mixed.take(4000)]
    assert abs(drawn.count("b") / len(drawn) - 0.75) < 0.03


def test_a_mixed_stream_resumes_exactly():
    from nrl_core.datasets import MixedStream

    def fresh():
        return MixedStream({"a": _stream("a", 7), "b": _stream("b", 5)}, {"a": 1, "b": 1}, seed=9)

    whole = fresh()
    expected = [s.messages[0]["content"] for s in whole.take(40)]
    first = fresh()
    head = [s.messages[0]["content"] for s in first.take(13)]
    resumed = fresh()
    resumed.load_state(json.loads(json.dumps(first.state())))  # through a checkpoint file
    tail = [s.messages[0]["content"] for s in resumed.take(27)]
    assert head + tail == expected
    resumed.rewind()
    assert [s.messages[0]["content"] for s in resumed.take(5)] == expected[:5]


def test_two_tasks_with_one_name_are_refused(nrl_registry):
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_task_splits
    from nrl_core.interfaces import ComponentContext

    config = resolve_config(
        "grpo",
        overrides=["data.tasks=[{name: a, dataset: arithmetic}, {name: a, dataset: arithmetic}]"],
        registry=nrl_registry,
    )
    with pytest.raises(ConfigError, match="two tasks named 'a'"):
        load_task_splits(config.data, nrl_registry, ComponentContext(config=config))


def test_each_task_loads_its_own_samples_under_its_name(nrl_registry):
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_task_splits
    from nrl_core.interfaces import ComponentContext

    config = resolve_config(
        "grpo",
        overrides=[
            "data.tasks=[{name: add, dataset: arithmetic}, {name: bad, dataset: missing.jsonl}]"
        ],
        registry=nrl_registry,
    )
    with pytest.raises(ConfigError, match=r"missing\.jsonl does not exist"):
        load_task_splits(config.data, nrl_registry, ComponentContext(config=config))
    config.data.tasks.pop()
    splits = load_task_splits(config.data, nrl_registry, ComponentContext(config=config))
    train, val = splits["add"]
    assert train and val and {s.task for s in train + val} == {"add"}
