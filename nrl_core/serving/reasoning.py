"""Reasoning split out of generated text (``server.reasoning_parser``, vLLM's
``--reasoning-parser`` names): ``<think>…</think>`` goes to the message's
``reasoning_content`` (and ``reasoning``, the name vLLM >= 0.16 answers with), the rest is its
content. Only the text is split: the token ids (and log probs) stay what was sampled, so
training sees the reasoning tokens, and a later turn carrying the ids stays token-exact.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""The parsers :func:`split_reasoning` knows (vLLM's names for them)."""
START, END = "<think>", "</think>"


def split_reasoning(text: str, parser: str | None) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a generated text under ``parser`` (None: no split).

    As vLLM's parsers read it: a leading ``<think>`` is optional (templates often put it in the
    prompt), the reasoning ends at the first ``</think>``, and everything after it is the
    content. Without ``</think>``: ``deepseek_r1`` reads the whole text as (unfinished)
    reasoning; ``qwen3`` reads a text with no think tag at all as content (a model answering
    with thinking off), and one that opened ``<think>`` as reasoning.
    """
    if parser is None:
        return None, text
    if parser == "qwen3" and START not in text and END not in text:
        return None, text
    before, opened, after = text.partition(START)
    rest = after if opened else before
    if END not in rest:
        return rest, ""
    reasoning, _, content = rest.partition(END)
    return reasoning, content
