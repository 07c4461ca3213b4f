"""The ``guess_number`` game played by a real (tiny) model through the core's rollout engine.

The model is untrained, so its guesses are noise; what is checked is the game's contract with
the engine: one guess per turn, the hint of each guess fed back as the next user turn, the
environment's stop strings applied from the second turn on, the episode ending on the right
guess or at the turn limit, and the training sequence being exactly the generated and
observation ids.
"""

from __future__ import annotations

import pytest
import torch
from nrl_math_env.common import last_integer
from nrl_math_env.config import GuessNumberDataConfig, GuessNumberEnvConfig
from nrl_math_env.guess_number import GuessNumberDataset

from nrl_core.algorithms.rollout import ChatCodec, episodes_to_batch, rollout, start_episodes
from nrl_core.environments import EnvironmentActor
from nrl_core.interfaces import ComponentContext, SamplingParams

generation = pytest.importorskip(
    "nrl_dtensor.generation",
    reason="torch generation comes with the nrl-dtensor plugin, which this plugin's own nox "
    "session does not install",
)

pytestmark = pytest.mark.timeout(300)

ENV_TARGET = "nrl_math_env.guess_number:GuessNumberEnvironment"
DIGITS = tuple("0123456789")
GAME_TURNS = 4
MAX_NEW_TOKENS = 6


class InProcessPool:
    """The EnvironmentPool's step contract over one EnvironmentActor, without Ray."""

    def __init__(self, actor: EnvironmentActor) -> None:
        self.actor = actor

    def step(self, tasks, conversations, metadata):
        assert set(tasks) == {"guess_number"}
        return self.actor.step((conversations, metadata))


@pytest.fixture(scope="module")
def game(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    # Later guesses stop at their first digit: short, readable guesses, and a stop string that
    # fires often enough to see.
    env = EnvironmentActor(
        ENV_TARGET,
        GuessNumberEnvConfig(max_turns=GAME_TURNS, stop_strings=list(DIGITS)),
        ComponentContext(config=None),
    )
    # Secrets 1..3: a random digit wins now and then, so both endings occur.
    samples = GuessNumberDataset(
        GuessNumberDataConfig(low=1, high=3, validation_size=16),
        ComponentContext(config=None, seed=0),
    ).load("validation")
    generator = generation.TorchGenerator(model=model, tokenizer=tokenizer)
    return tokenizer, InProcessPool(env), samples, generator


def play(game, max_turns: int):
    tokenizer, pool, samples, generator = game
    codec = ChatCodec(tokenizer)
    episodes = start_episodes(samples, codec, repeats=1)
    params = SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=1.0,
        seed=11,
        stop_token_ids=(tokenizer.eos_token_id,),
    )
    rollout(
        episodes, generator.generate, pool, codec, params, max_turns=max_turns, max_total_length=512
    )
    return codec, episodes


def hint(guess: int | None, secret: int) -> str:
    if guess is None:
        return "Reply with one number."
    return "higher" if guess < secret else "lower"


def test_game_turns_hints_stop_strings_and_endings(game):
    tokenizer = game[0]
    codec, episodes = play(game, max_turns=GAME_TURNS + 2)  # the game, not the engine, ends it
    endings = set()
    first_turn_digit_inside = False
    for episode in episodes:
        secret = int(episode.metadata["answer"])
        assert episode.done and not episode.truncated
        later = episode.messages[1:]  # after the prompt's user message
        roles = [m["role"] for m in later]
        assert roles == ["assistant", "user"] * (episode.turns - 1) + ["assistant"]
        responses = [m["content"] for m in later[::2]]
        guesses = [last_integer(text) for text in responses]
        # The environment saw each guess once, one per turn, and carried its state along.
        assert episode.turns == episode.metadata["turn"] == len(responses)
        assert episode.metadata["guesses"] == guesses and episode.metadata["secret"] == secret
        # Each observation is the hint to the guess before it.
        assert [m["content"] for m in later[1::2]] == [hint(g, secret) for g in guesses[:-1]]
        # The game ends on the first right guess (reward 1) or after GAME_TURNS wrong ones.
        won = guesses[-1] == secret
        assert secret not in guesses[:-1]
        assert episode.reward == (1.0 if won else 0.0)
        assert won or episode.turns == GAME_TURNS
        endings.add("won" if won else "turn limit")
        # Turn 1 has no stop strings; from turn 2 on the environment's digits end a guess,
        # so a digit can only be its last character.
        first_turn_digit_inside |= any(c in DIGITS for c in responses[0][:-1])
        for text in responses[1:]:
            assert not any(c in DIGITS for c in text[:-1]), text

        # The training sequence is the prompt plus exactly the ids of each later message:
        # generated ids under loss, observation ids (the template's glue around the hint) not.
        prompt = episode.token_ids[: episode.prompt_length]
        assert prompt == codec.encode_prompt(episode.messages[:1])
        assert episode.token_ids == prompt + [i for m in later for i in m["token_ids"]]
        expected_mask = [0.0] * len(prompt)
        for message in later:
            generated = message["role"] == "assistant"
            expected_mask += [1.0 if generated else 0.0] * len(message["token_ids"])
            if generated:
                assert codec.decode(message["token_ids"]) == message["content"]
            else:
                glue = tokenizer.decode(message["token_ids"])
                assert message["content"] in glue and glue.endswith("<|assistant|>")
        assert episode.loss_mask == expected_mask
    assert endings == {"won", "turn limit"}
    assert first_turn_digit_inside

    batch = episodes_to_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id)
    for row, episode in enumerate(episodes):
        n = len(episode.token_ids)
        assert batch["input_ids"][row, :n].tolist() == episode.token_ids
        assert batch["loss_mask"][row, :n].tolist() == episode.loss_mask


def test_the_engine_turn_limit_ends_a_game_before_the_environment_does(game):
    _, episodes = play(game, max_turns=2)
    assert all(e.done and e.turns <= 2 for e in episodes)
    for episode in episodes:
        secret = int(episode.metadata["answer"])
        guesses = episode.metadata["guesses"]
        assert episode.messages[-1]["role"] == "assistant"  # no hint after the last turn
        assert episode.reward == (1.0 if guesses[-1] == secret else 0.0)
        assert guesses[-1] == secret or episode.turns == 2
