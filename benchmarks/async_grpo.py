"""Steps per minute of synchronous GRPO, today's asynchronous GRPO (whole batches) and
asynchronous GRPO with group streaming and in-flight refits, on a long-tailed length
distribution, measured in one run (issue 51).

    uv run nox -s bench-async [-- --steps 12 --warmup 2 --rounds 2 --engines 2 KEY=VALUE ...]
    uv run python benchmarks/async_grpo.py [same arguments]
    uv run nox -s bench-async -- --convergence [--seeds 42,1,2] [--ages 1,2] [--out DIR]

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

``--configs`` runs some of the configurations only (async_batch and async_inflight at least).
``--cpu-profile`` adds, after each run, where its CPU went over the steady steps
(:class:`CpuProfile`: CPU and run-queue seconds per step of the driver, the policy ranks, the
engines, the environment and Ray's own processes, the cores they kept busy and wanted) and the
step's phases (training, refit, the trainer's wait for rollouts, the engines' generation and
idle share): whether the machine has idle time that streaming could fill (docs/async-grpo.md).

``--convergence`` compares learning instead of speed, on the main job (``nrl run grpo``'s
embedded recipe: one-digit addition, 30 supervised warm-up steps, 275 GRPO steps, greedy
validation of 64 problems every 25 steps and at the end), for each of ``--seeds`` (42, 1, 2):

- ``sync``: the main job as the README runs it (``nrl run grpo seed=S``: colocated generation,
  the synchronous loop), the band async has to stay in;
- ``age<A>`` for each of ``--ages`` (1, 2): what a user turns on for async, on the same job:
  ``--engines`` separate torch engines, ``grpo.async.enabled=true``,
  ``max_trajectory_age_steps=A``, streaming (``groups_per_call=--groups-per-call``) and
  ``in_flight_weight_updates=true`` (partial rollouts with ``--max-tokens-per-call`` > 0).

Each run is the whole job (checkpoints included, as a user runs it) in a subprocess; the order
of the configurations rotates from seed to seed. The first table gives per configuration each
seed's final validation accuracy, their mean, the mean of each run's best validation, the mean
trajectory age, the runs' wall time (the subprocess, start-up included) and training time (the
sum of ``timing/step_s``); then the sync band (``[min, max]`` of sync's final accuracies), the
training reward (``train/reward_mean``, mean over seeds) per window of steps and per minute of
training time (the steps whose cumulative ``timing/step_s`` ends in that minute). The last line
is ``async_within_sync_band=<yes|no> age1=<mean> age2=<mean> sync=<min>-<max>``: ``yes`` when
every async configuration's mean final accuracy is at least the band's minimum (above the band
counts as within: the question is whether async loses accuracy) and every run finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
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
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="the configurations to run (default: all three; the last line needs async_batch "
        "and async_inflight)",
    )
    parser.add_argument(
        "--cpu-profile",
        action="store_true",
        help="per run: where the CPU time of the run's processes went (steady steps only)",
    )
    parser.add_argument(
        "--convergence",
        action="store_true",
        help="compare final validation of sync and async (ages --ages) on the main job",
    )
    parser.add_argument("--seeds", default="42,1,2", help="--convergence's seeds (42,1,2)")
    parser.add_argument("--ages", default="1,2", help="--convergence's async ages (1,2)")
    parser.add_argument(
        "--out", default=None, help="--convergence: keep each run's logs under DIR (default: none)"
    )
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
    args.configs = args.configs.split(",")
    if not {"async_batch", "async_inflight"} <= set(args.configs) <= set(CONFIGS):
        bad(
            f"--configs ({','.join(args.configs)}) must name async_batch and async_inflight, "
            f"and nothing but {', '.join(CONFIGS)}"
        )
    for name in ("seeds", "ages"):
        text = getattr(args, name)
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            bad(f"--{name} ({text!r}) must be integers separated by commas, e.g. 1,2")
        if name == "ages" and min(values) < 1:
            bad(f"--ages ({text}) must be 1 or more (age 0 is the synchronous loop)")
        if len(set(values)) != len(values):
            bad(f"--{name} ({text}) repeats a value")
        setattr(args, name, values)
    if args.out is not None and Path(args.out).exists() and any(Path(args.out).iterdir()):
        # The runs go to DIR/<config>-seed<S>: a run folder already there would be resumed
        # (or refused) by `nrl run`, and its records are not this benchmark's to reuse.
        bad(f"--out {args.out} is not empty: name a new or empty folder for the runs' logs")
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


def phases(records: list[dict]) -> str:
    """Where the trainer's step went (medians): training, refit, waiting for rollouts, and
    the engines' side (async: how long a batch took to generate and the share of the step
    they were idle)."""
    keys = [
        ("train_s", "timing/train_s"),
        ("refit_s", "timing/refit_s"),
        ("wait_s", "timing/generation_s"),
        ("logprobs_s", "timing/logprobs_s"),
        ("gen_s", "async/generation_s"),
        ("engine_idle", "async/engine_idle_fraction"),
        ("age", "async/age_mean"),
        ("partial", "async/partial_fraction"),
    ]
    return "step: " + " ".join(
        f"{label}={statistics.median(r[key] for r in records):.3f}"
        for label, key in keys
        if all(key in r for r in records)
    )


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


def convergence_configs(
    ages: list[int], engines: int, groups_per_call: int, max_tokens_per_call: int
) -> dict[str, list[str]]:
    """``--convergence``'s configurations: ``sync`` (the main job as it is) and ``age<A>`` per
    age (async as a user turns it on: separate engines, streaming, in-flight refits)."""
    variants = {"sync": []}
    for age in ages:
        variants[f"age{age}"] = [
            "generation.colocated=false",
            f"generation.num_engines={engines}",
            "grpo.async.enabled=true",
            f"grpo.async.max_trajectory_age_steps={age}",
            f"grpo.async.groups_per_call={groups_per_call}",
            "grpo.async.in_flight_weight_updates=true",
            f"grpo.async.max_tokens_per_call={max_tokens_per_call}",
        ]
    return variants


def run_main_job(seed: int, overrides: list[str], log_dir: Path) -> tuple[list[dict], float]:
    """Run the whole main job (``nrl run grpo``'s embedded recipe, actors in this interpreter)
    with ``seed`` and ``overrides``, logging under ``log_dir``; return its metrics records and
    the subprocess's wall seconds. A failed run raises ``CalledProcessError``."""
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        "-q",
        f"seed={seed}",
        f"logger.log_dir={log_dir}",
        "logger.run_name=job",
        *overrides,
    ]
    start = time.monotonic()
    subprocess.run(command, check=True, env={**os.environ, "NRL_ACTOR_ENV": "system"})
    wall_s = time.monotonic() - start
    lines = (Path(log_dir) / "job" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall_s


def run_figures(records: list[dict], wall_s: float) -> dict:
    """One run's figures: final and best validation accuracy, mean trajectory age, wall and
    training seconds, and ``(cumulative training seconds, step, reward)`` per step."""
    val = [r["val/accuracy"] for r in records if r.get("val/accuracy") is not None]
    steps = [r for r in records if "timing/step_s" in r]
    clock, curve = 0.0, []
    for r in steps:
        clock += r["timing/step_s"]
        curve.append((clock, r["step"], r["train/reward_mean"]))
    ages = [r["async/trajectory_age_mean"] for r in steps if "async/trajectory_age_mean" in r]
    return {
        "final": val[-1],
        "best": max(val),
        "age": statistics.mean(ages) if ages else 0.0,
        "wall_s": wall_s,
        "train_s": clock,
        "curve": curve,
    }


def _mean_or_dash(values: list[float], digits: int = 3) -> str:
    return f"{statistics.mean(values):.{digits}f}" if values else "-"


def convergence_summary(results: dict[str, dict[int, dict | None]], windows: int = 5) -> list[str]:
    """The tables and the last line from each configuration's runs (seed -> :func:`run_figures`,
    or None for a run that failed). The first configuration is the synchronous band's."""
    names = list(results)
    seeds = list(results[names[0]])
    header = f"{'config':<8}" + "".join(f"{'seed' + str(s):>9}" for s in seeds)
    lines = [header + f"{'mean':>8}{'best':>8}{'in_band':>9}{'age':>6}{'wall_s':>9}{'train_s':>9}"]
    band_runs = [f for f in results[names[0]].values() if f is not None]
    band = (min(f["final"] for f in band_runs), max(f["final"] for f in band_runs))
    means, complete = {}, True
    for name in names:
        figures = results[name]
        done = [f for f in figures.values() if f is not None]
        complete &= len(done) == len(figures)
        finals = [f["final"] for f in done]
        means[name] = statistics.mean(finals) if finals else float("nan")
        cells = "".join(
            f"{'failed' if figures[s] is None else format(figures[s]['final'], '.3f'):>9}"
            for s in seeds
        )
        in_band = sum(band[0] <= v for v in finals)
        lines.append(
            f"{name:<8}{cells}{_mean_or_dash(finals):>8}"
            f"{_mean_or_dash([f['best'] for f in done]):>8}{f'{in_band}/{len(figures)}':>9}"
            f"{_mean_or_dash([f['age'] for f in done], 2):>6}"
            f"{_mean_or_dash([f['wall_s'] for f in done], 0):>9}"
            f"{_mean_or_dash([f['train_s'] for f in done], 0):>9}"
        )
    lines.append(
        f"sync band (final validation, {len(band_runs)} seeds): [{band[0]:.3f}, {band[1]:.3f}]"
    )
    # Reward per window of steps and per minute of training time, mean over the seeds.
    curves = {n: [f["curve"] for f in results[n].values() if f is not None] for n in names}
    last_step = max((c[-1][1] for cs in curves.values() for c in cs if c), default=0)
    width = max(1, -(-last_step // windows))
    spans = [(lo, min(lo + width - 1, last_step)) for lo in range(1, last_step + 1, width)]
    lines.append("train reward by step: " + " ".join(f"{lo}-{hi}" for lo, hi in spans))
    for name in names:
        cells = []
        for lo, hi in spans:
            per_seed = [
                statistics.mean(rw for _, st, rw in c if lo <= st <= hi)
                for c in curves[name]
                if any(lo <= st <= hi for _, st, _ in c)
            ]
            cells.append(_mean_or_dash(per_seed))
        lines.append(f"  {name:<8}" + " ".join(cells))
    # minute m holds the steps ending in (m - 1, m] minutes of training time
    longest = max((c[-1][0] for cs in curves.values() for c in cs if c), default=0)
    minutes = max(1, math.ceil(longest / 60))
    lines.append(
        "train reward by minute of training: " + " ".join(str(m + 1) for m in range(minutes))
    )
    for name in names:
        cells = []
        for m in range(minutes):
            per_seed = [
                statistics.mean(rw for t, _, rw in c if m * 60 < t <= (m + 1) * 60)
                for c in curves[name]
                if any(m * 60 < t <= (m + 1) * 60 for t, _, _ in c)
            ]
            cells.append(_mean_or_dash(per_seed))
        lines.append(f"  {name:<8}" + " ".join(cells))
    within = complete and all(means[n] >= band[0] for n in names[1:])
    ages = " ".join(f"{n}={means[n]:.3f}" for n in names[1:])
    lines.append(
        f"async_within_sync_band={'yes' if within else 'no'} {ages} sync={band[0]:.3f}-{band[1]:.3f}"
    )
    return lines


def convergence(args: argparse.Namespace) -> None:
    """``--convergence``: every configuration once per seed, then :func:`convergence_summary`."""
    variants = convergence_configs(
        args.ages, args.engines, args.groups_per_call, args.max_tokens_per_call
    )
    results: dict[str, dict[int, dict | None]] = {name: {} for name in variants}
    names = list(variants)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        for index, seed in enumerate(args.seeds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                log_dir = root / f"{name}-seed{seed}"
                try:
                    records, wall_s = run_main_job(
                        seed, [*variants[name], *args.overrides], log_dir
                    )
                    figures = run_figures(records, wall_s)
                    note = f"final={figures['final']:.3f} wall_s={wall_s:.0f}"
                except subprocess.CalledProcessError as error:  # the table says which failed
                    figures, note = None, f"failed (exit {error.returncode}, logs {log_dir})"
                results[name][seed] = figures
                print(f"seed {seed} {name}: {note}", flush=True)
        for line in convergence_summary({n: results[n] for n in names}):
            print(line, flush=True)


def _role(title: str, driver_pid: int, pid: int) -> str:
    """A process's part in a run from its title: ``driver`` (the ``nrl`` process), the worker
    group of a Ray actor (``ray::nrl-<group>-<rank>[.method]`` -> ``<group>``), or
    ``ray-system`` (Ray's own processes)."""
    if pid == driver_pid:
        return "driver"
    if title.startswith("ray::nrl-"):
        return title.removeprefix("ray::nrl-").split(".")[0].rsplit("-", 1)[0]
    return "ray-system"


def _schedstat(pid: int) -> tuple[int, int] | None:
    """(nanoseconds on a CPU, nanoseconds runnable but waiting for one) of a process, or None
    once it is gone. The CPU time is the kernel's process total (``/proc/<pid>/stat``: every
    thread, those that ended too); the run-queue time is summed over the threads alive now
    (``/proc/<pid>/task/*/schedstat``: a thread that ends takes its share with it, and one
    that ends while it is read is skipped, not the process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # after the command's closing parenthesis: utime and stime are fields 14 and 15
            fields = f.read().rsplit(")", 1)[1].split()
        run = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    wait = 0
    for task in tasks:
        try:
            with open(f"{task.path}/schedstat") as f:
                wait += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return run, wait


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU of the machine so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuProfile:
    """Samples, every ``interval`` seconds while a run goes, the CPU time (on a CPU and
    waiting in the run queue) of every process below this one (or below ``root``), by role (:func:`_role`), and
    how many steps ``metrics`` holds, so that :meth:`report` can take the figures over the
    steady steps only (start-up loads models and starts Ray)."""

    def __init__(self, metrics: Path, interval: float = 0.5, root: int | None = None) -> None:
        import threading

        self.metrics, self.interval, self.root = metrics, interval, root
        self.samples: list[tuple[float, int, tuple[float, float], dict[int, tuple]]] = []
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuProfile:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _steps(self) -> int:
        try:
            return self.metrics.read_text().count('"timing/step_s"')
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        import psutil

        me = psutil.Process(self.root)  # None: this process
        while not self._stop.wait(self.interval):
            counters, driver = {}, None
            # the root itself when given (the run's own driver), else only what it started
            below = me.children(recursive=True)
            for proc in [me, *below] if self.root else below:
                try:
                    cmdline = proc.cmdline()
                except psutil.Error:
                    continue
                if "nrl_core.cli" in cmdline and driver is None:
                    driver = proc.pid
                stat = _schedstat(proc.pid)
                if stat is None:
                    continue
                counters[proc.pid] = stat
                title = " ".join(cmdline)
                # A Ray worker's title names its actor once it holds one; keep the first.
                if self.roles.get(proc.pid, "ray-system") == "ray-system":
                    self.roles[proc.pid] = _role(title, driver or -1, proc.pid)
            self.samples.append((time.monotonic(), self._steps(), _machine_busy(), counters))

    def report(self, warmup: int) -> list[str]:
        """Per role over the steady steps (from the sample that first saw ``warmup`` steps to
        the first that saw the last): CPU seconds per step, run-queue seconds per step, and
        cores busy and wanted on average (``(cpu + run queue) / wall``: more than the machine's cores means
        the role's work was waiting for a CPU, not for another role)."""
        start = next((i for i, s in enumerate(self.samples) if s[1] >= warmup), None)
        # the first sample that saw the last step: after it the run only shuts down
        last = max((s[1] for s in self.samples), default=0)
        end = next((i for i, s in enumerate(self.samples) if s[1] == last), None)
        if start is None or end is None or end <= start:
            return ["cpu profile: no steady steps sampled"]
        (t0, n0, m0, _), (t1, n1, m1, _) = self.samples[start], self.samples[end]
        wall, steps = t1 - t0, n1 - n0
        # Each process from its first sample in the window to its last (a sample that missed
        # it, or a process that ended early, takes nothing away); one that started later
        # counts from its first sample.
        earliest: dict[int, tuple[int, int]] = {}
        latest: dict[int, tuple[int, int]] = {}
        for _, _, _, counters in self.samples[start : end + 1]:
            for pid, stat in counters.items():
                earliest.setdefault(pid, stat)
                latest[pid] = stat
        totals: dict[str, list[float]] = {}
        for pid, (run, wait) in latest.items():
            run0, wait0 = earliest[pid]
            role = totals.setdefault(self.roles.get(pid, "ray-system"), [0.0, 0.0])
            role[0] += (run - run0) / 1e9
            role[1] += max(0, wait - wait0) / 1e9
        machine = (m1[0] - m0[0]) / max(1, m1[1] - m0[1]) * (os.cpu_count() or 1)
        lines = [
            f"  cpu profile: {steps} steps in {wall:.1f} s ({wall / max(1, steps):.3f} s/step), "
            f"machine busy {machine:.2f} of {os.cpu_count()} cores (every process on it)",
            f"  {'role':<14}{'cpu_s/step':>12}{'runq_s/step':>13}{'cores_busy':>12}"
            f"{'cores_wanted':>14}",
        ]
        total = [sum(v[0] for v in totals.values()), sum(v[1] for v in totals.values())]
        rows = [*sorted(totals.items()), ("total", total)]
        for name, (run, wait) in rows:
            lines.append(
                f"  {name:<14}{run / max(1, steps):>12.3f}{wait / max(1, steps):>13.3f}"
                f"{run / wall:>12.2f}{(run + wait) / wall:>14.2f}"
            )
        return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.convergence:
        convergence(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = build_workload(root, args.prompts, args.longest, args.seed)
        shared = workload(model, data, args.longest, args.seed)
        variants = configs(args.engines, args.groups_per_call, args.max_tokens_per_call)
        chosen = [name for name in CONFIGS if name in args.configs]
        runs: dict[str, list[list[dict]]] = {name: [] for name in chosen}
        for round_ in range(args.rounds):
            shift = round_ % len(chosen)
            for name in chosen[shift:] + chosen[:shift]:
                log_dir = root / f"{name}-{round_}"
                overrides = [*shared, *variants[name], *args.overrides]
                if args.cpu_profile:
                    with CpuProfile(log_dir / "bench" / "metrics.jsonl") as profile:
                        records = run_grpo(args.steps, overrides, log_dir)
                else:
                    records = run_grpo(args.steps, overrides, log_dir)
                steady = [r for r in records if r["step"] > args.warmup]
                runs[name].append(steady)
                print(
                    f"round {round_} {name}: steps/min={steps_per_minute(steady):.1f}", flush=True
                )
                if args.cpu_profile:
                    print("\n".join(profile.report(args.warmup)), flush=True)
                    print("  " + phases(steady), flush=True)
        for line in summarize(runs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
