"""CPU-seconds per GRPO step and per process of an nrl run (the realistic workload of issue 50).

    uv run python benchmarks/cpu_seconds.py [--steps 4] [--new-tokens 128] [KEY=VALUE ...]
    uv run python benchmarks/cpu_seconds.py generation.backend=vllm generation.actor_env=venv

Runs ``nrl run grpo`` on ``vs_trl.REALISTIC_MODEL`` with ``vs_trl``'s workload overrides (then
the given ones) and samples, every ``--interval`` seconds, the user + system CPU time of every
process of the run's tree (``/proc/<pid>/stat``: the driver, Ray's processes, the policy ranks,
the engine actors and whatever processes they start, e.g. vLLM's engine core and worker). A
step's CPU-seconds per process are the differences between the samples at which
``metrics.jsonl`` gained that step's record and the previous one's.

On a machine shared with other jobs wall times depend on their load; CPU-seconds per process
mostly do not, and they show which processes compute, and which spin, in each step. Each step
prints its wall time, its phases (``timing/*``), the refit's bytes and bytes per second
(``refit/bytes`` / ``timing/refit_s``) and the CPU-seconds of every process group above
``--min-cpu``; the last line is ``median_cpu_s_per_step=<float> <group>=<float> ...`` over the
steps after the first (which carries start-up).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PHASES = ("generation", "logprobs", "train", "refit")
# Ray names an actor's process after its worker group (``ray::nrl-policy-0``) and the method it
# runs (``.setup``): the group name is the process. vLLM names its own (``VLLM::EngineCore``).
_TITLE = re.compile(r"^(ray::[^\s.]+|VLLM::\S+)")


def process_group(cmdline: str) -> str:
    """A short, stable name for the process of ``cmdline`` (NUL-separated arguments joined by
    spaces): ``driver`` for ``nrl_core.cli``, the process title of Ray actors and vLLM's
    processes, the program's base name (``raylet``, ``gcs_server``) or script otherwise."""
    cmdline = cmdline.strip()
    if "nrl_core.cli" in cmdline:
        return "driver"
    if match := _TITLE.match(cmdline):
        return match.group(1)
    words = cmdline.split()
    if not words:
        return "?"
    scripts = [w for w in words[1:] if w.endswith(".py")]
    return Path(scripts[0] if scripts else words[0]).name


def cpu_per_step(samples: list[tuple[float, int, dict[int, tuple[str, float]]]]) -> list[dict]:
    """Per step, ``{"wall_s", "cpu": Counter(group -> CPU-seconds)}`` from ``samples`` of
    ``(time, steps logged so far, {pid: (cmdline, cumulative CPU-seconds)})``: the step ends at
    the first sample that counts it. A process's group is taken from its last non-empty
    command line (a process exiting has none)."""
    names: dict[int, str] = {}
    for _, _, row in samples:
        for pid, (cmdline, _) in row.items():
            if cmdline.strip():
                names[pid] = process_group(cmdline)
    first: dict[int, tuple[float, dict[int, tuple[str, float]]]] = {}
    for when, logged, row in samples:
        first.setdefault(logged, (when, row))
    steps = []
    marks = sorted(first)
    for before, after in itertools.pairwise(marks):
        (t0, row0), (t1, row1) = first[before], first[after]
        cpu: Counter = Counter()
        for pid, (_, seconds) in row1.items():
            start = row0.get(pid, (None, 0.0))[1]
            cpu[names.get(pid, "?")] += seconds - start
        steps.append({"step": after, "wall_s": t1 - t0, "cpu": cpu})
    return steps


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _sample(root: int) -> dict[int, tuple[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    row = {}
    for pid in _tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        row[pid] = (cmdline[:200], (int(fields[11]) + int(fields[12])) / tick)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps, >= 2")
    parser.add_argument("--new-tokens", type=int, default=128, help="max new tokens, >= 1")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--min-cpu", type=float, default=0.05, help="groups shown per step")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    args = parser.parse_args()
    for bad, why in (
        (args.steps < 2, f"--steps ({args.steps}) must be at least 2 (the first carries start-up)"),
        (args.new_tokens < 1, f"--new-tokens ({args.new_tokens}) must be at least 1"),
        (args.interval <= 0, f"--interval ({args.interval}) must be > 0"),
        (any("=" not in o for o in args.overrides), "overrides must be KEY=VALUE"),
    ):
        if bad:
            print(f"cpu_seconds.py: {why}", file=sys.stderr)
            sys.exit(2)
    sys.path.insert(0, str(Path(__file__).parent))
    from vs_trl import REALISTIC_MODEL, nrl_workload

    from nrl_core.testing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "model", **REALISTIC_MODEL)
        command = [
            sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q",
            f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "grpo.sft_warmup_steps=0",
            "checkpointing.enabled=false", f"logger.log_dir={tmp}", "logger.run_name=bench",
            *nrl_workload(model, args.new_tokens), *args.overrides,
        ]  # fmt: skip
        run = subprocess.Popen(command, env={**os.environ, "NRL_ACTOR_ENV": "system"})
        metrics = tmp / "bench" / "metrics.jsonl"
        samples = []
        while run.poll() is None:
            text = metrics.read_text() if metrics.exists() else ""
            logged = text.count('"timing/step_s"')  # step records (not step 0's data record)
            samples.append((time.time(), logged, _sample(run.pid)))
            time.sleep(args.interval)
        if run.returncode:
            sys.exit(f"nrl exited {run.returncode}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "timing/step_s" in r]
    steps = cpu_per_step(samples)
    for step, record in zip(steps, records, strict=False):
        phases = " ".join(f"{p}={record.get(f'timing/{p}_s', 0.0):.2f}" for p in PHASES)
        refit_bytes, refit_s = record.get("refit/bytes", 0.0), record.get("timing/refit_s", 0.0)
        rate = f" ({refit_bytes / refit_s / 1e9:.2f} GB/s)" if refit_s > 0 else ""
        total = sum(step["cpu"].values())
        print(
            f"step {record['step']}: wall {record['timing/step_s']:.2f} s, {phases}; refit "
            f"{refit_bytes / 1e6:.0f} MB{rate}; CPU-s {total:.2f}"
        )
        for group, seconds in step["cpu"].most_common():
            if seconds >= args.min_cpu:
                print(f"    {group:40s} {seconds:6.2f}")
    steady = steps[1 : len(records)]
    if not steady:
        sys.exit("no step after the first: raise --steps")
    groups = sorted({g for s in steady for g in s["cpu"]})
    medians = {g: statistics.median(s["cpu"][g] for s in steady) for g in groups}
    total = statistics.median(sum(s["cpu"].values()) for s in steady)
    shown = " ".join(f"{g}={v:.2f}" for g, v in sorted(medians.items(), key=lambda kv: -kv[1]))
    print(f"median_cpu_s_per_step={total:.2f} {shown}")


if __name__ == "__main__":
    main()
