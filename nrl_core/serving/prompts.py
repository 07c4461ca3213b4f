"""OpenAI chat messages to prompt token ids, token-exact across turns.

An agent resends its whole conversation as text on every turn. Rendering that text with the
chat template and tokenising it again does not give back the ids that were sampled: a BPE
tokenizer merges or splits differently ("a" "b" sampled, "ab" re-encoded), and tool calls come
back re-serialised. The training sequence would then not be the sequence the model produced.

So every assistant message the endpoint returns carries its ids (``prompt_token_ids``,
``generation_token_ids``, ``generation_log_probs``), and when a request's history holds such a
message, :meth:`PromptBuilder.build` starts the prompt with exactly those ids and appends only
the template's rendering of what came after. The boundary is found by counting end-of-turn ids:
the rendering of the conversation up to and including that assistant message ends with its
N-th end-of-turn id, and the full rendering has the same turn at its N-th end-of-turn id, even
when the template rewrites earlier turns (Qwen3 and DeepSeek-R1 strip ``<think>`` blocks from
past assistant turns: the text before the boundary changes, the number of turns does not).
Cutting at "the last end-of-turn before the carried length" instead picks the wrong place as
soon as the rendering of the history is shorter than the carried ids, and drops what follows.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""NeMo RL's names for the ids an assistant message carries (NeMo Gym reads and resends them)."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eot|>")
"""Special tokens that close a chat turn in common templates, counted next to the EOS token."""


class PromptError(ValueError):
    """A request whose messages cannot become a prompt (answered with HTTP 400)."""


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI (and Responses-API-converted) messages as Hugging Face chat templates expect them.

    Content given as a list of parts becomes one string and a null content an empty one; the
    ``developer`` role (sent by NeMo Gym) becomes ``system``; an assistant's tool-call
    arguments given as a JSON string become a dict (what HF templates render); the carried
    token fields are left out (they are read by :meth:`PromptBuilder.build`).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise PromptError("`messages` must be a non-empty list of {role, content} objects")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{index}] must be an object with a string `role`")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered: dict[str, Any] = {"role": role, "content": _text(message.get("content"), index)}
        if message.get("tool_calls"):
            rendered["tool_calls"] = [_tool_call(c, index) for c in message["tool_calls"]]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                rendered[key] = message[key]
        out.append(rendered)
    return out


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise PromptError(
                    f"messages[{index}].content: only text parts are supported, got {part!r:.80}"
                )
        return "".join(parts)
    raise PromptError(f"messages[{index}].content must be a string or a list of text parts")


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise PromptError(f"messages[{index}].tool_calls: each needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else rendered as the string it is
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {"name": function["name"], "arguments": arguments},
    }


def carried_ids(message: Any, index: int) -> list[int] | None:
    """``prompt_token_ids + generation_token_ids`` of an assistant message that carries both,
    checked (lists of ints, logprobs paired with the generated ids), or None."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    prompt, generated = message.get("prompt_token_ids"), message.get("generation_token_ids")
    if prompt is None and generated is None:
        return None
    for name, value in (("prompt_token_ids", prompt), ("generation_token_ids", generated)):
        if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
        ):
            raise PromptError(
                f"messages[{index}] (assistant).{name} must be a list of token ids "
                "(both prompt_token_ids and generation_token_ids, as the endpoint returned them)"
            )
    logprobs = message.get("generation_log_probs")
    if logprobs is not None and len(logprobs) != len(generated):
        raise PromptError(
            f"messages[{index}] (assistant): {len(generated)} generation_token_ids but "
            f"{len(logprobs)} generation_log_probs"
        )
    return [*prompt, *generated]


class PromptBuilder:
    """Renders chat requests into prompt ids with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        end_of_turn_ids: the ids that close a turn; default the EOS id plus the common
            end-of-turn specials of :data:`END_OF_TURN_TOKENS` the vocabulary has.
    """

    def __init__(self, tokenizer: Any, *, end_of_turn_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        if end_of_turn_ids is None:
            vocab = tokenizer.get_vocab()
            found = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
            eos = tokenizer.eos_token_id
            end_of_turn_ids = [*([eos] if eos is not None else []), *found]
        self.end_of_turn_ids = frozenset(end_of_turn_ids)

    def render_ids(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The template's rendering of ``messages`` (already normalised), tokenised as the
        trainer's :class:`~nrl_core.algorithms.rollout.ChatCodec` does (text first, then ids
        without added special tokens)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                "this model has no chat template, so chat messages cannot be rendered; send "
                "token ids to /inference/v1/generate instead"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template's own error (jinja raise_exception, bad shape)
            raise PromptError(f"the chat template cannot render these messages: {exc}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def build(
        self,
        messages: Sequence[Any],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt of the next generation: the carried ids of the last assistant message
        that has them, then the template's rendering of everything after it (see the module
        docstring); the plain rendering when no message carries ids."""
        normalized = normalize_messages(messages)
        carried = [(i, ids) for i, m in enumerate(messages) if (ids := carried_ids(m, i))]
        full = self.render_ids(
            normalized, tools, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs
        )
        if not carried:
            return full
        last, required = carried[-1]
        for index, ids in carried[:-1]:
            self._check_continues(ids, required, index, last)
        self._check_text(messages[last], last)
        prefix = self.render_ids(
            normalized[: last + 1],
            tools,
            add_generation_prompt=False,
            chat_template_kwargs=chat_template_kwargs,
        )
        if required and required[-1] in self.end_of_turn_ids:
            required = required[:-1]  # the template's own end-of-turn follows (below)
        turns = sum(1 for i in prefix if i in self.end_of_turn_ids)
        boundary = self._nth_end_of_turn(full, turns)
        if turns == 0 or boundary is None:
            raise PromptError(
                f"messages[{last}] (assistant) carries token ids, but the chat template renders "
                f"{turns} end-of-turn tokens up to it and the conversation does not continue "
                "after it in a way that can be spliced; send the history as the endpoint "
                "returned it, or drop the token fields to have it re-rendered"
            )
        return [*required, *full[boundary:]]

    def _nth_end_of_turn(self, ids: Sequence[int], n: int) -> int | None:
        seen = 0
        for position, token in enumerate(ids):
            if token in self.end_of_turn_ids:
                seen += 1
                if seen == n:
                    return position
        return None

    def _check_continues(self, earlier: list[int], later: list[int], index: int, last: int):
        """An earlier turn's ids must open the later turn's prompt (the endpoint built it so)."""
        trimmed = earlier[:-1] if earlier and earlier[-1] in self.end_of_turn_ids else earlier
        if later[: len(trimmed)] != trimmed:
            raise PromptError(
                f"messages[{index}] (assistant) carries token ids that messages[{last}]'s "
                "prompt_token_ids do not start with: the history was edited after it was "
                "generated; send it back unchanged, or drop the token fields of both"
            )

    def _check_text(self, message: dict[str, Any], index: int) -> None:
        """The message's text must still be what its generated ids say."""
        content = _text(message.get("content"), index).strip()
        ids = message.get("generation_token_ids") or []
        generated = self.decode(ids)
        if content and content not in generated:
            # A parser may read special tokens (Mistral's [TOOL_CALLS]) that stay in content.
            generated = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        if content and content not in generated:
            raise PromptError(
                f"messages[{index}] (assistant): its content is not the text of its "
                "generation_token_ids (the message was edited); send it back unchanged, or "
                "drop its token fields to have it re-rendered"
            )

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
