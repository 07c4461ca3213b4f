"""Token-exact prompts across turns (nrl_core.serving.prompts), with real tokenizers built here."""

from __future__ import annotations

import pytest

from nrl_core.serving.prompts import PromptBuilder, PromptError, normalize_messages
from nrl_core.testing.tokenizers import THINK_STRIPPING_TEMPLATE, bpe_tokenizer, ids_of


def carried(message: dict, prompt: list[int], generated: list[int]) -> dict:
    return {
        **message,
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.5] * len(generated),
    }


def test_retokenising_the_history_differs_and_the_splice_keeps_the_sampled_ids():
    tokenizer = bpe_tokenizer()
    builder = PromptBuilder(tokenizer)
    history = [{"role": "user", "content": "say ab"}]
    prompt = builder.build(history)
    eos = tokenizer.eos_token_id
    sampled = [*ids_of(tokenizer, "a"), *ids_of(tokenizer, "b"), eos]  # two tokens, not "ab"
    reply = carried({"role": "assistant", "content": "ab"}, prompt, sampled)
    follow_up = [*history, reply, {"role": "user", "content": "again"}]

    rendered = builder.render_ids(normalize_messages(follow_up))
    assert rendered[: len(prompt) + len(sampled)] != [*prompt, *sampled]  # re-tokenised: "ab"
    spliced = builder.build(follow_up)
    assert spliced[: len(prompt) + len(sampled)] == [*prompt, *sampled]
    # ...followed by exactly the template's rendering of the new turn.
    assert spliced[len(prompt) + len(sampled) :] == [
        *ids_of(tokenizer, "<|user|>again")[:],
        eos,
        *ids_of(tokenizer, "<|assistant|>"),
    ]


def test_three_turns_each_prompt_starts_with_every_earlier_turns_exact_ids():
    tokenizer = bpe_tokenizer()
    builder = PromptBuilder(tokenizer)
    eos = tokenizer.eos_token_id
    a, b = ids_of(tokenizer, "a"), ids_of(tokenizer, "b")
    messages: list[dict] = [{"role": "user", "content": "go"}]
    sequences = []
    for turn in range(3):
        prompt = builder.build(messages)
        for earlier in sequences:
            assert prompt[: len(earlier)] == earlier
        generated = [*a, *b, *a] + ([eos] if turn != 1 else [])  # turn 1 is cut off
        sequences.append([*prompt, *generated])
        messages += [
            carried({"role": "assistant", "content": "aba"}, prompt, generated),
            {"role": "user", "content": f"turn {turn}"},
        ]
    final = builder.build(messages)
    assert all(final[: len(s)] == s for s in sequences)


def test_a_turn_cut_off_without_eos_gets_the_templates_end_of_turn():
    tokenizer = bpe_tokenizer()
    builder = PromptBuilder(tokenizer)
    prompt = builder.build([{"role": "user", "content": "hi"}])
    cut = ids_of(tokenizer, "abc")  # no EOS: max_tokens reached
    messages = [
        {"role": "user", "content": "hi"},
        carried({"role": "assistant", "content": "abc"}, prompt, cut),
        {"role": "user", "content": "more"},
    ]
    spliced = builder.build(messages)
    assert spliced[: len(prompt) + len(cut) + 1] == [*prompt, *cut, tokenizer.eos_token_id]


def test_a_think_stripping_template_splices_at_the_counted_turn_not_the_last_eos():
    tokenizer = bpe_tokenizer(THINK_STRIPPING_TEMPLATE)
    builder = PromptBuilder(tokenizer)
    eos = tokenizer.eos_token_id
    first = [{"role": "user", "content": "q"}]
    prompt = builder.build(first)
    generated = [*ids_of(tokenizer, "<think>long reasoning here</think>42"), eos]
    reply = carried({"role": "assistant", "content": "42"}, prompt, generated)
    messages = [*first, reply, {"role": "user", "content": "ok"}]
    required = [*prompt, *generated]

    spliced = builder.build(messages)
    new_turn = [*ids_of(tokenizer, "<|user|>ok"), eos, *ids_of(tokenizer, "<|assistant|>")]
    assert spliced == [*required, *new_turn]

    # verl-style "cut at the last end-of-turn before the carried length": the rendering strips
    # the think block, so it is shorter than the carried ids and that cut falls after the new
    # user turn, dropping it.
    full = builder.render_ids(normalize_messages(messages))
    last_eos = max(i for i, t in enumerate(full[: len(required) - 1]) if t == eos)
    naive = [*required[:-1], *full[last_eos:]]
    assert naive != spliced
    assert ids_of(tokenizer, "ok")[0] not in naive[len(required) :]


def test_an_edited_history_is_refused_naming_the_message():
    tokenizer = bpe_tokenizer()
    builder = PromptBuilder(tokenizer)
    prompt = builder.build([{"role": "user", "content": "hi"}])
    generated = [*ids_of(tokenizer, "abc"), tokenizer.eos_token_id]
    edited = carried({"role": "assistant", "content": "something else"}, prompt, generated)
    with pytest.raises(PromptError, match=r"messages\[1\] \(assistant\).*edited"):
        builder.build([{"role": "user", "content": "hi"}, edited, {"role": "user", "content": "x"}])

    # An earlier turn whose ids the later turn's prompt does not start with.
    first = carried({"role": "assistant", "content": "abc"}, prompt, generated)
    second = carried({"role": "assistant", "content": "c"}, [9, 9, 9], ids_of(tokenizer, "c"))
    with pytest.raises(PromptError, match=r"messages\[1\].*messages\[3\]"):
        builder.build(
            [
                {"role": "user", "content": "hi"},
                first,
                {"role": "user", "content": "x"},
                second,
                {"role": "user", "content": "y"},
            ]
        )


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ([{"content": "no role"}], r"messages\[0\] must be an object with a string `role`"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "a",
                    "prompt_token_ids": [1],
                    "generation_token_ids": "x",
                },
            ],
            r"messages\[1\] \(assistant\).generation_token_ids must be a list of token ids",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "a",
                    "prompt_token_ids": [1],
                    "generation_token_ids": [2, 3],
                    "generation_log_probs": [-1.0],
                },
            ],
            "2 generation_token_ids but 1 generation_log_probs",
        ),
    ],
)
def test_bad_messages_get_one_line_naming_what_is_wrong(messages, match):
    with pytest.raises(PromptError, match=match):
        PromptBuilder(bpe_tokenizer()).build(messages)


def test_openai_shapes_become_what_templates_render():
    normalized = normalize_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, "brief"]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
                "prompt_token_ids": [1],
                "generation_token_ids": [2],
            },
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
        ]
    )
    assert normalized[0] == {"role": "system", "content": "be brief"}
    assert normalized[1]["content"] == ""
    assert normalized[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert "prompt_token_ids" not in normalized[1]
    assert normalized[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


def test_the_tiny_template_renders_tool_free_chats_exactly_as_before():
    from nrl_core.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    old_template = (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    chat = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "and 1+1="},
    ]
    for generation_prompt in (True, False):
        new = tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=generation_prompt
        )
        old = tokenizer.apply_chat_template(
            chat,
            chat_template=old_template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        assert new == old
