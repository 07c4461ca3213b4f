"""Steps per minute of synchronous GRPO, today's asynchronous GRPO (whole batches) and
asynchronous GRPO with group streaming and in-flight refits, on a long-tailed length
distribution, measured in one run (issue 51).

    uv run nox -s bench-async [-- --steps 12 --warmup 2 --rounds 2 --engines 2 KEY=VALUE ...]
    uv run python benchmarks/async_grpo.py [same arguments]

The workload: the main job's recipe (``nrl run grpo``, actors in this interpreter, its batch of
16 prompts x 16 generations, 2 policy ranks) on ``--prompts`` prompts (default 16: every
step the same lengths) whose responses have the
packing benchmark's long-tailed lengths (``packing.lengths_for``: log-normal, median
``--longest / 8``, a ~10x spread between the 5th and 95th percentile, cut to [8, longest]).
The tiny model is first fine-tuned (:func:`nrl_core.testing.tiny.memorize`) to answer prompt
``i`` with ``L_i`` letters and EOS, so that the lengths come from the model itself through the
real generation path, per prompt (a group is long or short as a whole, the case that streaming
is for); the reward is ``exact_match`` of that answer, so GRPO keeps the lengths where they are.
``generation.max_new_tokens`` leaves ``--longest / 4`` tokens of room for samples that run on.

Three configurations, every one on ``--engines`` separate torch engines
(``generation.colocated=false``):

- ``sync``: the synchronous loop;
- ``async_batch``: ``grpo.async.enabled=true``, age 1, whole-step calls
  (``groups_per_call=0``), refits waiting for the calls in flight (today's async);
- ``async_inflight``: the same age plus ``groups_per_call=--groups-per-call`` (groups handed to
  the trainer as their call ends), ``in_flight_weight_updates=true`` and, with
  ``--max-tokens-per-call`` > 0, partial rollouts.

The configurations take turns in ``--rounds`` rounds (the order rotates each round, so a machine
whose speed drifts favours none); each run trains ``--steps`` steps and its first ``--warmup``
are dropped. Per configuration it prints the median step seconds, steps per minute (steps
measured over the sum of their step times, all rounds), each round's steps per minute, and the
engines' idle fraction (async: ``async/engine_idle_fraction``; sync: the share of the step
outside ``timing/generation_s``, the only time the engines work; async_inflight's is an
under-estimate: the core's ``WeightGate.busy_s`` adds up the seconds of calls that overlap, as
streaming's concurrent calls do, so it reads 0 whenever two calls were in flight most of the
step). The last line is
``inflight_over_batch_async=<async_inflight steps per minute / async_batch steps per minute>``.

Trailing ``KEY=VALUE`` arguments are config overrides for every configuration (after the
benchmark's own, so they win), e.g. ``grpo.num_generations_per_prompt=8``.

TODO (issue 51 item 7, not built yet): ``--convergence``, reward per step and per wall-clock
minute of the synchronous loop against async at ages 1 and 2, 3 seeds, on the main job (the
arithmetic recipe, validation accuracy at the end against the synchronous band).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from grpo_step import run_grpo

SEPARATE = ["generation.colocated=false", "generation.num_engines=1"]
ASYNC = ["grpo.async.enabled=true", "grpo.async.max_trajectory_age_steps=1"]
"""The separate-engine async configuration at age 1 (benchmarks/vs_trl.py's ``async`` too)."""

CONFIGS = ("sync", "async_batch", "async_inflight")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; bad ones are one line and exit 2 (before the model is built)."""
    parser = argparse.ArgumentParser(
        prog="async_grpo.py", description=__doc__.splitlines()[0], add_help=True
    )
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped per run (2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration (2)")
    parser.add_argument("--engines", type=int, default=2, help="separate torch engines (2)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts (16)")
    parser.add_argument("--longest", type=int, default=128, help="longest answer, tokens (128)")
    parser.add_argument(
        "--groups-per-call", type=int, default=2, help="async_inflight's groups per call (2)"
    )
    parser.add_argument(
        "--max-tokens-per-call",
        type=int,
        default=0,
        help="async_inflight's partial rollouts, tokens per call (0: off)",
    )
    parser.add_argument("--seed", type=int, default=1, help="lengths and run seed (1)")
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE (every run)")
    args = parser.parse_args(argv)

    def bad(message: str) -> None:
        sys.stderr.write(f"async_grpo.py: {message}\n")
        raise SystemExit(2)

    for name in ("steps", "rounds", "engines", "prompts", "groups_per_call"):
        if getattr(args, name) < 1:
            bad(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    if args.warmup < 0 or args.max_tokens_per_call < 0:
        bad("--warmup and --max-tokens-per-call must be 0 or more")
    if args.steps <= args.warmup:
        bad(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.longest < 8:
        bad(f"--longest ({args.longest}) must be at least 8 (the shortest answer)")
    for item in args.overrides:
        if "=" not in item:
            bad(f"overrides must be KEY=VALUE, got {item!r}")
    return args


def answer(length: int) -> str:
    """Prompt answers: the alphabet over and over, ``length`` letters (easy to memorize: the
    model only has to learn where each prompt's answer ends)."""
    return (LETTERS * (length // len(LETTERS) + 1))[:length]


def build_workload(root: Path, prompts: int, longest: int, seed: int) -> tuple[Path, Path]:
    """Memorize ``prompts`` long-tailed answers into the tiny model (cached under
    ``$NRL_CACHE_DIR``, default ``~/.cache/nrl``: minutes on a loaded 2-core machine); write the
    prompts JSONL under ``root``; return (model folder, prompts JSONL)."""
    from filelock import FileLock
    from packing import lengths_for
    from transformers import AutoTokenizer

    from nrl_core.algorithms.rollout import ChatCodec
    from nrl_core.testing.tiny import memorize, tiny_model_path

    source = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(source)
    codec = ChatCodec(tokenizer)
    lengths = lengths_for("long_tailed", prompts, longest, seed=seed)
    order = list(range(prompts))
    random.Random(seed).shuffle(order)  # long and short prompts mixed in every step
    rows, examples = [], []
    for index in order:
        prompt, text = f"item {index}", answer(lengths[index])
        rows.append({"prompt": prompt, "answer": text})
        ids = codec.encode_prompt([{"role": "user", "content": prompt}])
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]
        examples.append((ids, [*completion, tokenizer.eos_token_id]))
    cache = Path(os.environ.get("NRL_CACHE_DIR", Path.home() / ".cache" / "nrl"))
    key = hashlib.sha256(json.dumps([source.name, examples, seed]).encode()).hexdigest()[:12]
    model = cache / f"async-bench-{key}"
    with FileLock(f"{model}.lock"):
        if not (model / ".complete").exists():
            memorize(source, model, examples, max_steps=3000, seed=seed)
            (model / ".complete").touch()
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def workload(model: Path, data: Path, longest: int, seed: int) -> list[str]:
    """The overrides every configuration shares: the memorized model on its prompts."""
    new_tokens = longest + longest // 4
    return [
        f"seed={seed}",
        f"policy.model_name={model}",
        f"policy.max_total_sequence_length={new_tokens + 16}",
        f"generation.max_new_tokens={new_tokens}",
        "data.dataset=prompts",
        f"data.prompts.path={data}",
        "env.name=exact_match",
    ]


def configs(engines: int, groups_per_call: int, max_tokens_per_call: int) -> dict[str, list]:
    """Each configuration's overrides (on top of :func:`workload`)."""
    separate = ["generation.colocated=false", f"generation.num_engines={engines}"]
    inflight = [
        f"grpo.async.groups_per_call={groups_per_call}",
        "grpo.async.in_flight_weight_updates=true",
        f"grpo.async.max_tokens_per_call={max_tokens_per_call}",
    ]
    return {
        "sync": separate,
        "async_batch": [*separate, *ASYNC, "grpo.async.groups_per_call=0"],
        "async_inflight": [*separate, *ASYNC, *inflight],
    }


def idle_fraction(record: dict) -> float:
    """The share of a step in which the engines did not generate."""
    if "async/engine_idle_fraction" in record:
        return record["async/engine_idle_fraction"]
    return 1 - record["timing/generation_s"] / record["timing/step_s"]


def steps_per_minute(records: list[dict]) -> float:
    return 60 * len(records) / sum(r["timing/step_s"] for r in records)


def summarize(runs: dict[str, list[list[dict]]]) -> list[str]:
    """The table's lines and the last line from each configuration's runs (one list of
    steady-step records per round)."""
    lines = [
        f"{'config':<16}{'step_s':>9}{'steps/min':>11}{'engine_idle':>13}{'resp_len':>10}  rounds"
    ]
    rates = {}
    for name, rounds in runs.items():
        records = [r for run in rounds for r in run]
        rates[name] = steps_per_minute(records)
        per_round = " ".join(f"{steps_per_minute(run):.1f}" for run in rounds)
        # The workload's own check: the lengths stay long-tailed as trained (a drift shows).
        length = statistics.mean(r["train/response_length_mean"] for r in records)
        lines.append(
            f"{name:<16}{statistics.median(r['timing/step_s'] for r in records):>9.3f}"
            f"{rates[name]:>11.1f}{statistics.median(map(idle_fraction, records)):>13.2f}"
            f"{length:>10.1f}  {per_round}"
        )
    lines.append(f"inflight_over_batch_async={rates['async_inflight'] / rates['async_batch']:.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = build_workload(root, args.prompts, args.longest, args.seed)
        shared = workload(model, data, args.longest, args.seed)
        variants = configs(args.engines, args.groups_per_call, args.max_tokens_per_call)
        runs: dict[str, list[list[dict]]] = {name: [] for name in CONFIGS}
        for round_ in range(args.rounds):
            shift = round_ % len(CONFIGS)
            for name in CONFIGS[shift:] + CONFIGS[:shift]:
                log_dir = root / f"{name}-{round_}"
                records = run_grpo(args.steps, [*shared, *variants[name], *args.overrides], log_dir)
                steady = [r for r in records if r["step"] > args.warmup]
                runs[name].append(steady)
                print(
                    f"round {round_} {name}: steps/min={steps_per_minute(steady):.1f}", flush=True
                )
        for line in summarize(runs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
