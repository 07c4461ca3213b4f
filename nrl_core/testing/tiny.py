"""A tiny Llama/Qwen2-style causal LM (or a Qwen3-MoE mixture of experts) and tokenizer, built locally for tests, demos and benchmarks.

Everything is written with ``save_pretrained`` so that every consumer loads it through the real
``from_pretrained`` path, exactly like a hub model. The tokenizer is character level: every
printable ASCII character (digits, ``+ - * = ( )``, letters, punctuation, space, newline) is one
token, so small integer arithmetic ("12+7=" -> "19") is easy to learn. A Jinja chat template
renders ``system``/``user``/``assistant`` turns and supports ``add_generation_prompt``.

``policy.model_name: tiny`` resolves (through :func:`resolve_model_name`) to a copy cached under
``~/.cache/nrl/tiny-<hash>``, built once under a file lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

BUILDER_VERSION = "4"
"""Bump when the builder's output changes, so cached copies are rebuilt."""

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

# Each turn is "<|role|>content<|eos|>"; the assistant's own <|eos|> is what generation stops on.
# Tools render the Hermes way without new tokens: a system turn listing them (merged with the
# conversation's own system prompt), assistant calls as <tool_call>JSON</tool_call> after the
# content, and tool results as a user turn wrapped in <tool_response>. A conversation without
# tools renders exactly as it did before tools were supported.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 0 %}"
    "{% if tools %}"
    "{{ '<|system|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}"
    "{% set first = 1 %}{% endif %}"
    "{{ 'You may call tools. Available tools:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}"
    '{{ \'</tools>\nTo call one, answer <tool_call>{"name": ..., "arguments": {...}}\''
    " + '</tool_call>' + eos_token }}"
    "{% endif %}"
    "{% for message in messages[first:] %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>\n' + message['content'] + '\n</tool_response>' + eos_token }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\n' + {'name': call['function']['name'],"
    " 'arguments': call['function']['arguments']} | tojson + '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The default test model: ~0.9M parameters, fast on two CPU cores.
DEFAULT_SIZE = {"hidden_size": 128, "num_layers": 4}


def _characters() -> list[str]:
    # string.printable minus the exotic whitespace (\r, \x0b, \x0c) that chat text never holds.
    return [c for c in string.printable if c not in "\r\x0b\x0c"]


def build_tokenizer():
    """The character-level ``PreTrainedTokenizerFast`` with its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _characters():
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token ("[\\s\\S]" also matches the newline, unlike ".").
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the pieces: the default WordLevel decoding would insert spaces.
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    attention_chunk_size: int = 16,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised ``arch`` (one of :data:`ARCHS`) model and its tokenizer into
    ``path`` with ``save_pretrained``; return the folder.

    ``qwen3_moe``: every decoder layer's MLP is a mixture of ``num_experts`` experts (each of
    ``intermediate_size`` / ``num_experts_per_tok`` width, so that the active parameters per
    token match a dense MLP of ``intermediate_size``), of which a learned router picks the top
    ``num_experts_per_tok`` per token (1 <= ``num_experts_per_tok`` <= ``num_experts``).
    ``num_experts`` and ``num_experts_per_tok`` are ignored by the dense architectures.
    ``attention_chunk_size`` (Llama 4 only, >= 1): the tokens of each attention chunk; 16
    keeps the chunking inside short test sequences, vLLM's CPU build needs a multiple of its
    KV block size (128).

    The newer families (issue 48), each at its published layer pattern, tiny:

    - ``qwen3_5``: Qwen3.5's text model (``model_type`` ``qwen3_5_text``): every
      ``num_layers // 4``-th layer is full attention (gated, partial rotary), the others Gated
      DeltaNet linear attention; a dense MLP.
    - ``qwen3_5_moe``: the same attention pattern, every MLP a mixture of ``num_experts`` with a
      gated shared expert (``qwen3_5_moe_text``).
    - ``gpt_oss``: attention with learned sinks, alternating sliding-window (8 tokens) and full
      layers, a biased MoE with the clamped SwiGLU.
    - ``llama4``: Llama 4's text model (``llama4_text``): a MoE with a shared expert in every
      layer, chunked attention (``attention_chunk_size`` tokens) with every fourth layer full
      and without RoPE (NoPE), L2 norm of q and k.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    # A vocabulary rounded up to a multiple of 64 keeps matmuls aligned; extra rows are unused.
    vocab_size = -(-len(tokenizer) // 64) * 64
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 3 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    moe = arch in ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "llama4")
    if moe and not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok={num_experts_per_tok} must be in [1, {num_experts}]")
    head_dim = hidden_size // num_heads  # the families' defaults (64 to 256) are no tiny size
    expert_size = common["intermediate_size"] // num_experts_per_tok
    if arch == "qwen3_moe":
        common.update(
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=expert_size,
            norm_topk_prob=True,
        )
    elif arch in ("qwen3_5", "qwen3_5_moe"):
        common.update(
            head_dim=head_dim,
            # Gated DeltaNet heads: 2 key heads shared by 4 value heads, as the published 2:1.
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                for i in range(num_layers)
            ],
        )
        if arch == "qwen3_5_moe":
            common.update(
                num_experts=num_experts,
                num_experts_per_tok=num_experts_per_tok,
                moe_intermediate_size=expert_size,
                shared_expert_intermediate_size=expert_size,
            )
            del common["intermediate_size"]
    elif arch == "gpt_oss":
        common.update(
            head_dim=head_dim,
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            intermediate_size=expert_size,
            sliding_window=8,
            # The published YaRN, its original context shrunk with the tiny one (transformers
            # warns when the factor does not match the two lengths).
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": max_position_embeddings // 32,
            },
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ],
        )
    elif arch == "llama4":
        common.update(
            head_dim=head_dim,
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            intermediate_size=expert_size,
            intermediate_size_mlp=common["intermediate_size"],
            attention_chunk_size=attention_chunk_size,
            # The published 10**13 floor would leave the temperature tuning inert at tiny lengths.
            floor_scale=8,
        )
    config = getattr(transformers, ARCHS[arch])(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if arch == "llama4":
        # vLLM 0.32 reads Llama 4's attention temperature tuning from generation_config.json
        # and turns it off below 32K context when that does not say (llama4.py,
        # Llama4ForCausalLM.__init__); transformers applies the config's (on by default).
        # A generation config derived from the model config ("_from_model_config": true in the
        # file) drops every key GenerationConfig does not define when it is loaded
        # (transformers 5.19 and 5.24, GenerationConfig.__init__), so vLLM would not see the
        # flag: the derived mark goes, the flag stays.
        model.generation_config._from_model_config = False
        model.generation_config.attn_temperature_tuning = config.attn_temperature_tuning
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


ARCHS: dict[str, str] = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "gpt_oss": "GptOssConfig",
    "llama4": "Llama4TextConfig",
}
"""The architectures :func:`build_tiny_model` builds, with their transformers config class."""


@contextlib.contextmanager
def _no_progress_bars():
    """Transformers' progress bars off (``Writing model shards``, issue 39: in the driver of
    `nrl run`, where the tiny model is built, it reached the console that third-party output
    must not); as they were afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _cache_key(kwargs: dict) -> str:
    import transformers

    payload = json.dumps(
        {"v": BUILDER_VERSION, "transformers": transformers.__version__.split(".")[0], **kwargs},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def tiny_model_path(cache_dir: str | os.PathLike | None = None, **kwargs) -> Path:
    """The cached tiny model folder, built on first use (safe across concurrent processes).

    ``kwargs`` go to :func:`build_tiny_model` and are part of the cache key.
    """
    from filelock import FileLock

    kwargs = {**DEFAULT_SIZE, **kwargs}
    root = Path(cache_dir or os.environ.get("NRL_CACHE_DIR", Path.home() / ".cache" / "nrl"))
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-{_cache_key(kwargs)}"
    marker = target / ".complete"
    with FileLock(str(target) + ".lock"):
        if not marker.exists():
            build_tiny_model(target, **kwargs)
            marker.touch()
    return target


NAMED_SIZES: dict[str, dict[str, int | str]] = {
    "tiny": {},
    # A smaller student for the distillation demo (~0.1M parameters): same tokenizer.
    "tiny-small": {"hidden_size": 64, "num_layers": 2},
    # A Qwen3-MoE mixture of experts (4 experts, top-2), the same tokenizer; ~1.4M parameters.
    "tiny-moe": {"arch": "qwen3_moe"},
    # The newer families (issue 48; build_tiny_model says what each holds), the same tokenizer.
    "tiny-qwen3_5": {"arch": "qwen3_5"},
    "tiny-qwen3_5_moe": {"arch": "qwen3_5_moe"},
    "tiny-gpt_oss": {"arch": "gpt_oss"},
    "tiny-llama4": {"arch": "llama4"},
}
"""The locally built models a ``model_name`` may name, with their sizes."""


def resolve_model_name(name: str) -> str:
    """Map ``"tiny"`` (and the other :data:`NAMED_SIZES`) to the cached tiny model folder;
    pass every other name through."""
    return str(tiny_model_path(**NAMED_SIZES[name])) if name in NAMED_SIZES else name


def lora_adapter_bytes(rank: int, name: str = "tiny", dtype_bytes: int = 4) -> int:
    """Bytes of rank-``rank`` LoRA adapters on the seven projections of every layer of the
    named tiny model (``A``: rank x in, ``B``: out x rank): what an adapter-only refit of
    nrl-dtensor's default ``lora_target_modules`` moves, in float32 by default."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_name(name))
    h, i = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # (in, out)
    per_layer = sum(rank * (n_in + n_out) for n_in, n_out in shapes)
    return dtype_bytes * per_layer * config.num_hidden_layers


def tiny_llama_over(tokenizer: Any, path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Save an untrained 2-layer Llama (hidden size 64) sized to ``tokenizer``'s vocabulary,
    with that tokenizer, into ``path``; return the folder. For tests whose tokenizer is their
    subject (a BPE vocabulary, a tool-call format's special tokens) and that then
    :func:`memorize` what the model must say."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def memorize(
    source: str | os.PathLike,
    target: str | os.PathLike,
    examples: list[tuple[list[int], list[int]]],
    *,
    max_steps: int = 600,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Fine-tune the model in ``source`` until greedy decoding continues every example's
    prompt ids with exactly its completion ids, and save it (with the tokenizer) to ``target``.

    For tests that need a model to say something precise (a tool call, a given answer)
    through the real generation path. Plain full-batch Adam on the completion tokens; raises
    ``RuntimeError`` when ``max_steps`` are not enough.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    width = max(len(p) + len(c) for p, c in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    for row, (prompt, completion) in enumerate(examples):
        sequence = [*prompt, *completion]
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(completion)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def reproduces() -> bool:
        with torch.no_grad():
            logits = model(ids).logits.argmax(-1)  # teacher-forced greedy = greedy decoding
        predicted = logits[:, :-1][labels[:, 1:] != -100]
        return bool((predicted == labels[:, 1:][labels[:, 1:] != -100]).all())

    for step in range(max_steps):
        model.train()
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 19 and reproduces():
            break
    else:
        raise RuntimeError(f"the tiny model did not memorize {len(examples)} examples")
    model.eval()
    target = Path(target)
    with _no_progress_bars():
        model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
