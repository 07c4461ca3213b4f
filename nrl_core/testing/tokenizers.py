"""Tokenizers for testing token-exact prompts (:mod:`nrl_core.serving.prompts`): a BPE
vocabulary where re-encoding decoded text gives other ids, and chat templates that render
history plainly or strip ``<think>`` blocks from past assistant turns (as Qwen3's does)."""

from __future__ import annotations

EOS = "<|eos|>"
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Like Qwen3's: past assistant turns lose their <think>...</think> block.
THINK_STRIPPING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|assistant|>' + m['content'].split('</think>')[-1] + eos_token }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def bpe_tokenizer(template: str = PLAIN_TEMPLATE):
    """A BPE tokenizer over a few characters with the merge a + b -> "ab": the ids "a", "b"
    (two tokens, as a model may sample them) decode to text that encodes to "ab" (one)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", EOS, "<|user|>", "<|assistant|>", "<|tool|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 ?+=<>/")
    vocab = {t: i for i, t in enumerate([*specials, *chars, "ab"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token="<|pad|>",
        additional_special_tokens=specials[2:],
    )
    tokenizer.chat_template = template
    return tokenizer


def ids_of(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` alone (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


MISTRAL_SPECIALS = ("[TOOL_CALLS]", "[ARGS]")
"""Mistral's tool-call special tokens (decoding with ``skip_special_tokens`` drops them)."""


def mistral_tokenizer(template: str = PLAIN_TEMPLATE):
    """A character-level tokenizer (printable ASCII) whose special tokens include Mistral's
    :data:`MISTRAL_SPECIALS`, for testing the ``mistral`` tool parser."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", EOS, "<|unk|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate([*specials, *MISTRAL_SPECIALS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=[*specials[3:], *MISTRAL_SPECIALS],
    )
    tokenizer.chat_template = template
    return tokenizer
