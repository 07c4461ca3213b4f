"""Writing a Hugging Face model folder from a policy's full state dict (one place for every
policy plugin's ``export_hf``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def write_hf_folder(
    path: str | Path,
    state: dict[str, torch.Tensor],
    hf_config: Any,
    tokenizer: Any,
    dtype: torch.dtype,
) -> None:
    """Write ``model.safetensors`` (``state`` in Hugging Face names, cast to ``dtype``),
    ``config.json`` and the tokenizer to ``path``, loadable by ``from_pretrained``.

    A tied ``lm_head.weight`` is left out (safetensors refuses shared storage; the config's
    ``tie_word_embeddings`` restores it on load).
    """
    from safetensors.torch import save_file

    if getattr(hf_config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    config.use_cache = True
    config.dtype = dtype
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
