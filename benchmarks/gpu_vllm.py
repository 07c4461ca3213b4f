"""nrl with vLLM on one GPU: ``nrl run grpo generation.backend=vllm``, figures into one JSON file.

    python3 benchmarks/gpu_vllm.py [--workdir /tmp/nrl-acc] [--out vllm.json] [--budget-s 420]

The last call of the vLLM chain (``benchmarks/gpu_bundle.py --vllm``; benchmarks/README.md)
runs this on the lent GPU machine once vLLM and nrl's bundle are installed there. It:

1. builds (or reuses, when the acceptance ran first on the same ``--workdir``) the acceptance's
   Qwen2.5-0.5B-shaped model: ``gpu_acceptance.py --only model``;
2. runs ``nrl run grpo`` for 2 steps: policy ``dtensor``, a vLLM engine colocated with it
   (sleeping while the policy trains, refit every step), the multi-turn ``guess_number`` game
   (nrl-math-env), validation every step (``grpo.val_period=1``), the trainer recomputing the
   rollouts' logprobs;
3. samples the GPU's used memory (``nvidia-smi``, every :data:`SAMPLE_S`) during the run.

The JSON (``--out``, rewritten after each phase, so a run stopped at its limit still returns
what it got) holds the versions, the command, per step ``timing/refit_s``,
``train/gen_logprob_error``/``_max`` (engine against trainer), the step's phase timings, the
validation metrics, and the memory: the device's used memory while the engine is awake (the
peak) and asleep (the least between the first and the last awake sample). Exit status: 0 when
both steps were logged, 1 otherwise, 2 on a bad argument.

Nothing here is GPU-specific but the defaults: ``tests/benchmarks/test_gpu_vllm.py`` checks on
CPU that the run's overrides resolve (``nrl config show``) and the JSON's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

STEPS = 2
SAMPLE_S = 0.5
"""How often the GPU's used memory is read during the run."""
SAVE_S = 10.0
"""How often the JSON is rewritten while the run goes on."""
AWAKE_FRACTION = 0.8
"""A memory sample counts as "engine awake" at this fraction of the run's peak or more."""

TASK = "data.tasks=[{name: game, dataset: guess_number, env: guess_number, weight: 1}]"
"""The multi-turn game (nrl-math-env): up to :data:`TURNS` guesses, each ended by a newline."""
TURNS = 3

STEP_KEYS = (
    "timing/step_s",
    "timing/generation_s",
    "timing/refit_s",
    "timing/logprobs_s",
    "timing/train_s",
    "throughput/tokens_per_s",
    "train/gen_logprob_error",
    "train/gen_logprob_error_max",
    "train/turns_mean",
    "train/response_length_mean",
    "refit/bytes",
)
"""What the JSON keeps of each training step's ``metrics.jsonl`` record (when logged)."""

OFFLINE = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""The machine has no network: no usage reports, no hub look-ups."""

VERSIONS = ("vllm", "torch", "transformers", "ray", "nrl-core", "nrl-vllm")


def grpo_overrides(model: str, log_dir: str, *, cpus: int, gpus: int, limit_s: int) -> list[str]:
    """``nrl run grpo`` overrides of the run (the same on CPU, where only ``gpus`` differ)."""
    return [
        f"policy.model_name={model}",
        "policy.precision=bfloat16",
        "policy.backend=dtensor",
        "policy.num_workers=1",
        "policy.optimizer.lr=1e-4",
        "generation.backend=vllm",
        # Colocated (the default): the engine sleeps while the policy trains; no CUDA graphs
        # (their capture is start-up time this 2-step run would not win back).
        "generation.vllm.enforce_eager=true",
        "generation.vllm.gpu_memory_utilization=0.3",
        "generation.vllm.max_model_len=512",
        TASK,
        f"grpo.max_rollout_turns={TURNS}",
        f"env.guess_number.max_turns={TURNS}",
        'generation.stop_strings=["\\n"]',
        'env.guess_number.stop_strings=["\\n"]',
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_period=1",
        "data.max_val_samples=8",
        "grpo.sft_warmup_steps=0",
        "checkpointing.enabled=false",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16",
        "generation.max_new_tokens=32",
        "policy.max_total_sequence_length=384",
        # The trainer recomputes the rollouts' logprobs: train/gen_logprob_error is then the
        # engine's bf16 agreement with the trainer.
        "loss.clipped_pg.on_policy_shortcut=false",
        f"logger.log_dir={log_dir}",
        "logger.run_name=run",
        f"cluster.num_cpus={cpus}",
        f"cluster.gpus_per_node={gpus}",
        f"cluster.worker_timeout_s={limit_s}",
    ]


def memory_summary(samples: list[tuple[float, float]], total_mib: float | None) -> dict[str, Any]:
    """Used GPU memory (``(seconds, MiB)`` samples) as the engine's awake and asleep levels: the
    peak, and the least used between the first and the last sample at :data:`AWAKE_FRACTION`
    of it or more (the engine slept there; before the first and after the last, the run was
    starting or ending)."""
    if not samples:
        return {"samples": 0}
    used = [mib for _, mib in samples]
    peak = max(used)
    awake = [i for i, mib in enumerate(used) if mib >= AWAKE_FRACTION * peak]
    between = used[awake[0] : awake[-1] + 1]
    asleep = min(between)
    return {
        "samples": len(samples),
        "total_gib": round(total_mib / 1024, 2) if total_mib else None,
        "awake_peak_gib": round(peak / 1024, 2),
        "asleep_min_gib": round(asleep / 1024, 2),
        "freed_by_sleep_gib": round((peak - asleep) / 1024, 2),
        # Several awake stretches: the engine slept and woke up again within the run.
        "awake_stretches": sum(1 for a, b in zip([-2, *awake], awake, strict=False) if b != a + 1),
    }


def step_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The training steps' figures and the validations' metrics from ``metrics.jsonl``."""
    trained = [r for r in records if "timing/step_s" in r]
    validated = [
        {k: v for k, v in r.items() if k == "step" or k.startswith("val/")}
        for r in records
        if any(k.startswith("val/") for k in r)
    ]
    steps = [{"step": r.get("step"), **{k: r[k] for k in STEP_KEYS if k in r}} for r in trained]
    return {"steps": steps, "validations": validated}


def _records(lines: list[str]) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records; a last line still being written is left for later."""
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MemorySampler:
    """``nvidia-smi``'s used memory of GPU 0, read every :data:`SAMPLE_S` in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.total_mib: float | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[float, float]:
        query = [
            "nvidia-smi",
            "--query-gpu=memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ]
        line = subprocess.run(query, capture_output=True, text=True, check=True, timeout=10)
        used, total = (float(x) for x in line.stdout.splitlines()[0].split(","))
        return used, total

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                used, self.total_mib = self._read()
            except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
                self.error = f"nvidia-smi: {exc}"
                return
            self.samples.append((round(time.monotonic() - start, 2), used))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _build_model(workdir: Path, limit_s: float) -> Path:
    """The acceptance's model (its ``model`` stage; cached in ``workdir``)."""
    report = workdir / "model-report.json"
    command = [sys.executable, str(HERE / "gpu_acceptance.py"), "--device", "cuda"]
    command += ["--only", "model", "--workdir", str(workdir), "--out", str(report)]
    subprocess.run(command, check=True, timeout=limit_s)
    (stage,) = json.loads(report.read_text())["stages"]
    if stage["status"] != "PASS":
        raise RuntimeError(f"the model stage did not pass: {stage.get('reason')}")
    return Path(stage["figures"]["path"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nrl-acc"))
    parser.add_argument("--out", type=Path, default=Path("vllm.json"))
    parser.add_argument("--budget-s", type=int, default=420, help="for the whole script")
    args = parser.parse_args(argv)
    if args.budget_s < 60:
        print(f"error: --budget-s must be at least 60; got {args.budget_s}", file=sys.stderr)
        return 2
    started = time.monotonic()
    report: dict[str, Any] = {"ok": False, "versions": _versions(), "phases": {}}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    # What vLLM needs on this machine (FlashInfer is not carried: its sampler must stay off),
    # set in this process so that Ray's actors and vLLM's engine core inherit it.
    from nrl_vllm.compat import engine_environment

    environment = {**engine_environment(), **OFFLINE}
    os.environ.update({k: v for k, v in environment.items() if k not in os.environ})
    os.environ["NRL_ACTOR_ENV"] = "system"  # no per-plugin venvs: the installed packages
    report["environment"] = {k: os.environ[k] for k in environment}
    save()
    try:
        t = time.monotonic()
        model = _build_model(args.workdir, min(120.0, left()))
        report["phases"]["model_s"] = round(time.monotonic() - t, 1)
        report["model"] = str(model)
        save()

        log_dir = args.workdir / "vllm-grpo"
        shutil.rmtree(log_dir, ignore_errors=True)
        limit = int(left()) - 15
        command = [sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q"]
        command += grpo_overrides(
            str(model), str(log_dir), cpus=os.cpu_count() or 2, gpus=1, limit_s=limit
        )
        report["command"] = command
        save()
        t = time.monotonic()
        metrics = log_dir / "run" / "metrics.jsonl"

        def collect(sampler: MemorySampler) -> None:
            # Also while the run goes on: a command stopped at the device tool's limit still
            # returns the steps and memory seen so far.
            report["phases"]["grpo_s"] = round(time.monotonic() - t, 1)
            report["memory"] = memory_summary(sampler.samples, sampler.total_mib)
            report["memory"]["sampler_error"] = sampler.error
            report["memory_series_mib"] = list(sampler.samples)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            report.update(step_figures(_records(lines)))
            save()

        with MemorySampler() as sampler, (args.out.parent / "grpo.log").open("w") as log:
            run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            while True:
                try:
                    code = run.wait(min(SAVE_S, max(1.0, limit - (time.monotonic() - t))))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t >= limit:
                        run.terminate()  # nrl stops its Ray head and exits on SIGTERM
                        code = run.wait()
                        break
                    collect(sampler)
        report["grpo_exit"] = code
        collect(sampler)
        report["ok"] = code == 0 and len(report["steps"]) == STEPS
        if log_dir.exists():
            with tarfile.open(args.out.parent / "vllm-logs.tgz", "w:gz") as tar:
                tar.add(log_dir, arcname="vllm-grpo")
    except Exception as exc:  # the JSON says what failed; the log has the rest
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        report["total_s"] = round(time.monotonic() - started, 1)
        save()
    summary = {k: report.get(k) for k in ("ok", "grpo_exit", "phases", "memory", "error")}
    print("[gpu_vllm] " + json.dumps(summary), flush=True)
    for step in report.get("steps", []):
        print("[gpu_vllm] " + json.dumps(step), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
