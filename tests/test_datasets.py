"""Loading splits and dropping prompts too long to leave room for a response (nrl_core.datasets)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nrl_core.config.schema import DataConfig
from nrl_core.data import Sample
from nrl_core.datasets import PromptLengthFilter, drop_overlong_prompts, load_splits
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
