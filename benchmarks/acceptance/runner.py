"""The parent process: the command line, each stage in a child process of its own with a time
limit (:class:`StageRun`), the summary lines and the JSON report (:func:`main`); and the child's
side (:func:`run_stage_here`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .common import Skip, StageContext, UsageError
from .dtensor import stage_dtensor
from .generation import stage_generation
from .grpo import stage_grpo_step
from .megatron import stage_megatron
from .megatron_moe import stage_megatron_moe
from .memory_plan import stage_memory_plan
from .model import stage_model
from .profiles import DEFAULT_PROFILE, GRACE_S, PROFILES, STAGES
from .refit import stage_cuda_ipc_refit

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_acceptance.py"
"""What a stage's child process runs (with ``--stage``): the same entry point as the parent's."""
DESCRIPTION = (
    "GPU acceptance: run on one GPU what of nrl's GPU path can run without vLLM or SGLang."
)

STATUSES = ("PASS", "FAIL", "SKIP")

# The summary line of each stage shows these figures (all of them go to the JSON report).
SHOWN = {
    "model": ("params_m", "dtype", "cached"),
    "dtensor": (
        "backend",
        "train_tokens_per_s",
        "logprob_tokens_per_s",
        "peak_mem_gb",
        "offload_freed_gb",
        "mem_after_onload_gb",
    ),
    "generation": ("tokens_per_s", "dtype"),
    "cuda_ipc_refit": ("transport", "gb_per_s", "gb", "buckets", "bit_exact"),
    "megatron": (
        "optimizer",
        "train_tokens_per_s",
        "logprob_tokens_per_s",
        "peak_mem_gb",
        "offload_freed_gb",
        "refit_bit_exact",
    ),
    "megatron_moe": (
        "dispatcher",
        "experts_class",
        "optimizer",
        "hf_logprob_mean_abs",
        "train/moe/load_cv",
        "train/moe/max_load",
        "refit_bit_exact",
        "export_bit_exact",
    ),
    "memory_plan": (
        "dtensor_estimate_gb",
        "dtensor_measured_gb",
        "dtensor_ratio",
        "megatron_estimate_gb",
        "megatron_measured_gb",
        "megatron_ratio",
    ),
    "grpo_step": ("tokens_per_s", "step_s", "generation_s", "train_s", "gen_logprob_error"),
}

# Packages whose versions the report records (read from their metadata, nothing imported).
VERSIONS = ("torch", "transformers", "ray", "megatron-core", "nrl-core", "safetensors")

NOT_COVERED = (
    "vLLM and SGLang do not run here: their wheels are far larger than the 64 MiB a device "
    "command can carry, and the GPU machines have no network. vLLM 0.26.0 (the torch-2.11 "
    "build) travels in a chain of calls of its own (gpu_bundle.py --vllm, then gpu_vllm.py; "
    "benchmarks/README.md); SGLang does not; the engines' GPU paths stay pinned by gpu_sim "
    "tests (README, 'The GPU path')."
)

STAGE_FUNCTIONS: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "model": stage_model,
    "dtensor": stage_dtensor,
    "generation": stage_generation,
    "cuda_ipc_refit": stage_cuda_ipc_refit,
    "megatron": stage_megatron,
    "megatron_moe": stage_megatron_moe,
    "memory_plan": stage_memory_plan,
    "grpo_step": stage_grpo_step,
}


def run_stage_here(name: str, ctx: StageContext, result_file: Path) -> int:
    """The child's side: run one stage, write ``{status, figures, reason}`` to ``result_file``."""
    try:
        figures = STAGE_FUNCTIONS[name](ctx)
        result = {"status": "PASS", "figures": figures, "reason": ""}
    except Skip as exc:
        result = {"status": "SKIP", "figures": {}, "reason": str(exc)}
    except BaseException as exc:  # the parent reports it; the traceback goes to the log
        traceback.print_exc()
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()
        result = {"status": "FAIL", "figures": {}, "reason": reason[0] if reason else "?"}
    result_file.write_text(json.dumps(result))
    return 0


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary(stage: dict[str, Any]) -> str:
    line = f"{stage['status']} {stage['name']} {stage['seconds']:.1f}s"
    if stage["status"] != "PASS":
        return f"{line} {stage['reason']}"
    shown = [k for k in SHOWN.get(stage["name"], ()) if k in stage["figures"]]
    return line + "".join(f" {k}={_format(stage['figures'][k])}" for k in shown)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the stage's process group (a Ray head or an ``nrl run`` in it shuts down
    cleanly on that), then SIGKILL what is left of it after :data:`GRACE_S`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(GRACE_S)
    while time.monotonic() < deadline and _group_alive(process.pid):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


class StageRun:
    """One stage running in a child process of its own (own process group), stopped when it
    outlives ``ctx.limit_s``."""

    def __init__(self, name: str, ctx: StageContext, log_dir: Path) -> None:
        self.name, self.ctx = name, ctx
        self.log = log_dir / f"{name}.log"
        self.result_file = log_dir / f"{name}.result.json"
        self.result_file.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", NRL_ACTOR_ENV="system")
        if not ctx.on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on any machine
        command = [
            sys.executable,
            str(SCRIPT),
            "--stage",
            name,
            "--context",
            ctx.to_json(),
            "--result",
            str(self.result_file),
        ]
        self.started = time.perf_counter()
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def poll(self) -> dict[str, Any] | None:
        """The stage's report entry once it ended (or was stopped at its limit), else None."""
        code = self.process.poll()
        seconds = time.perf_counter() - self.started
        timed_out = code is None and seconds > self.ctx.limit_s
        if code is None and not timed_out:
            return None
        if timed_out:
            _stop(self.process)
            seconds = time.perf_counter() - self.started
        entry: dict[str, Any] = {"name": self.name, "seconds": round(seconds, 2)}
        if timed_out:
            reason = f"timed out after {self.ctx.limit_s:.0f}s"
            entry.update(status="FAIL", figures={}, reason=reason)
        elif self.result_file.exists():
            entry.update(json.loads(self.result_file.read_text()))
        else:
            reason = f"stage process exited {code} without a result"
            entry.update(status="FAIL", figures={}, reason=reason)
        entry["log"] = str(self.log)
        return entry


def _not_run(name: str, reason: str) -> dict[str, Any]:
    return {"name": name, "status": "FAIL", "seconds": 0.0, "figures": {}, "reason": reason}


def _not_in_profile(name: str, profile: str) -> dict[str, Any]:
    reason = (
        f"not in the {profile} profile (its time limit would not fit that profile's plan); "
        f"run it with --profile qwen2-0.5b --only {name}"
    )
    return {"name": name, "status": "SKIP", "seconds": 0.0, "figures": {}, "reason": reason}


def _tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every nrl command
        raise UsageError(message)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=DESCRIPTION)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument(
        "--only", default="", help=f"comma-separated stages (default: all of {', '.join(STAGES)})"
    )
    parser.add_argument("--out", default=None, help="JSON report (default: WORKDIR/report.json)")
    parser.add_argument(
        "--workdir",
        default=None,
        help="built model, logs, runs (default: a temporary folder, removed after a clean run); "
        "give one to reuse the built model across invocations",
    )
    parser.add_argument(
        "--profile", default=None, choices=sorted(PROFILES), help="model size (default by device)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run; a stage gets at most what is left "
        "(default: the sum of the selected stages' limits in the profile)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="stages run at once after `model` (default 1: the GPU figures need the GPU alone; "
        "CI's CPU run uses more to finish sooner)",
    )
    # The child's side (internal).
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _selected(only: str) -> list[str]:
    if not only.strip():
        return list(STAGES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"--only: unknown stage {unknown[0]!r}; choose from {', '.join(STAGES)}")
    # The model stage is cheap once built, and every other stage loads its model.
    wanted = set(names) | {"model"}
    return [s for s in STAGES if s in wanted]


def _resolve_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise UsageError("--device cuda: torch sees no CUDA device; use --device cpu")
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    """Run the selected stages and write the report; the exit status of the whole run."""
    try:
        args = _parse(argv)
        if args.stage is not None:
            return run_stage_here(
                args.stage, StageContext.from_json(args.context), Path(args.result)
            )
        if args.jobs < 1:
            raise UsageError(f"--jobs must be at least 1; got {args.jobs}")
        if args.budget_s is not None and args.budget_s <= 0:
            raise UsageError(f"--budget-s must be above 0; got {args.budget_s:g}")
        stages = _selected(args.only)
        device = _resolve_device(args.device)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile = PROFILES[args.profile or DEFAULT_PROFILE[device]]
    budget_s = args.budget_s or float(sum(profile.limits.get(name, 0) for name in stages))
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="nrl-acc-")).resolve()
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() if args.out else workdir / "report.json"
    report: dict[str, Any] = {
        "device": device,
        "profile": asdict(profile),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "workdir": str(workdir),
        "budget_s": budget_s,
        "not_covered": NOT_COVERED,
        "stages": [],
    }
    print(
        f"gpu_acceptance: device={device} profile={profile.name} budget={budget_s:g}s "
        f"workdir={workdir}",
        flush=True,
    )
    print(f"gpu_acceptance: not covered: {NOT_COVERED}", flush=True)
    started = time.perf_counter()
    entries: dict[str, dict[str, Any]] = {}

    def finish(entry: dict[str, Any]) -> None:
        entries[entry["name"]] = entry
        report["stages"] = [entries[n] for n in stages if n in entries]
        report["total_s"] = round(time.perf_counter() - started, 2)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(_summary(entry), flush=True)
        if entry["status"] == "FAIL" and entry.get("log"):
            print(_tail(entry["log"]), flush=True)

    pending, running = list(stages), []
    if args.jobs > 1:  # longest first, so that the slowest stage does not start last
        pending.sort(key=lambda n: (n != "model", -profile.limits.get(n, 0)))
    while pending or running:
        # `model` runs alone: every other stage loads what it builds.
        model_first = bool(running) and running[0].name == "model"
        while pending and len(running) < args.jobs and not model_first:
            name = pending.pop(0)
            left = budget_s - (time.perf_counter() - started)
            model = entries.get("model")
            if name not in profile.limits:
                finish(_not_in_profile(name, profile.name))
            elif name != "model" and model is not None and model["status"] != "PASS":
                finish(_not_run(name, "the model stage failed"))
            elif left < 5:
                finish(_not_run(name, f"no time left in --budget-s {budget_s:g}"))
            else:
                limit = min(profile.limits[name], left)
                ctx = StageContext(device, profile, str(workdir), limit)
                running.append(StageRun(name, ctx, log_dir))
                model_first = name == "model"
        for run in list(running):
            entry = run.poll()
            if entry is not None:
                running.remove(run)
                finish(entry)
        if running:
            time.sleep(0.2)
    counts = {s: sum(e["status"] == s for e in report["stages"]) for s in STATUSES}
    failed = counts["FAIL"] > 0
    print(
        f"gpu_acceptance: {counts['PASS']} PASS, {counts['SKIP']} SKIP, {counts['FAIL']} FAIL "
        f"in {report['total_s']:.1f}s; report: {out}",
        flush=True,
    )
    if own_workdir and not failed and not out.is_relative_to(workdir):
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
