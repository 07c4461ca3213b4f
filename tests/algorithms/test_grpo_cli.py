"""`nrl run grpo` through the real CLI: 2 policy ranks on CPU, local Ray, torch generation."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REQUIRED_KEYS = {
    "step",
    "train/reward_mean",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/gen_logprob_error",
    "train/env_errors",
    "timing/generation_s",
    "timing/logprobs_s",
    "timing/train_s",
    "timing/refit_s",
    "timing/step_s",
    "throughput/tokens_per_s",
}
TINY = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "grpo.sft_warmup_steps=1",
    "data.max_val_samples=8",
    "policy.optimizer.lr=1e-3",
    "loss.clipped_pg.kl_coef=0.01",
    "cluster.num_cpus=2",
]


IN_PROCESS = ["policy.num_workers=1"]
"""For runs that test what the driver does with the environment's results: one policy rank,
so `cluster.backend=auto` runs everything in the `nrl` process, without Ray (a 3-step run: 6.6
CPU-s instead of 20, measured in a cpuacct cgroup). Ray's own paths have their tests
(tests/distributed)."""


def run_nrl(
    tmp_path: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    check: bool = True,
    quiet: bool = True,
    algorithm: str = "grpo",
    base: list[str] = TINY,
) -> subprocess.CompletedProcess:
    """``nrl run <algorithm>`` with the small ``base`` settings and ``overrides``, its run
    folder ``tmp_path/run`` and checkpoints ``tmp_path/ckpt``."""
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        algorithm,
        *(["-q"] if quiet else []),
        f"logger.log_dir={tmp_path}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        *base,
        *overrides,
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system", **(env or {})},
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def metrics(tmp_path: Path) -> list[dict]:
    return [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]


def test_three_steps_write_every_metric_and_change_the_parameters(tmp_path):
    result = run_nrl(
        tmp_path,
        "grpo.max_num_steps=3",
        "grpo.val_period=3",
        "checkpointing.save_period=3",
        quiet=False,
    )
    # Captured (not a terminal): the start-up phases, then one plain line per step; what Ray
    # and the workers print goes to the run log, not here (no -v).
    out = result.stdout
    for phase in (
        r"  data: 2048 training, 8 validation prompts \(\d+\.\d s\)",
        r"  Ray: 2 CPUs \(\d+\.\d s\)",
        r"  policy: 2 dtensor ranks ready, torch generation \(\d+\.\d s\)",
        r"  warm-up: 1 supervised step, loss \d+\.\d+ -> \d+\.\d+ \(\d+\.\d s\)",
        r"  validation at step 0: accuracy \d\.\d+ \(\d+\.\d s\)",
    ):
        assert re.search(f"^{phase}$", out, re.MULTILINE), (phase, out)
    steps = re.findall(r"^step (\d)/3  reward \d\.\d+ .*s/step  (?:eta|took) \d+s$", out, re.M)
    assert steps == ["1", "2", "3"], out
    assert re.search(r"^step 3/3  reward \S+  val acc \S+  ", out, re.MULTILINE), out
    for noise in ("Started a local Ray instance", "Loading weights", "(nrl-policy-", "(raylet)"):
        assert noise not in out + result.stderr, noise
    assert "Started a local Ray instance" in (tmp_path / "run" / "nrl.log").read_text()
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "val/accuracy" in records[0] and "warmup/loss_first" in records[0]
    for record in records[1:]:
        assert set(record) >= REQUIRED_KEYS, REQUIRED_KEYS - set(record)
        assert record["train/gen_logprob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["train/env_errors"] == 0
        assert record["timing/step_s"] >= record["timing/train_s"] > 0
        # One optimizer step per rollout: the step is on-policy, every ratio is 1; the extremes
        # are reduced as extremes over the 2 ranks' micro batches (a sum would give 2.0).
        assert record["train/ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert record["train/ratio_min"] == pytest.approx(1.0, abs=1e-4)
    # The reference is the model after the supervised warm-up, so the first GRPO step starts
    # at zero KL (measured against the pre-warm-up model, as before, it read 0.106).
    assert abs(records[1]["train/kl"]) < 1e-6
    assert records[2]["train/kl"] > 0
    assert (tmp_path / "ckpt" / "reference_after_warmup" / "model.safetensors").is_file()
    assert "val/accuracy" in records[-1] and "val/arithmetic/accuracy" in records[-1]
    assert (tmp_path / "run" / "config.yaml").is_file()

    # Samples (logger.sample_period=10 > 3 steps): steps 1 and 3 and both validation passes,
    # 4 each (logger.num_samples).
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    assert [(s["step"], s["split"]) for s in samples] == [
        *[(0, "validation")] * 4,
        *[(1, "train")] * 4,
        *[(3, "train")] * 4,
        *[(3, "validation")] * 4,
    ]
    for sample in samples:
        assert sample["task"] == "arithmetic" and sample["prompt"][-1]["role"] == "user"
        assert isinstance(sample["completion"], str) and sample["answer"] not in (None, "")
        assert sample["reward"] in (0.0, 1.0) and sample["finish_reason"] in ("stop", "length")
        assert ("advantage" in sample) == (sample["split"] == "train")

    # The trained weights differ from the initial tiny model's.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.tiny import tiny_model_path

    saved = tmp_path / "saved.pt"
    dcp_to_torch_save(tmp_path / "ckpt" / "step_3" / "policy", saved)
    trained = torch.load(saved, weights_only=False)["model"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path()).state_dict()
    changed = [k for k, v in initial.items() if k in trained and not torch.equal(v, trained[k])]
    assert len(changed) > len(initial) // 2

    # `nrl convert` turns the GRPO checkpoint into a Hugging Face folder with those weights,
    # hence the same logits.
    out = tmp_path / "hf"
    convert = subprocess.run(
        [
            sys.executable,
            "-m",
            "nrl_core.cli",
            "convert",
            str(tmp_path / "ckpt" / "step_3"),
            "--to",
            "hf",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    reference.load_state_dict({k: v for k, v in trained.items() if k in initial}, strict=False)
    ids = torch.randint(10, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)
        assert not torch.equal(
            exported(ids).logits,
            AutoModelForCausalLM.from_pretrained(tiny_model_path())(ids).logits,
        )

    # A finished run says so and exits 0 without training.
    again = run_nrl(tmp_path, "grpo.max_num_steps=3", env={"COLUMNS": "200"}, quiet=False)
    assert "already finished" in again.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2, 3]

    # nrl plot draws the charts of the run.
    plot = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "plot", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    for chart in ("reward.png", "val_accuracy.png", "kl.png", "entropy.png", "step_time.png"):
        assert (tmp_path / "run" / chart).stat().st_size > 1000


def test_kill_then_resume_skips_a_damaged_newest_checkpoint_and_a_torn_metrics_line(tmp_path):
    """kill -9 after the step-4 checkpoint; then step_4's largest shard gets one byte flipped
    (same size: only the manifest's hash can tell) and metrics.jsonl a torn last line. Resume
    must say step_4 is damaged, continue from step_2, and reproduce the uninterrupted run.
    One policy rank in the `nrl` process (IN_PROCESS: no Ray head nor rank processes to start
    for each of the three runs): checkpoint verification and resume do not depend on the rank
    count, and 2-rank resumes are tested by PPO's and SFT's (LoRA) resume tests."""
    steps = ["grpo.max_num_steps=4", "grpo.val_period=0", "checkpointing.save_period=2"]
    steps += IN_PROCESS
    reference = tmp_path / "reference"
    run_nrl(reference, *steps)

    killed = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        "-q",
        f"logger.log_dir={killed}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={killed / 'ckpt'}",
        *TINY,
        *steps,
    ]
    process = subprocess.Popen(
        command,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    newest = killed / "ckpt" / "step_4"
    deadline = time.monotonic() + 400
    while not newest.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert newest.exists(), "the run never wrote its step-4 checkpoint"
    os.killpg(process.pid, signal.SIGKILL)  # the driver and anything it started
    process.wait(timeout=60)
    assert (killed / "ckpt" / "step_2").is_dir()

    shard = max((newest / "policy").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with (killed / "run" / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 5, "train/lo')  # the write a kill interrupted

    resumed_run = run_nrl(killed, *steps, quiet=False)  # checkpointing.resume=auto
    assert f"checkpoint {newest} is damaged ({shard.relative_to(newest)} does not match" in (
        resumed_run.stderr
    ), resumed_run.stderr[-2000:]
    assert "resuming from" in resumed_run.stdout + resumed_run.stderr
    expected = {r["step"]: r for r in metrics(reference)}
    resumed = {r["step"]: r for r in metrics(killed)}
    assert sorted(resumed) == sorted(expected) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in (
            "train/reward_mean",
            "train/loss",
            "train/entropy",
            "train/kl",
            "train/grad_norm",
        ):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (
                step,
                key,
            )
    # The damaged step_4 was replaced by the resumed run's own, intact one.
    from nrl_core.checkpoint import verify

    assert verify(newest) is None


def test_unknown_environment_is_one_line_listing_what_is_registered(tmp_path):
    result = run_nrl(tmp_path, "env.name=nope", check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "no environment named 'nope' is registered (env.name=nope)" in lines[0]
    assert "arithmetic" in lines[0] and "exact_match" in lines[0]


def test_environment_exceptions_are_counted_and_the_run_continues(tmp_path):
    # A third-party plugin installed beside nrl (found through its entry point) that
    # registers the flaky test environment.
    site = tmp_path / "site"
    (site / "nrl_flaky_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "nrl_flaky_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nrl-flaky-plugin\nVersion: 1.0\n"
    )
    (site / "nrl_flaky_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[nrl.plugins]\nflaky = nrl_flaky_plugin\n"
    )
    (site / "nrl_flaky_plugin.py").write_text(
        textwrap.dedent("""
        from nrl_core import hookimpl

        @hookimpl
        def nrl_register_environments(register):
            register("flaky", "nrl_core.testing.environments:FlakyEnvironment")
    """)
    )
    run_nrl(
        tmp_path,
        "env.name=flaky",
        *IN_PROCESS,
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
    )
    records = [r for r in metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    # Arithmetic answers are odd about half the time: those samples raised and were counted.
    assert all(r["train/env_errors"] > 0 for r in records)
    assert all(r["train/env_errors"] < 16 for r in records)


def _plugin_site(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    """A third-party plugin ``nrl_<name>_plugin`` (module text ``body``) installed beside nrl
    in ``tmp_path/site``, found through its entry point; the env vars that put it on the
    path."""
    module = f"nrl_{name}_plugin"
    site = tmp_path / "site"
    info = site / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(f"[nrl.plugins]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


NAN_ENV = """
    import math

    from nrl_core import hookimpl
    from nrl_core.interfaces import EnvStep


    class NaNEnvironment:
        def __init__(self, options=None, context=None):
            pass

        def step(self, conversations, metadata):
            return [EnvStep(reward=math.nan) for _ in conversations]


    @hookimpl
    def nrl_register_environments(register):
        register("nan_reward", "nrl_nan_plugin:NaNEnvironment")
"""


def test_a_nan_reward_stops_the_run_naming_the_environment_and_nothing_is_saved(tmp_path):
    """Issue 40: a verifier returning NaN trained on NaN, saved an all-NaN step_1 that passed
    verification, and died at step 2 blaming generation. The step is not applied; the run
    stops in one line naming the environment and the first bad sample; no checkpoint."""
    env = _plugin_site(tmp_path, "nan", NAN_ENV)
    overrides = ["env.name=nan_reward", *IN_PROCESS, "grpo.max_num_steps=2", "grpo.val_period=0"]
    overrides += ["grpo.sft_warmup_steps=0", "checkpointing.save_period=1"]
    result = run_nrl(tmp_path, *overrides, env=env, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "step 1: environment 'nan_reward' (env.name) gave reward nan to sample 0" in errors[0]
    assert "grpo.on_nonfinite=skip" in errors[0]
    assert not any((tmp_path / "ckpt").glob("step_*"))

    # Skipping instead: both steps run, neither trains, the weights saved are the initial ones.
    result = run_nrl(
        tmp_path / "skip",
        *overrides,
        "grpo.on_nonfinite=skip",
        "checkpointing.save_period=2",
        env=env,
    )
    records = [r for r in metrics(tmp_path / "skip") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 1.0 for r in records)
    assert result.stderr.count("step skipped (grpo.on_nonfinite=skip)") == 2


RAISING_ENV = """
    from nrl_core import hookimpl


    class RaisingEnvironment:
        def __init__(self, options=None, context=None):
            pass

        def step(self, conversations, metadata):
            raise ZeroDivisionError("the verifier divides by zero")


    @hookimpl
    def nrl_register_environments(register):
        register("always_raises", "nrl_raising_plugin:RaisingEnvironment")
"""


def test_an_environment_that_always_fails_is_counted_warned_about_and_can_stop_the_run(tmp_path):
    """Issue 40: a verifier that always raises gave exit 0, reward 0 and no warning. Now every
    step logs the failed shares, warns on the console, and env.stop_failed_fraction stops the
    run in one line naming the environment and what failed."""
    env = _plugin_site(tmp_path, "raising", RAISING_ENV)
    overrides = ["env.name=always_raises", *IN_PROCESS, "grpo.max_num_steps=2"]
    overrides += ["grpo.val_period=0"]
    overrides += ["grpo.sft_warmup_steps=0", "checkpointing.enabled=false"]
    result = run_nrl(tmp_path, *overrides, env=env)
    records = [r for r in metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/env_error_frac"] == 1.0 for r in records)
    assert all(r["train/env_failed_frac"] == 1.0 for r in records)
    assert all(r["train/env_timeout_frac"] == 0.0 == r["train/env_crash_frac"] for r in records)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: step")]
    assert len(warnings) == 2, result.stderr[-3000:]
    assert "16 of 16 samples (100%) failed" in warnings[0]
    assert "environment 'always_raises' (env.name): 16 error" in warnings[0]
    assert "ZeroDivisionError: the verifier divides by zero" in warnings[0]

    result = run_nrl(tmp_path / "stop", *overrides, "env.stop_failed_fraction=0.5", env=env,
                     check=False)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "step 1: 16 of 16 samples (100%) failed" in errors[0]
    assert "environment 'always_raises' (env.name)" in errors[0]
    assert "env.stop_failed_fraction=0.5" in errors[0]
    assert [r["step"] for r in metrics(tmp_path / "stop") if r["step"] > 0] == []


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs the uv command (the README's way)")
def test_uv_run_no_sync_with_relative_paths_writes_checkpoints_with_weights(tmp_path):
    """``uv run --no-sync nrl run grpo`` from another folder, with relative output paths: the
    workers run in the driver's folder and interpreter (not in a copy made by Ray's `uv run`
    hook), so the checkpoint holds the policy's weights where the user asked."""
    repo = Path(__file__).resolve().parents[2]
    command = [
        "uv", "run", "--project", str(repo), "--no-sync", "nrl", "run", "grpo", "-q",
        "logger.log_dir=logs", "logger.run_name=run", "checkpointing.checkpoint_dir=ckpt",
        *TINY, "grpo.sft_warmup_steps=0", "grpo.max_num_steps=1", "grpo.val_period=0",
        # One rank, on Ray all the same: a Ray worker's folder and interpreter are the point,
        # and one worker writes the whole checkpoint as two would (one process fewer).
        "policy.num_workers=1", "cluster.backend=local",
    ]  # fmt: skip
    result = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    policy = tmp_path / "ckpt" / "step_1" / "policy"
    assert (policy / ".metadata").is_file()
    assert sum(f.stat().st_size for f in policy.glob("*.distcp")) > 100_000  # the weights
    assert (tmp_path / "logs" / "run" / "metrics.jsonl").is_file()


def _cli(log_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q",
        f"logger.log_dir={log_dir}", "logger.run_name=run", *TINY, *overrides,
    ]  # fmt: skip


def test_concurrent_runs_keep_their_own_checkpoints_and_a_live_folder_is_refused(tmp_path):
    """Two runs started together from one folder, differing only in logger.log_dir, each end
    with their own checkpoints (the default is inside the run folder); a third run on a live
    run folder is refused in one line naming the holder."""
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    steps = ["grpo.max_num_steps=2", "grpo.val_period=0", "grpo.sft_warmup_steps=0"]
    # One policy rank, still on Ray (as test_launchers.py): where checkpoints go and the run
    # folder's lock do not depend on the rank count; each run still starts its own Ray head
    # beside the other's, and a Ray start keeps run a live long enough for the third run to
    # meet its lock (in the `nrl` process it could end first on a loaded machine).
    steps += ["policy.num_workers=1", "cluster.backend=local"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [
        subprocess.Popen(_cli(tmp_path / name, *steps), env=env, cwd=tmp_path, **pipes)
        for name in ("a", "b")
    ]
    lock = tmp_path / "a" / "run" / ".nrl.lock"
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    clash = subprocess.run(
        _cli(tmp_path / "a", *steps), env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    assert clash.returncode == 2, clash.stderr[-2000:]
    lines = clash.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {runs[0].pid}" in lines[0], clash.stderr
    for name in ("a", "b"):
        assert (
            tmp_path / name / "run" / "checkpoints" / "step_2" / "policy" / ".metadata"
        ).is_file()


def test_lora_refits_separate_torch_engines_with_the_adapters_only(tmp_path):
    """Issue 52 item 1: a 3-step `nrl run grpo` with a LoRA policy (rank 4) and a separate
    torch engine refits adapters only (generation.lora_refit's `auto`): every step moves
    exactly the adapter's float32 bytes, and the engine's logprobs, with the new adapter,
    equal the trainer's (`gen_logprob_error_max` within exp(1e-4), as for vLLM's CPU engine)."""
    import math

    from nrl_core.testing.tiny import lora_adapter_bytes

    run_nrl(
        tmp_path,
        "grpo.max_num_steps=3",
        "checkpointing.enabled=false",
        "policy.dtensor.lora_rank=4",
        "generation.torch.colocated=false",
    )
    steps = [r for r in metrics(tmp_path) if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert row["refit/bytes"] == lora_adapter_bytes(rank=4), row
        assert row["train/gen_logprob_error_max"] < math.exp(1e-4), row
