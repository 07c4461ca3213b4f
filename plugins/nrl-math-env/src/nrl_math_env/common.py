"""Small helpers shared by the environments: reading the response and integers in it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from nrl_core.data import Message

_INTEGER = re.compile(r"-?\d+")


def response_text(conversation: Sequence[Message]) -> str:
    """The content of the conversation's last message, which must be the assistant's turn."""
    if not conversation or conversation[-1].get("role") != "assistant":
        raise ValueError("the conversation must end with the assistant's response")
    return conversation[-1].get("content") or ""


def last_integer(text: str) -> int | None:
    """The answer an integer task reads from ``text``, or ``None`` when it holds none.

    The text after the last ``=`` is read when there is one (so "12+7=19" and "19" both give
    19), and the last integer in it counts, with its minus sign: "so it is -3." gives -3.
    """
    matches = _INTEGER.findall(text.rpartition("=")[2])
    return int(matches[-1]) if matches else None
