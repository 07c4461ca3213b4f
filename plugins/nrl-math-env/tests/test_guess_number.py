"""The number-guessing game, played over several turns the way the rollout engine plays it."""

from __future__ import annotations

from nrl_math_env.config import GuessNumberDataConfig, GuessNumberEnvConfig
from nrl_math_env.guess_number import GuessNumberDataset, GuessNumberEnvironment

from nrl_core.interfaces import ComponentContext


def play(env, sample, guesses):
    """Feed ``guesses`` one turn at a time, carrying messages and metadata like the core."""
    messages = list(sample.messages)
    metadata = {**sample.metadata, "answer": sample.answer, "task": sample.task}
    steps = []
    for guess in guesses:
        messages.append({"role": "assistant", "content": guess})
        (step,) = env.step([messages], [metadata])
        steps.append(step)
        if step.terminated:
            break
        messages.append(step.observation)
        metadata = step.metadata if step.metadata is not None else metadata
    return steps, messages


def make(max_turns=4):
    env = GuessNumberEnvironment(
        GuessNumberEnvConfig(max_turns=max_turns), ComponentContext(config=None)
    )
    dataset = GuessNumberDataset(
        GuessNumberDataConfig(low=1, high=8), ComponentContext(config=None)
    )
    return env, dataset.load("train")[0]


def test_binary_search_wins_with_hints_and_carried_metadata():
    env, sample = make()
    secret = int(sample.answer)
    assert 1 <= secret <= 8
    low, high, guesses = 1, 8, []
    messages = list(sample.messages)
    metadata = {**sample.metadata, "answer": sample.answer, "task": sample.task}
    for turn in range(1, 5):
        guess = (low + high) // 2
        guesses.append(guess)
        messages.append({"role": "assistant", "content": f"{guess}\n"})
        (step,) = env.step([messages], [metadata])
        assert step.metadata["turn"] == turn and step.metadata["secret"] == secret
        assert step.metadata["guesses"] == guesses
        if guess == secret:
            assert step.terminated and step.reward == 1.0 and step.observation is None
            break
        assert not step.terminated and step.reward == 0.0
        assert step.stop_strings == ("\n",)
        assert step.observation == {
            "role": "user",
            "content": "higher" if guess < secret else "lower",
        }
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        messages.append(step.observation)
        metadata = step.metadata
    else:
        raise AssertionError("binary search over 1..8 finds the number within 4 guesses")


def test_game_ends_after_max_turns_without_reward():
    env, sample = make(max_turns=3)
    wrong = str(int(sample.answer) % 8 + 1)
    steps, messages = play(env, sample, [wrong, "no idea", wrong, wrong, wrong])
    assert len(steps) == 3 and steps[-1].terminated and steps[-1].reward == 0.0
    assert [s.terminated for s in steps] == [False, False, True]
    assert steps[1].observation["content"] == "Reply with one number."
    assert steps[-1].metadata["guesses"] == [int(wrong), None, int(wrong)]
    assert [m["role"] for m in messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def test_batch_of_games_and_metrics():
    env, sample = make()
    meta = {**sample.metadata, "answer": sample.answer}
    right = [*sample.messages, {"role": "assistant", "content": sample.answer}]
    wrong = [*sample.messages, {"role": "assistant", "content": "0"}]
    steps = env.step([right, wrong], [meta, meta])
    assert [(s.reward, s.terminated) for s in steps] == [(1.0, True), (0.0, False)]
    metrics = env.metrics({"rewards": [1.0, 0.0], "metadata": [steps[0].metadata, {"turn": 4}]})
    assert metrics == {"accuracy": 0.5, "mean_turns": 2.5}
