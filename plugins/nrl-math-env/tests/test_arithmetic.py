"""The arithmetic task: deterministic problems, exact reward, and the shared metrics."""

from __future__ import annotations

import random

import pytest
from nrl_math_env.arithmetic import ArithmeticDataset, ArithmeticEnvironment, make_problem
from nrl_math_env.common import last_integer
from nrl_math_env.config import ArithmeticDataConfig
from nrl_math_env.metrics import episode_metrics, pass_at_k

from nrl_core.interfaces import ComponentContext


def conversation(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def test_problems_are_deterministic_from_the_seed():
    options = ArithmeticDataConfig(num_digits=2, operations=["+", "-"], train_size=50)
    first = ArithmeticDataset(options, ComponentContext(config=None, seed=7)).load("train")
    again = ArithmeticDataset(options, ComponentContext(config=None, seed=7)).load("train")
    other = ArithmeticDataset(options, ComponentContext(config=None, seed=8)).load("train")
    assert [s.messages for s in first] == [s.messages for s in again]
    assert [s.messages for s in first] != [s.messages for s in other]
    val = ArithmeticDataset(options, ComponentContext(config=None, seed=7)).load("validation")
    assert len(first) == 50 and len(val) == options.validation_size
    assert [s.messages for s in val[:50]] != [s.messages for s in first]
    with pytest.raises(KeyError):
        ArithmeticDataset(options, ComponentContext(config=None)).load("test")


def test_problem_answers_follow_precedence_and_difficulty():
    rng = random.Random(0)
    for _ in range(200):
        expression, value = make_problem(
            rng, num_digits=2, operations=["+", "-", "*"], num_operands=3
        )
        assert eval(expression) == value
        assert all(len(n) <= 2 for n in expression.replace("-", "+").replace("*", "+").split("+"))
    sample = ArithmeticDataset(ArithmeticDataConfig(), ComponentContext(config=None)).load("train")[
        0
    ]
    assert sample.messages[0]["content"].endswith("=") and sample.task == "arithmetic"
    assert eval(sample.messages[0]["content"][:-1]) == int(sample.answer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("19", 19), ("12+7=19", 19), ("the answer is 19.", 19), ("-3", -3), ("5=-3", -3),
     ("18 no 19", 19), ("", None), ("nineteen", None)],
)  # fmt: skip
def test_last_integer(text, expected):
    assert last_integer(text) == expected


def test_exact_reward():
    env = ArithmeticEnvironment(None, ComponentContext(config=None))
    responses = ["19", "12+7=19", "18", "19 or 20", "", "190"]
    steps = env.step([conversation("12+7=", r) for r in responses], [{"answer": "19"}] * 6)
    assert [s.reward for s in steps] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert all(s.terminated for s in steps)


def test_metrics_over_groups():
    batch = {
        "rewards": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        "group_ids": [0, 0, 1, 1, 2, 2],
        "finish_reasons": ["stop", "length", "stop", "stop", "stop", "stop"],
        "response_lengths": [2, 8, 3, 3, 2, 2],
    }
    metrics = ArithmeticEnvironment(None, ComponentContext(config=None)).metrics(batch)
    assert metrics == pytest.approx(
        {
            "accuracy": 0.5,
            "pass@2": 2 / 3,
            "finished_fraction": 5 / 6,
            "mean_response_length": 10 / 3,
        }
    )
    assert episode_metrics({"rewards": [0.0, 1.0]}) == {"accuracy": 0.5}
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
