"""benchmarks/gpu_acceptance.py in its CPU mode, so that the GPU acceptance script cannot rot.

The CPU mode runs the same stage functions as the GPU mode (tiny model, gloo, float32, the shm
transport instead of CUDA IPC); only the device differs. Megatron-Core is not in the dev venv,
so its stage must SKIP here, with its reason, and PASS where it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_acceptance.py"
STAGES = [
    "model",
    "dtensor",
    "generation",
    "cuda_ipc_refit",
    "megatron",
    "megatron_moe",
    "memory_plan",
    "grpo_step",
]


def have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def load_script():
    """The acceptance script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_the_default_gpu_plan_fits_one_eight_minute_device_command():
    """A device slot is 15 minutes in all, one command at most 10: the default GPU acceptance
    (every stage at its limit, the bundle's install before it and the grace of a stopped last
    stage) must fit one command of at most 8 minutes, leaving room for a machine start and a
    rerun."""
    acc = load_script()
    profile = acc.PROFILES[acc.DEFAULT_PROFILE["cuda"]]
    assert profile.name == "quick"
    # megatron_moe and memory_plan do not fit the plan: they run with the full profile (and on
    # CPU).
    assert set(profile.limits) == set(acc.STAGES) - {"megatron_moe", "memory_plan"}
    assert all(set(p.limits) == set(acc.STAGES) for p in acc.PROFILES.values() if p is not profile)
    stages_s = sum(profile.limits.values())
    assert acc.plan_seconds(profile) == acc.INSTALL_ESTIMATE_S + stages_s + acc.GRACE_S
    assert acc.plan_seconds(profile) <= acc.QUICK_PLAN_S == 8 * 60
    # It is the Qwen2.5-0.5B shape the issue asks figures for, in bf16.
    full = acc.PROFILES["qwen2-0.5b"]
    shape = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
    assert all(getattr(profile, k) == getattr(full, k) for k in shape)
    assert profile.vocab_size == 151936 and profile.dtype == "bfloat16"


def test_the_bundle_travels_in_one_command_with_the_working_tree():
    """Ray's wheel is slimmed so that the bundle's default carry folder plus the working tree
    stay under the device tool's 64 MiB per command (the bundle is built outside CI, so this
    checks the sizes it is planned with: the slimmed Ray, the rest of the bundle and the
    tracked files)."""
    bundle = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT.with_name("gpu_bundle.py"))
    module = importlib.util.module_from_spec(bundle)
    bundle.loader.exec_module(module)
    assert {"ray/jars/", "ray/dashboard/client/build/"} <= set(module.SLIM["ray"])
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=SCRIPT.parents[1], capture_output=True, check=True
    ).stdout.split(b"\0")
    tree = sum((SCRIPT.parents[1] / f.decode()).stat().st_size for f in tracked if f)
    assert tree / 2**20 + module.CARRY_MIB <= 64, f"working tree {tree / 2**20:.1f} MiB"


def run_script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_cpu_mode_passes_every_stage_and_reports_its_figures(tmp_path):
    out = tmp_path / "report.json"
    result = run_script(
        "--device",
        "cpu",
        "--jobs",
        "3",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["profile"]["name"] == "tiny"
    assert report["versions"]["torch"] and report["versions"]["ray"]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == STAGES  # the report keeps stage order, whatever finished first
    for stage in stages.values():
        assert stage["status"] in ("PASS", "SKIP"), stage
        if stage["status"] == "SKIP":
            assert stage["reason"], stage
        assert Path(stage["log"]).is_file()
    # One summary line per stage on stdout.
    lines = [line for line in result.stdout.splitlines() if line.split(" ")[0] in ("PASS", "SKIP")]
    assert sorted(line.split(" ")[1] for line in lines) == sorted(STAGES)

    assert stages["model"]["figures"]["params_m"] > 0
    dtensor = stages["dtensor"]["figures"]
    assert dtensor["backend"] == "gloo" and dtensor["fsdp"] is True
    assert dtensor["train_tokens_per_s"] > 0 and dtensor["logprob_tokens_per_s"] > 0
    assert dtensor["loss_last"] < dtensor["loss_first"]
    assert dtensor["peak_mem_gb"] > 0
    # The colocated hand-over (offload/onload) is a no-op on CPU; the step after still trains.
    assert dtensor["offload_freed_gb"] == 0
    assert dtensor["loss_after_onload"] < dtensor["loss_last"]
    assert stages["generation"]["figures"]["tokens_per_s"] > 0
    refit = stages["cuda_ipc_refit"]["figures"]
    assert refit["transport"] == "shm" and refit["bit_exact"] is True
    assert refit["gb_per_s"] > 0 and refit["buckets"] > 1
    assert refit["wire_form_gb_per_s"] > 0  # the msgpack wire-form pass was bit-exact too
    assert len(set(refit["processes"])) == 2  # two processes, as on the GPU
    if have_megatron():
        assert stages["megatron"]["status"] == "PASS"
        assert stages["megatron"]["figures"]["optimizer"] == "torch"
    else:
        assert stages["megatron"]["status"] == "SKIP"
        assert "megatron-core not installed" in stages["megatron"]["reason"]
    moe = stages["megatron_moe"]
    if have_megatron():
        assert moe["status"] == "PASS", moe
        figures = moe["figures"]
        assert (figures["dispatcher"], figures["optimizer"]) == ("allgather", "torch")
        assert figures["refit_bit_exact"] is True and figures["export_bit_exact"] is True
        # 4 experts x gate/up/down x 4 layers (build_tiny_model's), each under its own name.
        assert figures["export_expert_tensors"] == 4 * 3 * 4
        assert figures["hf_logprob_mean_abs"] <= 1e-5
        assert figures["loss_last"] < figures["loss_first"]
        assert figures["train/moe/load_cv"] > 0 and 1 <= figures["train/moe/max_load"] <= 2
        assert figures["train/moe/aux_loss"] > 0
        # The experts' class is reported; grouped GEMM is checked on a GPU only.
        assert figures["experts_class"] and isinstance(figures["grouped_gemm"], bool)
    else:
        assert moe["status"] == "SKIP" and "megatron-core not installed" in moe["reason"]
    # The memory plan compares with torch.cuda.max_memory_allocated(): a SKIP on CPU that says
    # why (and, once nrl_core.memory_plan exists, the estimates it computed here).
    plan = stages["memory_plan"]
    assert plan["status"] == "SKIP", plan
    if importlib.util.find_spec("nrl_core.memory_plan") is None:
        assert plan["reason"].startswith("memory plan not available"), plan
    else:
        assert "needs --device cuda" in plan["reason"] and "dtensor" in plan["reason"], plan
    grpo = stages["grpo_step"]["figures"]
    assert grpo["steps"] == 2 and grpo["tokens_per_s"] > 0 and grpo["step_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "dtensor,nope"], "--only: unknown stage 'nope'"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--budget-s", "0"], "--budget-s must be above 0"),
    ],
)
def test_bad_arguments_get_one_error_line_and_exit_2(args, message):
    result = run_script("--device", "cpu", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr


def test_a_stage_the_profile_leaves_out_is_skipped_with_its_reason(tmp_path):
    """``quick`` has no limit for megatron_moe: the stage is a SKIP that says how to run it,
    never a silent omission (``--budget-s 1``: nothing heavy runs, the model stage fails)."""
    out = tmp_path / "report.json"
    result = run_script(
        "--device", "cpu", "--profile", "quick", "--only", "megatron_moe", "--budget-s", "1",
        "--out", str(out), "--workdir", str(tmp_path / "work"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr  # the model stage had no time
    stages = {s["name"]: s for s in json.loads(out.read_text())["stages"]}
    assert stages["megatron_moe"]["status"] == "SKIP"
    assert "not in the quick profile" in stages["megatron_moe"]["reason"]
    assert "--profile qwen2-0.5b --only megatron_moe" in stages["megatron_moe"]["reason"]
    assert "SKIP megatron_moe" in result.stdout


def test_a_stage_without_time_left_fails_the_run_and_is_reported(tmp_path):
    """A stage that cannot run (no budget left) is a FAIL in the summary, in the report, and in
    the exit status; the stages after it are not skipped silently either."""
    out = tmp_path / "report.json"
    result = run_script(
        "--device", "cpu", "--only", "dtensor", "--budget-s", "1", "--out", str(out),
        "--workdir", str(tmp_path / "work"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    report = json.loads(out.read_text())
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("model", "FAIL"),
        ("dtensor", "FAIL"),
    ]
    assert "no time left in --budget-s 1" in report["stages"][0]["reason"]
    assert "FAIL model" in result.stdout and "0 PASS, 0 SKIP, 2 FAIL" in result.stdout
