"""Stage ``generation``: nrl-dtensor's ``TorchGenerator`` over the built model on the device."""

from __future__ import annotations

import time
from typing import Any

from .common import (
    StageContext,
    check,
    peak_memory_gb,
    require_model,
    reset_peak_memory,
    synchronize,
    torch_device,
    torch_dtype,
)


def stage_generation(ctx: StageContext) -> dict[str, Any]:
    """TorchGenerator over the built model on the device: sampled tokens/s."""
    import math

    import torch
    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.interfaces import SamplingParams

    p = ctx.profile
    path = require_model(ctx)
    device = torch_device(ctx)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(p.dtype))
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    generator = TorchGenerator(
        # Fixed-length samples: a random model's EOS would make the token count luck.
        TorchGenerationConfig(generation_batch_size=p.gen_prompts, stop_at_eos=False),
        model=model,
        tokenizer=tokenizer,
        device=device,
    )
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(7, len(tokenizer), (p.gen_prompts, p.gen_prompt_len), generator=g)
    prompts = prompts.tolist()
    params = SamplingParams(max_new_tokens=p.gen_new_tokens, temperature=1.0, seed=0)
    generator.generate(prompts, params)  # warm-up: allocator, kernels
    reset_peak_memory(ctx)
    synchronize(ctx)
    started = time.perf_counter()
    out = generator.generate(prompts, params)
    synchronize(ctx)
    seconds = time.perf_counter() - started
    lengths = {len(t) for t in out.token_ids}
    check(lengths == {p.gen_new_tokens}, f"generated lengths {lengths}, want {p.gen_new_tokens}")
    check(
        all(len(lp) == len(t) for lp, t in zip(out.logprobs, out.token_ids, strict=True)),
        "one logprob per generated token",
    )
    flat = [x for row in out.logprobs for x in row]
    check(all(math.isfinite(x) and x <= 0 for x in flat), "generated logprobs not finite and <= 0")
    vocab = model.config.vocab_size
    check(all(0 <= t < vocab for row in out.token_ids for t in row), "token id out of range")
    tokens = sum(len(t) for t in out.token_ids)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "prompts": p.gen_prompts,
        "new_tokens": p.gen_new_tokens,
        "seconds": round(seconds, 3),
        "peak_mem_gb": round(peak_memory_gb(ctx), 3),
        "dtype": p.dtype,
    }
