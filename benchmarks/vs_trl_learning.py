"""Learning curves of nrl against TRL's ``GRPOTrainer``: ``vs_trl.py --learning``.

    uv run nox -s bench-trl -- --learning [--seeds 42,1,2] [--steps 100] [--val-period 10]
                                          [--ranks 1,2] [--warm-start 40] [--out DIR]

The workload is :mod:`vs_trl`'s (the same model shape, prompts, reward, batch of 8 prompts x 4
generations, 16 new tokens, temperature 1.0, AdamW at lr 1e-4, no reference model), with:

* one set of problems for every run: 2048 training and 64 validation one-digit additions from
  nrl's ``arithmetic`` dataset with its data seed fixed at 0 (the run seed still decides the
  order and the sampling, on each side);
* a **warm start** both sides share: ``--warm-start`` supervised steps on the training answers
  (plain torch, AdamW 1e-3, 32 problems a step, in this process), saved once and loaded by
  every run, so that RL starts from a policy that answers in the right format and is right
  some of the time (as ``nrl run grpo``'s ``grpo.sft_warmup_steps`` does);
* **validation** every ``--val-period`` steps and at step 0: greedy decoding of the 64
  validation prompts, accuracy by the same reward (nrl: its own validation, ``val/accuracy``;
  TRL: ``model.generate(do_sample=False)`` in a callback, off the clock).

Each seed runs TRL and nrl with each ``--ranks`` value (``policy.num_workers``), the order
rotating from seed to seed. Per side, the table prints the validation accuracy at each
validation step (mean over seeds and the min..max spread), the training reward (mean of the
steps since the previous validation) and the training seconds up to that step (step times
only, validation excluded). The chart ``learning.png`` draws accuracy against steps and against
training seconds, each side's mean with its seed spread as a band. The last line is
``trl_final=<mean> trl_spread=<max-min> nrl<R>_final=<mean> ... nrl_at_least_trl=<bool>``,
true when each nrl configuration's final mean is at least TRL's minus TRL's seed spread.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

VAL_SIZE, TRAIN_SIZE, DATA_SEED = 64, 2048, 0
WARM_START_LR, WARM_START_BATCH = 1e-3, 32


def problems(split: str) -> list[tuple[str, int]]:
    """(expression, value) of nrl's ``arithmetic`` dataset split, data seed 0: the problems
    both sides train and validate on."""
    from nrl_math_env.arithmetic import ArithmeticDataset
    from nrl_math_env.config import ArithmeticDataConfig

    from nrl_core.interfaces import ComponentContext

    options = ArithmeticDataConfig(
        num_digits=1,
        operations=["+"],
        train_size=TRAIN_SIZE,
        validation_size=VAL_SIZE,
        seed=DATA_SEED,
    )
    samples = ArithmeticDataset(options, ComponentContext(config=None, seed=DATA_SEED)).load(split)
    return [(s.messages[0]["content"].removesuffix("="), int(s.answer)) for s in samples]


def warm_start(model_dir: Path, out_dir: Path, steps: int, prompt_text) -> Path:
    """``steps`` supervised AdamW steps on training problems' answers (response = the value
    and EOS, loss on the response only); the model is saved to ``out_dir``."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(DATA_SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR)
    rng = random.Random(DATA_SEED)
    train = problems("train")
    model.train()
    for _ in range(steps):
        rows = []
        for expression, value in rng.sample(train, WARM_START_BATCH):
            prompt = tokenizer(text=prompt_text(expression))["input_ids"]
            answer = tokenizer(text=str(value))["input_ids"] + [tokenizer.eos_token_id]
            rows.append((prompt, answer))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (prompt, answer) in enumerate(rows):
            n = len(prompt) + len(answer)
            ids[i, :n] = torch.tensor(prompt + answer)
            labels[i, len(prompt) : n] = torch.tensor(answer)
            mask[i, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def greedy_accuracy(model, tokenizer, validation, prompt_text, max_new_tokens: int) -> float:
    """The TRL side's validation: greedy responses to the validation prompts, scored by
    nrl-math-env's reward (``last_integer(response) == value``)."""
    import torch
    from nrl_math_env.common import last_integer

    tokenizer.padding_side = "left"
    batch = tokenizer(
        text=[prompt_text(e) for e, _ in validation], return_tensors="pt", padding=True
    )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    if was_training:
        model.train()
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return statistics.fmean(
        float(last_integer(t) == v) for t, (_, v) in zip(texts, validation, strict=True)
    )


# -- the two sides ----------------------------------------------------------------------------


@dataclass
class Curve:
    """One run's learning curve: validation accuracy at validation steps, the training
    reward of each step, and the cumulative training seconds after each step."""

    side: str
    seed: int
    val: dict[int, float] = field(default_factory=dict)
    reward: dict[int, float] = field(default_factory=dict)
    train_s: dict[int, float] = field(default_factory=dict)


def run_trl_curve(model_dir: Path, steps: int, seed: int, val_period: int, out: Path) -> Curve:
    command = [sys.executable, str(Path(__file__).with_name("vs_trl.py")), "--side", "trl"]
    command += ["--model", str(model_dir), "--steps", str(steps), "--out", str(out)]
    command += ["--learning", "--seed", str(seed), "--val-period", str(val_period)]
    result = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    record = json.loads(result.stdout.rstrip("\n").splitlines()[-1])
    curve = Curve("trl", seed, val={int(k): v for k, v in record["val_accuracy"].items()})
    elapsed = 0.0
    for step, (reward, step_s) in enumerate(
        zip(record["reward_mean"], record["step_s"], strict=True), start=1
    ):
        elapsed += step_s
        curve.reward[step], curve.train_s[step] = reward, elapsed
    return curve


def run_nrl_curve(
    model_dir: Path, steps: int, seed: int, val_period: int, ranks: int, out: Path, workload
) -> Curve:
    from grpo_step import run_grpo

    overrides = [
        *workload(model_dir),
        f"seed={seed}",
        f"policy.num_workers={ranks}",
        f"grpo.val_period={val_period}",
        f"data.arithmetic.seed={DATA_SEED}",
        f"data.arithmetic.train_size={TRAIN_SIZE}",
        f"data.arithmetic.validation_size={VAL_SIZE}",
        f"data.max_val_samples={VAL_SIZE}",
    ]
    run_grpo(steps, overrides, out)
    curve = Curve(f"nrl{ranks}", seed)
    elapsed = 0.0
    for line in (out / "bench" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record["step"]
        if "val/accuracy" in record:
            curve.val[step] = record["val/accuracy"]
        if "timing/step_s" in record:  # measured before the step's validation
            elapsed += record["timing/step_s"]
            curve.reward[step], curve.train_s[step] = record["train/reward_mean"], elapsed
    return curve


# -- report -----------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} [{min(values):.2f}..{max(values):.2f}]"


def report(curves: list[Curve], sides: list[str], steps: int, val_period: int, out: Path) -> str:
    """Print the table, draw the chart; return the verdict line."""
    val_steps = sorted(set.intersection(*(set(c.val) for c in curves)))
    if steps not in val_steps:
        sys.exit(f"no validation at the last step {steps}: make --steps a multiple of --val-period")
    by_side = {side: [c for c in curves if c.side == side] for side in sides}
    header = f"{'step':>5} " + " ".join(
        f"{side + ' val acc [seeds]':>26} {'reward':>7} {'train s':>8}" for side in sides
    )
    print("\n" + header)
    for step in val_steps:
        cells = []
        for side in sides:
            runs = by_side[side]
            window = range(max(1, step - val_period + 1), step + 1)
            rewards = [statistics.fmean(c.reward[s] for s in window) for c in runs] if step else []
            seconds = [c.train_s.get(step, 0.0) for c in runs]
            reward = f"{statistics.fmean(rewards):7.3f}" if rewards else f"{'':>7}"
            cells.append(
                f"{_spread([c.val[step] for c in runs]):>26} {reward} {statistics.fmean(seconds):8.1f}"
            )
        print(f"{step:>5} " + " ".join(cells))
    chart = draw(by_side, val_steps, out)
    print(f"chart: {chart}")
    final = {side: [c.val[steps] for c in runs] for side, runs in by_side.items()}
    trl_mean, trl_spread = statistics.fmean(final["trl"]), max(final["trl"]) - min(final["trl"])
    parts = [f"trl_final={trl_mean:.3f}", f"trl_spread={trl_spread:.3f}"]
    ok = True
    for side in sides:
        if side == "trl":
            continue
        mean = statistics.fmean(final[side])
        parts.append(f"{side}_final={mean:.3f}")
        ok = ok and mean >= trl_mean - trl_spread
    return " ".join([*parts, f"nrl_at_least_trl={ok}"])


def draw(by_side: dict[str, list[Curve]], val_steps: list[int], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for side, runs in by_side.items():
        mean = [statistics.fmean(c.val[s] for c in runs) for s in val_steps]
        low = [min(c.val[s] for c in runs) for s in val_steps]
        high = [max(c.val[s] for c in runs) for s in val_steps]
        seconds = [statistics.fmean(c.train_s.get(s, 0.0) for c in runs) for s in val_steps]
        label = f"{side} ({len(runs)} seeds)"
        for ax, x in ((by_step, val_steps), (by_time, seconds)):
            (line,) = ax.plot(x, mean, marker="o", markersize=3, label=label)
            ax.fill_between(x, low, high, alpha=0.15, color=line.get_color())
    by_step.set_xlabel("GRPO step")
    by_time.set_xlabel("training seconds (validation excluded)")
    by_step.set_ylabel("validation accuracy (greedy)")
    by_step.set_ylim(-0.02, 1.02)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle("nrl vs TRL GRPOTrainer: one-digit addition, mean and min..max over seeds")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "learning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args, model_shape: dict, workload, prompt_text) -> None:
    """Run every seed and side (``workload(model_dir)``: the nrl side's overrides)."""
    import tempfile

    from nrl_core.testing.tiny import build_tiny_model

    if args.steps % args.val_period:
        sys.exit(f"--steps ({args.steps}) must be a multiple of --val-period ({args.val_period})")
    seeds = [int(s) for s in args.seeds.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    sides = ["trl", *(f"nrl{r}" for r in ranks)]
    out = Path(args.out or "bench-trl-learning")
    curves: list[Curve] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = build_tiny_model(tmp / "model", **model_shape)
        model_dir = warm_start(base, tmp / "warm", args.warm_start, prompt_text)
        print(f"warm start: {args.warm_start} supervised steps -> {model_dir}", flush=True)
        for index, seed in enumerate(seeds):
            order = sides[index % len(sides) :] + sides[: index % len(sides)]
            for side in order:
                print(f"seed {seed}: {side}, {args.steps} steps ...", flush=True)
                run_out = tmp / f"{side}-{seed}"
                if side == "trl":
                    curve = run_trl_curve(model_dir, args.steps, seed, args.val_period, run_out)
                else:
                    r = int(side.removeprefix("nrl"))
                    curve = run_nrl_curve(
                        model_dir, args.steps, seed, args.val_period, r, run_out, workload
                    )
                curves.append(curve)
                print(
                    f"  final val accuracy {curve.val.get(args.steps, float('nan')):.3f}, "
                    f"{curve.train_s[args.steps]:.1f} training s",
                    flush=True,
                )
        out.mkdir(parents=True, exist_ok=True)
        (out / "curves.json").write_text(json.dumps([c.__dict__ for c in curves]))
    print(report(curves, sides, args.steps, args.val_period, out))
