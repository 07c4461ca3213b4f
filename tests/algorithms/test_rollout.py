"""Rollouts keep token ids end to end (nrl_core.algorithms.rollout), with a real tiny model."""

from __future__ import annotations

import pytest
import torch

from nrl_core.algorithms.async_grpo import WeightGate
from nrl_core.algorithms.rollout import (
    ChatCodec,
    Episode,
    episodes_to_batch,
    rollout,
    start_episodes,
)
from nrl_core.data import Sample
from nrl_core.environments import EnvironmentActor, StepResult
from nrl_core.interfaces import ComponentContext, EnvStep, GenerationOutput, SamplingParams
from nrl_core.testing.environments import CountdownEnvironment, FlakyEnvironment


class InProcessPool:
    """The EnvironmentPool's step contract over one EnvironmentActor, without Ray."""

    def __init__(self, actor: EnvironmentActor) -> None:
        self.actor = actor

    def step(self, tasks, conversations, metadata):
        return self.actor.step((conversations, metadata))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def test_multi_turn_sequence_is_exactly_the_generated_and_fed_ids(model_and_tokenizer):
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer, system_prompt="Answer with a number.")
    pool = InProcessPool(EnvironmentActor(CountdownEnvironment, None, ComponentContext(None)))
    samples = [
        Sample([{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b))
        for a, b in [(1, 2), (3, 4)]
    ]
    episodes = start_episodes(samples, codec, repeats=2)
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    params = SamplingParams(
        max_new_tokens=8, temperature=1.0, seed=3, stop_token_ids=(tokenizer.eos_token_id,)
    )
    rollout(episodes, generator.generate, pool, codec, params, max_turns=5, max_total_length=512)

    for episode in episodes:
        assert episode.done and episode.turns == 3  # the environment ends after 3 responses
        prompt_ids = episode.token_ids[: episode.prompt_length]
        assert prompt_ids == codec.encode_prompt(episode.messages[:2])  # system + user
        later = episode.messages[2:]
        assert [m["role"] for m in later] == ["assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in later[1::2]] == ["2 more", "1 more"]
        # The training sequence is the prompt plus exactly the ids of each later message.
        assert episode.token_ids == prompt_ids + [i for m in later for i in m["token_ids"]]
        # The loss mask is 1 on generated ids only.
        expected_mask = [0.0] * len(prompt_ids)
        for message in later:
            expected_mask += [1.0 if message["role"] == "assistant" else 0.0] * len(
                message["token_ids"]
            )
        assert episode.loss_mask == expected_mask
        # Observation ids are the chat-template glue for the new turn, never a re-encoding
        # of the conversation: decoding them gives the observation and the next prompt.
        observation_text = tokenizer.decode(later[1]["token_ids"])
        assert "2 more" in observation_text and observation_text.endswith("<|assistant|>")
        # After the first turn, the environment's stop string "\n" ends each response.
        for message in later[2::2]:
            text = codec.decode(message["token_ids"])
            assert "\n" not in text[:-1]
        # Generation logprobs sit on generated positions only.
        assert all(
            lp == 0.0
            for lp, m in zip(episode.gen_logprobs, episode.loss_mask, strict=True)
            if m == 0.0
        )
        assert episode.metadata["remaining"] == 0 and len(episode.metadata["seen"]) == 3

    batch = episodes_to_batch(episodes, torch.tensor([1.0, -1.0, 0.5, 0.0]), tokenizer.pad_token_id)
    for row, episode in enumerate(episodes):
        n = len(episode.token_ids)
        assert batch["input_ids"][row, :n].tolist() == episode.token_ids
        assert int(batch["lengths"][row]) == n
        assert batch["loss_mask"][row, n:].sum() == 0
    assert torch.equal(batch["advantages"][1], -batch["loss_mask"][1])


def test_sequence_budget_truncates_and_marks_the_episode(model_and_tokenizer):
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    pool = InProcessPool(EnvironmentActor(CountdownEnvironment, None, ComponentContext(None)))
    episodes = start_episodes([Sample([{"role": "user", "content": "go"}], answer="1")], codec, 1)
    budget = episodes[0].prompt_length + 5
    rollout(
        episodes,
        TorchGenerator(model=model, tokenizer=tokenizer).generate,
        pool,
        codec,
        SamplingParams(max_new_tokens=20, seed=0, stop_token_ids=()),
        max_turns=4,
        max_total_length=budget,
    )
    assert episodes[0].truncated and episodes[0].done
    assert len(episodes[0].token_ids) <= budget
    assert episodes[0].finish_reason == "length"


def test_environment_errors_cost_only_the_failing_samples():
    actor = EnvironmentActor(
        "nrl_core.testing.environments:FlakyEnvironment", None, ComponentContext(None)
    )
    conversations = [[{"role": "assistant", "content": text}] for text in ("4", "3", "5", "x")]
    metadata = [{"answer": a} for a in ("4", "3", "6", "8")]
    results = actor.step((conversations, metadata))
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert [r.error is not None for r in results] == [False, True, False, False]
    assert "odd answer 3" in results[1].error and "environments.py" in results[1].error
    assert isinstance(actor.env, FlakyEnvironment)


# --------------------------------------------------------------------------------------------
# Scripted generation and environments (no model): exact control over lengths and ids.


class ScriptedGenerator:
    """Returns the next scripted response for every prompt and records what it was asked."""

    def __init__(self, *responses: list[int]) -> None:
        self.responses = list(responses)
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, params, stop_strings=None) -> GenerationOutput:
        self.calls.append([list(p) for p in prompts])
        ids = self.responses[min(len(self.calls), len(self.responses)) - 1]
        return GenerationOutput(
            token_ids=[list(ids) for _ in prompts],
            logprobs=[[-0.5] * len(ids) for _ in prompts],
            finish_reasons=["stop" for _ in prompts],
        )


class ScriptedPool:
    """Answers every step with ``observation`` (None ends the episode) and reward 1."""

    def __init__(self, observation=None, turns_before_end: int = 100) -> None:
        self.observation = observation
        self.turns_before_end = turns_before_end
        self.calls = 0

    def step(self, tasks, conversations, metadata):
        self.calls += 1
        end = self.calls >= self.turns_before_end
        return [
            StepResult(EnvStep(reward=1.0, terminated=end, observation=self.observation))
            for _ in tasks
        ]


class IdCodec:
    """The rollout's codec interface over raw ids: observations are always ``[90, 91]``."""

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode_observation(self, history, observation):
        return [90, 91]


def episode_with_prompt(length: int) -> Episode:
    return Episode(
        group=0,
        task="t",
        messages=[{"role": "user", "content": "x"}],
        metadata={},
        token_ids=list(range(1, length + 1)),
        prompt_length=length,
    )


def test_a_prompt_at_or_over_the_limit_ends_truncated_without_generating():
    # Limit 8: a 10-token prompt (over), an 8-token prompt (no budget left) and a 2-token one.
    # Before the fix the 10-token prompt had budget -2 and ids[:-2] kept 3 of the 5 generated
    # ids: a 13-token sequence.
    over, full, short = episode_with_prompt(10), episode_with_prompt(8), episode_with_prompt(2)
    generator = ScriptedGenerator([41, 42, 43, 44, 45])
    rollout(
        [over, full, short],
        generator.generate,
        ScriptedPool(),
        IdCodec(),
        SamplingParams(max_new_tokens=5),
        max_turns=1,
        max_total_length=8,
    )
    assert generator.calls == [[[1, 2]]]  # only the prompt with room is generated for
    for episode in (over, full):
        assert episode.done and episode.truncated and episode.finish_reason == "length"
        assert episode.turns == 0 and episode.response_length == 0
        assert len(episode.token_ids) == len(episode.loss_mask) == len(episode.gen_logprobs) == 8
        assert episode.prompt_length == 8
    assert over.token_ids == list(range(1, 9))  # the prompt cut to the limit, nothing generated
    assert short.token_ids == [1, 2, 41, 42, 43, 44, 45] and not short.truncated
    batch = episodes_to_batch([over, full, short], torch.zeros(3), pad_token_id=0)
    assert batch["input_ids"].shape[1] == 8 and batch["loss_mask"][:2].sum() == 0


def test_multi_turn_never_exceeds_the_limit():
    # Limit 12, prompt 3, 4 ids per turn, a 2-id observation: 3 + 4 + 2 = 9, then the second
    # turn is cut to the 3 ids left and the episode ends as truncated at exactly 12.
    episode = episode_with_prompt(3)
    generator = ScriptedGenerator([41, 42, 43, 44])
    rollout(
        [episode],
        generator.generate,
        ScriptedPool(observation={"role": "user", "content": "more"}),
        IdCodec(),
        SamplingParams(max_new_tokens=4),
        max_turns=5,
        max_total_length=12,
    )
    assert episode.token_ids == [1, 2, 3, 41, 42, 43, 44, 90, 91, 41, 42, 43]
    assert episode.done and episode.truncated and episode.finish_reason == "length"
    assert episode.turns == 2
    assert episode.loss_mask == [0.0] * 3 + [1.0] * 4 + [0.0] * 2 + [1.0] * 3


def test_prompt_lengths_match_the_encoded_prompts():
    from nrl_core.testing.tiny import build_tokenizer

    codec = ChatCodec(build_tokenizer(), system_prompt="Be brief.")
    samples = [Sample([{"role": "user", "content": "1+2=" * n}], answer="3") for n in (1, 4, 9)]
    expected = [len(codec.encode_prompt(codec.prompt_messages(s))) for s in samples]
    assert codec.prompt_lengths(samples, chunk_size=2) == expected
    assert expected[0] < expected[1] < expected[2]


# --------------------------------------------------------------------------------------------
# Chat templates that rewrite history (Qwen3 / DeepSeek-R1 drop earlier reasoning).

DEFAULT_SYSTEM = "You are a helpful assistant."

# BOS, a default system prompt when the conversation has none, and <think>...</think> removed
# from every assistant turn but the last one (the reasoning of past turns is not shown again).
THINK_STRIPPING_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|system|>' + '" + DEFAULT_SYSTEM + "' + eos_token }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + content + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The same, and like Qwen3 the LAST assistant turn always shows a think block (an empty one
# when it has none), so even a conversation without reasoning renders differently once a new
# message follows it.
LAST_TURN_THINK_TEMPLATE = THINK_STRIPPING_TEMPLATE.replace(
    "{% endif %}{{ '<|' + message['role']",
    "{% elif message['role'] == 'assistant' and loop.last and '</think>' not in content %}"
    "{% set content = '<think></think>' + content %}"
    "{% endif %}{{ '<|' + message['role']",
)


@pytest.mark.parametrize("template", [THINK_STRIPPING_TEMPLATE, LAST_TURN_THINK_TEMPLATE])
def test_observation_ids_after_a_history_rewriting_template(template):
    from nrl_core.testing.tiny import build_tokenizer

    assert "elif" in LAST_TURN_THINK_TEMPLATE  # its edit of the first template applied
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    codec = ChatCodec(tokenizer)
    eos = tokenizer.eos_token_id

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first = [*encode("<think>hmm</think>3"), eos]
    second = [*encode("5"), eos]
    observation = {"role": "user", "content": "again"}
    samples = [Sample([{"role": "user", "content": "1+2="}], answer="3")]
    episodes = start_episodes(samples, codec, repeats=1)
    prompt_ids = list(episodes[0].token_ids)
    rollout(
        episodes,
        ScriptedGenerator(first, second).generate,
        ScriptedPool(observation=observation, turns_before_end=2),
        codec,
        SamplingParams(max_new_tokens=32),
        max_turns=3,
        max_total_length=512,
    )
    episode = episodes[0]
    assert episode.turns == 2 and episode.done and not episode.truncated

    # The template does rewrite the history here, so the diff of the two renderings fails and
    # the fallback is what this test exercises.
    history = [{"role": m["role"], "content": m["content"]} for m in episode.messages[:2]]
    before = tokenizer.apply_chat_template(history, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*history, observation], tokenize=False, add_generation_prompt=True
    )
    assert not after.startswith(before)

    obs_ids = episode.messages[2]["token_ids"]
    # Exactly the observation's turn and the next generation prompt: no BOS, no system preamble
    # in the middle of the sequence.
    assert obs_ids == encode("<|user|>again<|eos|><|assistant|>")
    assert tokenizer.bos_token_id not in obs_ids
    assert DEFAULT_SYSTEM not in tokenizer.decode(obs_ids)
    assert tokenizer.convert_tokens_to_ids("<|system|>") not in obs_ids
    # Token ids end to end: the prompt, the generated ids, the observation ids, the generated ids.
    assert episode.token_ids == prompt_ids + first + obs_ids + second
    assert episode.loss_mask == (
        [0.0] * len(prompt_ids) + [1.0] * len(first) + [0.0] * len(obs_ids) + [1.0] * len(second)
    )
    assert codec.encode_observation(episode.messages[:2], observation) == obs_ids


# -- agent trajectories (apply_trajectory) -----------------------------------------------------


def _agent_episode(codec):
    sample = Sample(messages=[{"role": "user", "content": "1+1="}], answer="2", task="calc")
    return start_episodes([sample], codec, 1)[0]


def test_a_trajectory_becomes_one_sequence_with_loss_on_generated_ids_only(model_and_tokenizer):
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    calls = [
        ModelCall([1, 2, 3], [4, 5], [-0.1, -0.2]),
        # The second prompt holds everything before it, then a tool result (6, 7).
        ModelCall([1, 2, 3, 4, 5, 6, 7], [8], [-0.3]),
    ]
    episode = apply_trajectory(
        _agent_episode(codec), Trajectory(calls, reward=1.0), codec, max_total_length=64
    )
    assert episode.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert episode.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert episode.gen_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert (episode.prompt_length, episode.turns, episode.reward) == (3, 2, 1.0)
    assert not episode.noncontiguous and episode.failure is None
    batch = episodes_to_batch([episode], torch.ones(1), tokenizer.pad_token_id)
    assert batch["sample_mask"].tolist() == [1.0]


def test_a_call_that_does_not_continue_the_sequence_masks_the_episode(model_and_tokenizer):
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    # The agent re-tokenised its history: the second prompt has 9 where 4 was sampled.
    calls = [ModelCall([1, 2, 3], [4, 5], [-0.1, -0.2]), ModelCall([1, 2, 3, 9, 5, 6], [8], [-1])]
    episode = apply_trajectory(
        _agent_episode(codec), Trajectory(calls, reward=1.0), codec, max_total_length=64
    )
    assert episode.noncontiguous
    assert episode.token_ids == [1, 2, 3, 4, 5]  # the calls before the break only
    batch = episodes_to_batch([episode], torch.ones(1), tokenizer.pad_token_id)
    assert batch["sample_mask"].tolist() == [0.0]


def test_a_failed_row_keeps_its_prompt_gets_reward_zero_and_no_loss(model_and_tokenizer):
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    episode = _agent_episode(codec)
    prompt = list(episode.token_ids)
    failed = Trajectory([ModelCall([1], [2], [-1.0])], reward=1.0, failure_reason="tool crashed")
    apply_trajectory(episode, failed, codec, max_total_length=64)
    assert (episode.failure, episode.reward, episode.token_ids) == ("tool crashed", 0.0, prompt)
    assert sum(episode.loss_mask) == 0


@pytest.mark.parametrize(
    "calls, named",
    [
        # Issue 47: an id past the vocabulary crashed the run in the tokenizer's decode.
        (
            [([1, 2], [3], [-0.1]), ([1, 2, 3, 4], [10**9], [-0.2])],
            "model call 1's generation_token_ids",
        ),
        ([([1, -1], [3], [-0.1])], "model call 0's prompt_token_ids"),
        ([([1, 2], [3], [-0.1]), ([1, 2, 3, "4"], [5], [-0.2])], "model call 1's prompt_token_ids"),
        ([([1, 2], [True], [-0.1])], "model call 0's generation_token_ids"),
    ],
)
def test_a_trajectory_with_ids_outside_the_vocabulary_is_a_failed_row(model_and_tokenizer, calls, named):  # fmt: skip
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    episode = _agent_episode(codec)
    prompt, messages = list(episode.token_ids), list(episode.messages)
    trajectory = Trajectory([ModelCall(*call) for call in calls], reward=1.0)
    apply_trajectory(episode, trajectory, codec, max_total_length=64)
    vocab = len(tokenizer)
    assert episode.failure.startswith(f"{named} must hold token ids in 0..{vocab - 1}")
    assert (episode.reward, episode.token_ids, episode.messages) == (0.0, prompt, messages)
    assert sum(episode.loss_mask) == 0 and len(episode.loss_mask) == len(prompt)
    batch = episodes_to_batch([episode], torch.ones(1), tokenizer.pad_token_id)
    assert batch["sample_mask"].tolist() == [0.0]


def test_ids_the_model_embeds_past_the_tokenizer_are_kept(model_and_tokenizer):
    """A model's vocab_size may exceed the tokenizer's length (padded embeddings) and the
    policy samples those ids: they are the model's vocabulary, the next one is not."""
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    padded = len(tokenizer) + 24
    codec = ChatCodec(tokenizer, vocab_size=padded)
    kept = Trajectory([ModelCall([1, 2], [padded - 1], [-0.5])])
    episode = apply_trajectory(_agent_episode(codec), kept, codec, max_total_length=64)
    assert episode.failure is None and episode.token_ids == [1, 2, padded - 1]
    past = Trajectory([ModelCall([1, 2], [padded], [-0.5])])
    episode = apply_trajectory(_agent_episode(codec), past, codec, max_total_length=64)
    assert episode.failure.endswith(f"in 0..{padded - 1} (the vocabulary), got {padded}")


def test_the_endpoint_and_the_trajectories_refuse_ids_by_one_check(model_and_tokenizer):
    """The endpoint's 400 and a trajectory's failure are the same line."""
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory
    from nrl_core.serving.errors import RequestError
    from nrl_core.serving.request_checks import check_ids

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    vocab = len(tokenizer)
    with pytest.raises(RequestError) as refused:
        check_ids([1, vocab], "model call 0's prompt_token_ids", vocab)
    episode = _agent_episode(codec)
    apply_trajectory(episode, Trajectory([ModelCall([1, vocab], [2], [-1.0])]), codec, max_total_length=64)  # fmt: skip
    assert episode.failure == str(refused.value)


def test_a_trajectory_longer_than_the_budget_is_cut_and_marked_truncated(model_and_tokenizer):
    from nrl_core.agents import ModelCall, Trajectory
    from nrl_core.algorithms.rollout import apply_trajectory

    _, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    calls = [ModelCall([1, 2, 3], [4, 5, 6, 7], [-0.5] * 4)]
    episode = apply_trajectory(_agent_episode(codec), Trajectory(calls), codec, max_total_length=5)
    assert episode.token_ids == [1, 2, 3, 4, 5] and len(episode.loss_mask) == 5
    assert episode.truncated and episode.finish_reason == "length"


def test_model_calls_refuse_unpaired_logprobs():
    from nrl_core.agents import ModelCall

    with pytest.raises(ValueError, match="2 generated ids but 1 logprobs"):
        ModelCall([1], [2, 3], [-0.1])


_TOKENISE_HUGE_PROMPT = """
import signal
import sys

# Python as a terminal starts it: a parent that ignores SIGINT (a shell's background job,
# `cmd &`, runs the suite so) would pass that on, and Python then installs no Ctrl-C handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
from transformers import AutoTokenizer
from nrl_core.algorithms.rollout import ChatCodec
from nrl_core.data import Sample
from nrl_core.testing.tiny import tiny_model_path

codec = ChatCodec(AutoTokenizer.from_pretrained(tiny_model_path()), apply_chat_template=False)
sample = Sample(messages=[{"role": "user", "content": "1+" * 4_000_000}])  # 8 MB
print("READY", flush=True)
try:
    codec.prompt_lengths([sample])
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
print("tokenised", flush=True)
"""


def test_ctrl_c_stops_tokenising_a_huge_prompt_at_once(tmp_path):
    """Issue 40: Ctrl-C was not honoured while a 50 MB data line loaded: the tokenizer's one
    native call over it (minutes) held the signal until it returned. It now runs in a thread
    the main thread waits on in short slices."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "tokenise.py"
    script.write_text(_TOKENISE_HUGE_PROMPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
        time.sleep(3)  # well into the tokenizer (20 MB take minutes there)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        said = proc.stderr.readline()  # the moment the interrupt is handled
        took = time.monotonic() - sent
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert said.strip() == "interrupted", (proc.returncode, said + err[-3000:])
    assert proc.returncode == 130 and "tokenised" not in out, (out, err[-3000:])
    # The old code handled it when the tokenizer returned: ~14 s after the signal for 8 MB.
    assert took < 5, f"the interrupt took {took:.1f} s"


def _roll_in_calls(episodes, gate, pool, codec, params, *, max_turns, cap):
    """Roll ``episodes`` out in calls of at most ``cap`` tokens a sample, the weights' version
    going up by one between calls (as the streaming producer's partial rollouts see it);
    returns the number of calls."""
    calls = 0
    while not all(e.done for e in episodes):
        gate.ensure(calls)
        rollout(
            [e for e in episodes if not e.done],
            gate.generate,
            pool,
            codec,
            params,
            max_turns=max_turns,
            max_total_length=512,
            max_tokens_per_call=cap,
        )
        calls += 1
    return calls


def test_a_partial_rollout_continues_with_the_exact_ids_and_keeps_each_tokens_version(
    model_and_tokenizer,
):
    """max_tokens_per_call=6 of max_new_tokens=10: the first call stops every sample after 6
    tokens (not done, partial), the next call, under newer weights, continues from prompt +
    those 6 ids; the final sequence is the one a single call makes (greedy), in one assistant
    message, and its versions are two runs [[0, 6], [1, 4]]."""
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer)
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    samples = [Sample([{"role": "user", "content": p}], answer="1") for p in ("go", "1+2=")]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=())

    whole = start_episodes(samples, codec, 1)
    rollout(whole, generator.generate, None, codec, params, max_turns=1, max_total_length=512)

    gate = WeightGate(generator.generate, lambda: 0.0)
    parts = start_episodes(samples, codec, 1)
    gate.ensure(0)
    rollout(parts, gate.generate, None, codec, params, max_turns=1, max_total_length=512,
            max_tokens_per_call=6)  # fmt: skip
    for episode in parts:
        assert not episode.done and episode.partial and episode.turn_tokens == 6
        assert len(episode.token_ids) == episode.prompt_length + 6
    first = [list(e.token_ids) for e in parts]
    gate.ensure(1)  # new weights between the calls
    rollout(parts, gate.generate, None, codec, params, max_turns=1, max_total_length=512,
            max_tokens_per_call=6)  # fmt: skip
    for episode, reference, before in zip(parts, whole, first, strict=True):
        assert episode.done and episode.turns == 1 and episode.turn_tokens == 0
        assert episode.token_ids[: len(before)] == before  # continued, never re-encoded
        assert episode.token_ids == reference.token_ids
        generated = episode.token_ids[episode.prompt_length :]
        assert len(generated) == 10 and episode.finish_reason == "length"
        assert [m["role"] for m in episode.messages[-1:]] == ["assistant"]
        assert episode.messages[-1]["token_ids"] == generated
        assert episode.messages[-1]["content"] == codec.decode(generated)
        assert episode.loss_mask == reference.loss_mask
        assert torch.allclose(
            torch.tensor(episode.gen_logprobs), torch.tensor(reference.gen_logprobs), atol=1e-4
        )
        assert episode.weight_versions == [0] * 6 + [1] * 4


def test_partial_rollouts_of_a_multi_turn_episode_splice_each_turn_exactly(model_and_tokenizer):
    """Three turns of the countdown environment, 3 tokens a call: the environment sees each
    turn once, whole; the sequence and the messages equal a run without the cap (greedy)."""
    from nrl_dtensor.generation import TorchGenerator

    model, tokenizer = model_and_tokenizer
    codec = ChatCodec(tokenizer, system_prompt="Answer with a number.")
    generator = TorchGenerator(model=model, tokenizer=tokenizer)
    samples = [Sample([{"role": "user", "content": "1+2="}], answer="3")]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=())

    def pool():
        return InProcessPool(EnvironmentActor(CountdownEnvironment, None, ComponentContext(None)))

    whole = start_episodes(samples, codec, 1)
    rollout(whole, generator.generate, pool(), codec, params, max_turns=5, max_total_length=512)
    parts = start_episodes(samples, codec, 1)
    gate = WeightGate(generator.generate, lambda: 0.0)
    calls = _roll_in_calls(parts, gate, pool(), codec, params, max_turns=5, cap=3)
    assert calls > 3  # some turn took more than one call
    for episode, reference in zip(parts, whole, strict=True):
        assert episode.done and episode.turns == reference.turns == 3
        assert episode.token_ids == reference.token_ids
        assert episode.messages == reference.messages
        assert episode.loss_mask == reference.loss_mask
        assert episode.reward == reference.reward
        assert episode.partial == any(len(m["token_ids"]) > 3 for m in episode.messages[2::2])
        assert len(set(episode.weight_versions)) > 1
