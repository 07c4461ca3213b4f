"""The reward itself, and the dataset's answers."""

from __future__ import annotations

import pytest

from nrl_core.interfaces import ComponentContext
from {{ cookiecutter.__module }}.config import {{ cookiecutter.__class_prefix }}DataConfig
from {{ cookiecutter.__module }}.dataset import {{ cookiecutter.__class_prefix }}Dataset
from {{ cookiecutter.__module }}.environment import score


@pytest.mark.parametrize(
    ("response", "reward"),
    [("olleh", 1.0), ("  olleh\nmore text", 1.0), ("ollex", 0.4), ("hello", 0.1), ("", 0.0)],
)
def test_score(response, reward):
    assert score(response, "olleh", partial_credit=0.5) == pytest.approx(reward)


def test_exact_match_only_without_partial_credit():
    assert score("ollex", "olleh", partial_credit=0.0) == 0.0


def test_answers_are_the_reversed_words():
    options = {{ cookiecutter.__class_prefix }}DataConfig(min_length=3, max_length=3, train_size=20)
    samples = {{ cookiecutter.__class_prefix }}Dataset(options, ComponentContext(config=None, seed=1)).load("train")
    for sample in samples:
        word = sample.messages[0]["content"].removeprefix("reverse: ")
        assert len(word) == 3 and sample.answer == word[::-1]
