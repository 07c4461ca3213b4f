"""The environment and dataset against nrl's conformance suites (nrl_core.testing).

Each suite runs a set of contract checks (result shapes, determinism, batch independence,
error behaviour, registration) on the component the fixtures build.
"""

from __future__ import annotations

import pytest

from nrl_core.interfaces import ComponentContext
from nrl_core.testing.conformance import (
    DatasetConformance,
    EnvCase,
    EnvironmentConformance,
    conversation,
)
from {{ cookiecutter.__module }}.config import {{ cookiecutter.__class_prefix }}DataConfig, {{ cookiecutter.__class_prefix }}EnvConfig
from {{ cookiecutter.__module }}.dataset import {{ cookiecutter.__class_prefix }}Dataset
from {{ cookiecutter.__module }}.environment import {{ cookiecutter.__class_prefix }}Environment

CONTEXT = ComponentContext(config=None, seed=0)


def case(word: str, response: str, reward: float) -> EnvCase:
    meta = {"answer": word[::-1], "task": "{{ cookiecutter.__component }}"}
    return EnvCase(conversation(f"reverse: {word}", response), meta, reward)


class TestEnvironment(EnvironmentConformance):
    registered_name = "{{ cookiecutter.__component }}"

    @pytest.fixture
    def environment(self):
        return {{ cookiecutter.__class_prefix }}Environment({{ cookiecutter.__class_prefix }}EnvConfig(), CONTEXT)

    @pytest.fixture
    def cases(self):
        return [
            case("abc", "cba", 1.0),
            case("abc", "cbx", 0.5 * 2 / 3),
            case("abcd", "zzzz", 0.0),
            case("ab", "", 0.0),
        ]


class TestDataset(DatasetConformance):
    registered_name = "{{ cookiecutter.__component }}"
    splits = ("train", "validation")

    @pytest.fixture
    def loader(self):
        options = {{ cookiecutter.__class_prefix }}DataConfig(train_size=16, validation_size=4)
        return {{ cookiecutter.__class_prefix }}Dataset(options, CONTEXT)
