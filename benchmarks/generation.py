"""Tokens/s of nrl's TorchGenerator against ``transformers``' ``model.generate``.

Same model (the tiny-model builder at a few tens of millions of parameters), same prompts,
greedy decoding, fixed output length (EOS ignored by both), measured in the same process after
a warm-up, best of several repeats. Usage::

    .venv/bin/python benchmarks/generation.py [--batch 16] [--prompt-len 32] [--new-tokens 64]

The last line printed is ``torch_gen_tok_s=<float> hf_generate_tok_s=<float> ratio=<float>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    """Build the model, time both generators, print the summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.interfaces import SamplingParams
    from nrl_core.testing.tiny import tiny_model_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as cache:
        path = tiny_model_path(
            cache, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=8, num_kv_heads=4
        )
        model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model: {params_m:.1f}M parameters, device={device}, threads={torch.get_num_threads()}, "
        f"batch={args.batch} prompt_len={args.prompt_len} new_tokens={args.new_tokens}"
    )

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(7, 100, (args.batch, args.prompt_len), generator=g)
    ours = TorchGenerator(
        TorchGenerationConfig(generation_batch_size=args.batch, stop_at_eos=False),
        model=model,
        tokenizer=tokenizer,
        device=device,
    )
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    prompt_lists = prompts.tolist()
    hf_inputs = prompts.to(device)

    def run_ours() -> int:
        out = ours.generate(prompt_lists, sampling)
        return sum(len(t) for t in out.token_ids)

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                hf_inputs,
                attention_mask=torch.ones_like(hf_inputs),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return (out.shape[1] - args.prompt_len) * out.shape[0]

    def best_rate(fn) -> float:
        rates = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates.append(tokens / (time.perf_counter() - start))
        return max(rates)

    # Warm-up both (allocator, kernels), then interleave so machine noise hits both alike.
    run_ours(), run_hf()
    ours_rates, hf_rates = [], []
    for _ in range(2):
        ours_rates.append(best_rate(run_ours))
        hf_rates.append(best_rate(run_hf))
    ours_rate, hf_rate = max(ours_rates), max(hf_rates)
    assert (
        ours.generate(prompt_lists[:2], sampling).token_ids[0]
        == model.generate(
            hf_inputs[:1],
            max_new_tokens=args.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, args.prompt_len :].tolist()
    ), "greedy outputs differ"
    print(
        f"torch_gen_tok_s={ours_rate:.1f} hf_generate_tok_s={hf_rate:.1f} "
        f"ratio={ours_rate / hf_rate:.3f}"
    )


if __name__ == "__main__":
    main()
