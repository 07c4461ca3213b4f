"""The math-env plugin's environments and datasets against the core conformance suites."""

from __future__ import annotations

import pytest
from nrl_math_env.arithmetic import ArithmeticDataset, ArithmeticEnvironment
from nrl_math_env.config import ArithmeticDataConfig, GuessNumberEnvConfig, WordProblemsDataConfig
from nrl_math_env.guess_number import GuessNumberEnvironment
from nrl_math_env.loaders import WordProblemsDataset

from nrl_core.interfaces import ComponentContext
from nrl_core.testing.conformance import (
    DatasetConformance,
    EnvCase,
    EnvironmentConformance,
    conversation,
)

CONTEXT = ComponentContext(config=None, seed=3)


class TestArithmeticEnvironment(EnvironmentConformance):
    registered_name = "arithmetic"

    @pytest.fixture
    def environment(self):
        return ArithmeticEnvironment(None, CONTEXT)

    @pytest.fixture
    def cases(self):
        def case(prompt, response, answer, reward):
            meta = {"answer": answer, "task": "arithmetic"}
            return EnvCase(conversation(prompt, response), meta, reward)

        return [
            case("12+7=", "19", "19", 1.0),
            case("12+7=", "18", "19", 0.0),
            case("3-5=", "it is -2", "-2", 1.0),
            case("3*4=", "", "12", 0.0),
        ]


class TestGuessNumberEnvironment(EnvironmentConformance):
    registered_name = "guess_number"
    single_turn = False  # wrong guesses get a hint and another turn

    @pytest.fixture
    def environment(self):
        return GuessNumberEnvironment(GuessNumberEnvConfig(), CONTEXT)

    @pytest.fixture
    def cases(self):
        meta = {"answer": "7", "task": "guess_number", "low": 1, "high": 16}
        return [
            EnvCase(conversation("Guess a number from 1 to 16.", "7"), dict(meta), 1.0),
            EnvCase(conversation("Guess a number from 1 to 16.", "3"), dict(meta), 0.0),
            EnvCase(conversation("Guess a number from 1 to 16.", "12"), dict(meta), 0.0),
        ]


class TestArithmeticDataset(DatasetConformance):
    registered_name = "arithmetic"
    splits = ("train", "validation")

    @pytest.fixture
    def loader(self):
        return ArithmeticDataset(ArithmeticDataConfig(train_size=32, validation_size=8), CONTEXT)


class TestWordProblemsDataset(DatasetConformance):
    registered_name = "word_problems"

    @pytest.fixture
    def loader(self):
        return WordProblemsDataset(WordProblemsDataConfig(), CONTEXT)
