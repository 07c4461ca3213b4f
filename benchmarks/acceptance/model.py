"""Stage ``model``: the profile's Qwen2-shaped model and nrl's character tokenizer, built once
per work folder with ``save_pretrained``; every later stage loads it."""

from __future__ import annotations

import json
import platform
import shutil
import time
from typing import Any

from .common import StageContext, torch_dtype


def stage_model(ctx: StageContext) -> dict[str, Any]:
    """Build the profile's Qwen2-shaped model + tokenizer once per workdir."""
    import torch

    target = ctx.model_dir
    info_file = target / "acceptance.json"
    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if ctx.on_gpu else platform.processor(),
    }
    if info_file.exists():
        return {**json.loads(info_file.read_text()), **figures, "cached": True}
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nrl_core.testing.tiny import build_tokenizer

    p = ctx.profile
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=p.vocab_size or -(-len(tokenizer) // 64) * 64,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    started = time.perf_counter()
    # Random init on the device itself: ~0.5B normal draws take minutes on a CPU.
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config)
    # Saved from host memory in the profile's precision (what from_pretrained then reads).
    model = model.to(device="cpu", dtype=torch_dtype(p.dtype))
    params = sum(t.numel() for t in model.parameters())
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    info = {
        "params_m": round(params / 1e6, 1),
        "dtype": p.dtype,
        "vocab_size": config.vocab_size,
        "layers": p.num_layers,
        "hidden_size": p.hidden_size,
        "build_s": round(time.perf_counter() - started, 2),
        "path": str(target),
    }
    (partial / "acceptance.json").write_text(json.dumps(info))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # complete or absent: a killed build is redone next time
    return {**info, **figures, "cached": False}
