"""Which of nrl's own plugins provides a component, known without the plugin installed.

A recipe or a config can name a component whose plugin this installation lacks (the ``grpo``
recipe's ``arithmetic`` dataset and environment in a venv with only ``nrl-core[dtensor]``).
The registry then knows nothing about the name; this table lets the error name the plugin to
install instead. ``tests/test_first_party.py`` checks it against what the plugins of this
repository register.
"""

from __future__ import annotations

PROVIDED_BY: dict[tuple[str, str], str] = {
    ("policy", "dtensor"): "nrl-dtensor",
    ("policy", "megatron"): "nrl-megatron",
    ("generation", "torch"): "nrl-dtensor",
    ("generation", "vllm"): "nrl-vllm",
    ("generation", "sglang"): "nrl-sglang",
    ("environment", "arithmetic"): "nrl-math-env",
    ("environment", "guess_number"): "nrl-math-env",
    ("environment", "math"): "nrl-math-env",
    ("agent", "nemo_gym"): "nrl-gym",
    ("dataset", "arithmetic"): "nrl-math-env",
    ("dataset", "dapo_math_17k"): "nrl-math-env",
    ("dataset", "gsm8k"): "nrl-math-env",
    ("dataset", "guess_number"): "nrl-math-env",
    ("dataset", "jsonl"): "nrl-math-env",
    ("dataset", "math500"): "nrl-math-env",
    ("dataset", "openmathinstruct2"): "nrl-math-env",
    ("dataset", "word_problems"): "nrl-math-env",
    ("dataset", "nemo_gym_jsonl"): "nrl-gym",
}
"""``(kind, name)`` -> the distribution of this repository that registers it."""


def install_hint(kind: str, name: str) -> str:
    """``"; it comes with the nrl-math-env plugin: install it (uv pip install nrl-math-env)"``
    for a component of nrl's own plugins, else ``""``."""
    plugin = PROVIDED_BY.get((kind, name))
    if plugin is None:
        return ""
    return f"; {kind} {name!r} comes with the {plugin} plugin: install it (uv pip install {plugin})"
