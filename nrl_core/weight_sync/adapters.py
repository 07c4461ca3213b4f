"""Adapter-only LoRA refits (``generation.lora_refit=adapters``): what the core sends when a LoRA
policy refits engines that keep their base weights.

The engines load the base model once (at start, or by one base-weights refit after a sleep
dropped their weights); each refit then carries only the adapter tensors, in PEFT's saved names
(``base_model.model.<module>.lora_A.weight``, ``...lora_B.weight``), with a
:class:`LoraAdapter` (rank, alpha, target modules, version). The policy plugin yields the
tensors; the engine plugin applies them (peft for the torch engine, vLLM's LoRA support for vLLM,
which loads adapters from a folder only: :func:`write_peft_folder` writes one with safetensors).

An adapter is megabytes where the model is gigabytes, so it travels in the Ray call itself
(:class:`InlineHandle`), whatever ``refit_transport`` moves full weights: it reaches the engine
process that registers the adapter (not the engine's tensor-parallel workers, which are the
NCCL group's members), on any node, colocated or not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from nrl_core.weight_sync.interface import BucketMeta, WeightSyncError

if TYPE_CHECKING:
    import torch

ADAPTERS = "adapters"
MERGED = "merged"

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@attrs.frozen
class LoraAdapter:
    """The settings that go with an adapter refit's tensors (PEFT's ``LoraConfig`` subset an
    engine needs to apply them)."""

    rank: int
    """LoRA rank ``r`` (>= 1)."""
    alpha: float
    """Scaling numerator: the update is ``B @ A * alpha / rank``."""
    target_modules: tuple[str, ...]
    """The module names (last name component, PEFT's ``target_modules``) that carry adapters,
    as the policy resolved them (``all-linear`` expanded)."""
    version: int
    """The refit's number (>= 1, one more each refit of the same engines): engines that cache
    adapters by id (vLLM's ``lora_int_id``) must never reuse a stale one."""
    task_type: str = "CAUSAL_LM"
    """PEFT's ``task_type``: ``CAUSAL_LM``, or ``SEQ_CLS`` for a scalar-head (reward) model,
    whose head then trains whole and travels with the adapters (``modules_to_save``)."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained whole next to the adapters (PEFT's ``modules_to_save``; a scalar
    head's ``score``), whose full weights are among the adapter tensors; empty for none."""

    @property
    def name(self) -> str:
        """The adapter's name at this version (``nrl-lora-v3``)."""
        return f"nrl-lora-v{self.version}"

    def peft_config(self, base_model: str = "") -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for these settings (``base_model``: PEFT's
        ``base_model_name_or_path``, the model the adapters apply to)."""
        return {
            "peft_type": "LORA",
            "task_type": self.task_type,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": list(self.modules_to_save) or None,
            "base_model_name_or_path": base_model,
        }


@attrs.define
class InlineHandle:
    """A bucket whose bytes travel in the call itself (adapter refits: see the module
    docstring). Implements :class:`~nrl_core.weight_sync.BucketHandle`."""

    data: bytes

    def open(self, meta: BucketMeta, device: Any = None) -> torch.Tensor:
        import torch

        if len(self.data) < meta.nbytes:
            raise WeightSyncError(
                f"an inline bucket carries {len(self.data)} bytes; its meta needs {meta.nbytes}"
            )
        flat = torch.frombuffer(bytearray(self.data[: meta.nbytes]), dtype=torch.uint8)
        return flat.to(device) if device is not None else flat

    def close(self) -> None:
        pass


def inline_bucket(tensors: Mapping[str, torch.Tensor]) -> tuple[BucketMeta, InlineHandle]:
    """``tensors`` packed into one bucket whose bytes travel with the call."""
    from nrl_core.weight_sync.packing import pack_bucket

    flat, meta = pack_bucket({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    return meta, InlineHandle(flat.numpy().tobytes())


def write_peft_folder(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    adapter: LoraAdapter,
    *,
    base_model: str = "",
) -> Path:
    """Write ``tensors`` (PEFT-named) and ``adapter``'s config as a PEFT adapter folder
    (``adapter_model.safetensors``, ``adapter_config.json``: no pickle) at ``path``, for an
    engine that loads adapters from disk only and for ``nrl convert --lora adapters``
    (``base_model``: the model the adapters apply to, PEFT's ``base_model_name_or_path``).
    Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        str(folder / ADAPTER_WEIGHTS),
    )
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter.peft_config(base_model), indent=1))
    return folder


def policy_lora_rank(config: Any) -> int:
    """The policy's LoRA rank (0 without LoRA): the ``lora_rank`` of its backend's options, the
    field every policy backend that trains adapters declares (``policy.dtensor.lora_rank``)."""
    policy = getattr(config, "policy", None)
    if policy is None or not hasattr(policy, "options_for"):
        return 0
    return int(getattr(policy.options_for(), "lora_rank", 0) or 0)


def lora_refit_mode(config: Any) -> str | None:
    """How separate engines are refitted from a LoRA policy: ``"adapters"``, ``"merged"``, or
    None without LoRA. ``generation.lora_refit=auto`` is ``adapters`` where the engine's options
    class declares ``accepts_lora_adapters`` (:class:`nrl_core.generation.EngineOptions`)."""
    generation = getattr(config, "generation", None)
    if generation is None or policy_lora_rank(config) <= 0:
        return None
    setting = getattr(generation, "lora_refit", "auto")
    if setting != "auto":
        return setting
    return ADAPTERS if engine_accepts_adapters(generation) else MERGED


def engine_accepts_adapters(generation: Any) -> bool:
    """Whether ``generation``'s backend takes adapter-only refits."""
    return bool(getattr(type(generation.options_for()), "accepts_lora_adapters", False))
