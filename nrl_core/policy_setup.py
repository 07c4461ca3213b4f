"""What every policy worker derives from the run config, written once: the parameter dtype,
the model folder and tokenizer, and the temperature its logprobs are taken at.

Imported inside the policy actors (it imports torch); the driver never needs it.
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_core.errors import NrlError

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``policy.precision`` values and their torch dtypes."""


def policy_dtype(policy: Any, error: type[NrlError] = NrlError) -> torch.dtype:
    """The dtype ``policy.precision`` names; ``error`` (one line, the fix) when unsupported."""
    if policy.precision not in PRECISIONS:
        raise error(
            f"policy.precision={policy.precision!r} is not supported; use "
            f"{' or '.join(f'`{name}`' for name in PRECISIONS)}"
        )
    return PRECISIONS[policy.precision]


def model_and_tokenizer(policy: Any) -> tuple[str, Any]:
    """``(model folder or hub name, tokenizer)`` of ``policy.model_name`` (``tiny``: the bundled
    tiny model) and ``policy.tokenizer_name`` (default: the model's)."""
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny import resolve_model_name

    model_path = str(resolve_model_name(policy.model_name))
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_name(policy.tokenizer_name or policy.model_name)
    )
    return model_path, tokenizer


def logprob_temperature(config: Any) -> float:
    """The temperature trainer logprobs are computed at: ``log_softmax(logits / T)`` with ``T``
    the run's ``generation.temperature``, so that they match the sampling distribution's
    logprobs; 1 without a generation section or for greedy (``T = 0``) runs."""
    generation = getattr(config, "generation", None)
    temperature = getattr(generation, "temperature", 1.0) if generation is not None else 1.0
    return float(temperature) if temperature and temperature > 0 else 1.0


class LazyReference:
    """The frozen reference model of a policy worker, built on first use (most runs never need
    it) from a Hugging Face folder: the initial model until :meth:`set_path` names another
    (``PolicyWorker.set_reference``).

    Args:
        build: builds the frozen model from a folder, sharded like the policy.
        path: the initial folder (``policy.model_name``).
    """

    def __init__(self, build: Any, path: str) -> None:
        self._build = build
        self.path = path
        self._model: Any = None

    def model(self) -> Any:
        """The reference model (built now if needed: a collective on every rank)."""
        if self._model is None:
            self._model = self._build(self.path)
        return self._model

    @property
    def built(self) -> Any:
        """The reference model if it has been built, else None (never builds it)."""
        return self._model

    def set_path(self, path: str) -> None:
        """Use ``path`` from now on; the model is rebuilt on next use."""
        self.path = path
        self._model = None


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: Any = None) -> None:
    """Move every tensor of a ``torch.optim`` optimizer's state (Adam's moments, step counts
    kept as tensors) to ``device``, or with ``device=None`` each parameter's state to that
    parameter's device: what a policy worker's ``offload(["optimizer"])`` and ``onload()`` do
    for engines colocated on its GPU."""
    for param, state in optimizer.state.items():
        target = param.device if device is None else device
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(target, non_blocking=True)
