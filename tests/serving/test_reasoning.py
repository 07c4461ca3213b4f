"""The reasoning split (nrl_core.serving.reasoning), as vLLM's parsers of the same names read
a text."""

from __future__ import annotations

import pytest

from nrl_core.serving.reasoning import split_reasoning


@pytest.mark.parametrize(
    "parser, text, split",
    [
        (None, "<think>a</think>b", (None, "<think>a</think>b")),
        ("deepseek_r1", "<think>a</think>b", ("a", "b")),
        ("deepseek_r1", "a</think>b", ("a", "b")),  # the template opened <think>
        ("deepseek_r1", "<think>a</think>", ("a", "")),
        ("deepseek_r1", "still thinking", ("still thinking", "")),  # cut off while thinking
        ("qwen3", "just an answer", (None, "just an answer")),  # thinking off
        ("qwen3", "<think>a</think>\n\nb", ("a", "\n\nb")),
        ("qwen3", "<think>unfinished", ("unfinished", "")),
        ("qwen3", "a</think>b</think>c", ("a", "b</think>c")),  # the first end closes it
    ],
)
def test_split_reasoning(parser, text, split):
    assert split_reasoning(text, parser) == split
