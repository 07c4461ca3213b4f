"""GPU acceptance: run on one GPU what of nrl's GPU path can run without vLLM or SGLang.

    python benchmarks/gpu_acceptance.py [--device auto|cuda|cpu] [--only STAGE,...]
                                        [--out REPORT.json] [--workdir DIR] [--budget-s S]
                                        [--profile quick|qwen2-0.5b|tiny] [--jobs N]

Stages, in order, each in a subprocess of its own with a time limit:

- ``model``: build a Qwen2-shaped causal LM with random weights and nrl's character-level
  tokenizer (:func:`nrl_core.testing.tiny.build_tokenizer`) into the work folder with
  ``save_pretrained`` (on ``cuda``: the Qwen2.5-0.5B shape, ~0.49B parameters, bf16; on ``cpu``
  a tiny one). Every later stage loads it through ``from_pretrained``.
- ``dtensor``: the nrl-dtensor policy worker as one rank of a real ``torch.distributed`` world
  (NCCL and bf16 on ``cuda``, gloo and float32 on ``cpu``; FSDP2 applied), driven by the core's
  :class:`~nrl_core.policy.Policy` facade: training steps (forward_backward + optimizer_step)
  and logprobs; tokens/s and peak memory. Then the hand-over to colocated engines,
  ``offload(["optimizer"])``, ``offload(["weights"])``, ``onload()`` (on a GPU the memory must
  go down; the step after must still train).
- ``generation``: nrl-dtensor's :class:`~nrl_dtensor.generation.TorchGenerator` on the device;
  generated tokens/s.
- ``cuda_ipc_refit``: the model's weights pushed by :class:`nrl_core.weight_sync.WeightSender`
  from one Ray actor to another (two processes; on ``cuda`` both on the same GPU, transport
  ``cuda_ipc``; on ``cpu`` transport ``shm``); the receiver checks every tensor bit-exact; GB/s.
  A last refit crosses msgpack in nrl's wire form first (as into vLLM's engine core). The
  memory of both processes must not grow from the first refit to the last.
- ``megatron``: the nrl-megatron policy worker (Megatron-Core ``GPTModel``; on ``cuda`` bf16 and
  Megatron's distributed optimizer): first the refit's Hugging Face-named buckets, bit-exact
  against the checkpoint; then training steps, logprobs and the same hand-over. SKIP when
  megatron-core is not importable (the dev venv; the GPU bundle brings its wheel).
- ``megatron_moe``: the same worker on a tiny Qwen3-MoE (4 experts, top-2) built in the work
  folder: on ``cuda`` Megatron-Core's ``alltoall`` dispatcher, Megatron DDP with the experts and
  the distributed optimizer (what CPU cannot build); the refit and ``export_hf`` bit-exact, each
  expert once; logprobs against transformers' forward; training steps and ``train/moe/*``. Not
  in ``quick`` (SKIP there, with how to run it); same SKIP as ``megatron`` without megatron-core.
- ``grpo_step``: ``nrl run grpo`` through the real CLI on the built model (policy ``dtensor``,
  colocated ``torch`` generation, the ``arithmetic`` environment, the trainer recomputing the
  rollouts' logprobs); tokens/s and ``train/gen_logprob_error`` from its ``metrics.jsonl``.

Profiles: ``quick`` (the default on ``cuda``; sized so that the bundle's install and every stage
fit one 8-minute device command, :func:`plan_seconds`), ``qwen2-0.5b`` (larger workloads) and
``tiny`` (``cpu``).

Each stage prints one line ``PASS|FAIL|SKIP <stage> <seconds>s <figures or reason>``; the JSON
report (``--out``, rewritten after every stage) holds the figures, the versions and each stage's
log file. The exit status is 1 when a stage failed, 2 on a bad argument, else 0.

``--device cpu`` (what CI runs, tests/benchmarks/test_gpu_acceptance.py) runs the same stage
functions on the tiny model: the device is the only difference (children then see no CUDA
device, ``CUDA_VISIBLE_DEVICES=""``). How to run it on a lent GPU machine, with the wheels the
machine lacks (``benchmarks/gpu_bundle.py``): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

STAGES: tuple[str, ...] = (
    "model",
    "dtensor",
    "generation",
    "cuda_ipc_refit",
    "megatron",
    "megatron_moe",
    "grpo_step",
)
"""Every stage, in the order they run."""

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
        "optimizer",
        "hf_logprob_mean_abs",
        "train/moe/load_cv",
        "train/moe/max_load",
        "refit_bit_exact",
        "export_bit_exact",
    ),
    "grpo_step": ("tokens_per_s", "step_s", "generation_s", "train_s", "gen_logprob_error"),
}

# Packages whose versions the report records (read from their metadata, nothing imported).
VERSIONS = ("torch", "transformers", "ray", "megatron-core", "nrl-core", "safetensors")


@dataclass(frozen=True)
class Profile:
    """Model shape and workload sizes of one run; ``cpu`` runs ``tiny``, ``cuda`` the 0.5B."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None
    """None: the tokenizer's size rounded up to 64 (the real Qwen2 vocabulary is 151936; ids
    beyond the character tokenizer are valid model tokens that decode to nothing)."""
    dtype: str
    """Precision of the saved weights and of the policies (``policy.precision``)."""
    lr: float
    train_batch: int
    train_seq: int
    micro_batch: int
    train_steps: int
    """Timed training steps, after one warm-up step."""
    gen_prompts: int
    gen_prompt_len: int
    gen_new_tokens: int
    refit_bucket_mb: float
    refit_repeats: int
    """Timed refits after a warm-up one (the first opens the transport)."""
    grpo_overrides: tuple[str, ...]
    limits: dict[str, int]
    """Upper bound of each stage in seconds (:data:`STAGES`); their sum is the default
    ``--budget-s``. A stage the profile has no limit for is reported SKIP (``quick`` leaves
    ``megatron_moe`` out)."""


PROFILES = {
    "tiny": Profile(
        name="tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=None,
        dtype="float32",
        lr=1e-3,
        train_batch=2,
        train_seq=32,
        micro_batch=2,
        train_steps=1,
        gen_prompts=4,
        gen_prompt_len=8,
        gen_new_tokens=8,
        refit_bucket_mb=1 / 16,
        refit_repeats=2,
        grpo_overrides=(
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4",
            "policy.logprob_batch_size=8",
            "generation.max_new_tokens=4",
            "policy.max_total_sequence_length=48",
        ),
        # What CI tolerates before it calls a stage hung.
        limits={
            "model": 90,
            "dtensor": 90,
            "generation": 90,
            "cuda_ipc_refit": 120,
            "megatron": 120,
            "megatron_moe": 120,
            "grpo_step": 180,
        },
    ),
    # Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 query and 2 key/value heads, MLP 4864,
    # vocabulary 151936, tied embeddings (~494M parameters).
    "qwen2-0.5b": Profile(
        name="qwen2-0.5b",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        dtype="bfloat16",
        lr=1e-4,
        train_batch=16,
        train_seq=1024,
        micro_batch=4,
        train_steps=3,
        gen_prompts=64,
        gen_prompt_len=32,
        gen_new_tokens=128,
        refit_bucket_mb=256,
        refit_repeats=3,
        grpo_overrides=(
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8",
            "policy.train_global_batch_size=64",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=16",
            "generation.max_new_tokens=128",
            "generation.torch.generation_batch_size=64",
            "policy.max_total_sequence_length=192",
        ),
        limits={
            "model": 180,
            "dtensor": 240,
            "generation": 180,
            "cuda_ipc_refit": 180,
            "megatron": 240,
            "megatron_moe": 120,
            "grpo_step": 420,
        },
    ),
}
# The default on a GPU: the same Qwen2.5-0.5B shape with workloads sized so that the whole
# acceptance, the wheel install included, is one device command of at most 8 minutes
# (QUICK_PLAN_S; tests/benchmarks/test_gpu_acceptance.py checks the sum).
PROFILES["quick"] = replace(
    PROFILES["qwen2-0.5b"],
    name="quick",
    train_seq=512,
    train_steps=2,
    gen_prompts=32,
    gen_new_tokens=64,
    refit_repeats=2,
    grpo_overrides=(
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16",
        "generation.max_new_tokens=48",
        "generation.torch.generation_batch_size=32",
        "policy.max_total_sequence_length=128",
    ),
    # No megatron_moe: the plan has 15 s to spare and the megatron stage alone took 25 s on an
    # H100 (docs/performance.md), so it runs with --profile qwen2-0.5b.
    limits={
        "model": 50,
        "dtensor": 70,
        "generation": 40,
        "cuda_ipc_refit": 60,
        "megatron": 70,
        "grpo_step": 110,
    },
)
DEFAULT_PROFILE = {"cpu": "tiny", "cuda": "quick"}

QUICK_PLAN_S = 480
"""What one device command of the default GPU acceptance may take, the wheel install included
(the issue's bound: 8 minutes, so that a 15-minute device slot leaves room for a machine start
and a rerun)."""
INSTALL_ESTIMATE_S = 45
"""Upper estimate of ``install.sh`` on the GPU machine (join, hashes, pip install of the
bundle and nrl's editable packages); the measured time is in docs/performance.md."""
NOT_COVERED = (
    "vLLM and SGLang do not run here: their wheels are far larger than the 64 MiB a device "
    "command can carry, and the GPU machines have no network. vLLM 0.26.0 (the torch-2.11 "
    "build) travels in a chain of calls of its own (gpu_bundle.py --vllm, then gpu_vllm.py; "
    "benchmarks/README.md); SGLang does not; the engines' GPU paths stay pinned by gpu_sim "
    "tests (README, 'The GPU path')."
)
GRACE_S = 20
"""After a stage's limit: SIGTERM (a Ray head in it shuts down cleanly), then this long before
SIGKILL to its process group."""


def plan_seconds(profile: Profile) -> int:
    """The longest one invocation of every stage can take with ``profile``, the bundle's
    install before it included: the install estimate, every stage's limit (the default
    ``--budget-s`` caps their sum) and the grace of a last stage stopped at its limit."""
    return INSTALL_ESTIMATE_S + sum(profile.limits.get(name, 0) for name in STAGES) + GRACE_S


class UsageError(Exception):
    """A bad command-line argument (one ``error:`` line, exit 2)."""


class Skip(Exception):
    """A stage that cannot run here; the message says why."""


class StageFailed(Exception):
    """A stage ran but a check of its result failed; the message says which."""


def check(condition: bool, message: str) -> None:
    """Fail the stage with ``message`` unless ``condition`` (asserts vanish under ``-O``)."""
    if not condition:
        raise StageFailed(message)


# ---------------------------------------------------------------------------------------------
# What a stage gets


@dataclass(frozen=True)
class StageContext:
    """Where and how big: passed to every stage function (as JSON between processes)."""

    device: str
    """``cuda`` or ``cpu``."""
    profile: Profile
    workdir: str
    limit_s: float

    @property
    def model_dir(self) -> Path:
        """The built model's folder, reused by later runs on the same workdir; named after the
        profile and a digest of its shape, so a changed shape is built anew."""
        import hashlib

        p = self.profile
        shape = [p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads]
        shape += [p.intermediate_size, p.vocab_size, p.dtype]
        digest = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:8]
        return Path(self.workdir) / f"model-{p.name}-{digest}"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "profile": asdict(self.profile)})

    @classmethod
    def from_json(cls, text: str) -> StageContext:
        raw = json.loads(text)
        profile = raw.pop("profile")
        profile["grpo_overrides"] = tuple(profile["grpo_overrides"])
        return cls(profile=Profile(**profile), **raw)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _synchronize(ctx: StageContext) -> None:
    if ctx.on_gpu:
        import torch

        torch.cuda.synchronize()


def _reset_peak_memory(ctx: StageContext) -> None:
    if ctx.on_gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gb(ctx: StageContext) -> float:
    """Peak GPU memory allocated by torch on ``cuda``; the process's peak RSS on ``cpu``."""
    if ctx.on_gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Stage: model


def stage_model(ctx: StageContext) -> dict[str, Any]:
    """Build the profile's Qwen2-shaped model + tokenizer once per workdir."""
    import torch

    target = ctx.model_dir
    info_file = target / "acceptance.json"
    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if ctx.on_gpu else platform.processor(),
    }
    if info_file.exists():
        return {**json.loads(info_file.read_text()), **figures, "cached": True}
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nrl_core.testing.tiny import build_tokenizer

    p = ctx.profile
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=p.vocab_size or -(-len(tokenizer) // 64) * 64,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    started = time.perf_counter()
    # Random init on the device itself: ~0.5B normal draws take minutes on a CPU.
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config)
    # Saved from host memory in the profile's precision (what from_pretrained then reads).
    model = model.to(device="cpu", dtype=_torch_dtype(p.dtype))
    params = sum(t.numel() for t in model.parameters())
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    info = {
        "params_m": round(params / 1e6, 1),
        "dtype": p.dtype,
        "vocab_size": config.vocab_size,
        "layers": p.num_layers,
        "hidden_size": p.hidden_size,
        "build_s": round(time.perf_counter() - started, 2),
        "path": str(target),
    }
    (partial / "acceptance.json").write_text(json.dumps(info))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # complete or absent: a killed build is redone next time
    return {**info, **figures, "cached": False}


def _require_model(ctx: StageContext) -> Path:
    if not (ctx.model_dir / "acceptance.json").exists():
        raise StageFailed(f"no built model in {ctx.model_dir}; run the `model` stage first")
    return ctx.model_dir


# ---------------------------------------------------------------------------------------------
# Stages: dtensor and megatron (one policy rank through the core's Policy facade)


def _run_config(
    ctx: StageContext, backend: str, model: Path | None = None, lr: float | None = None
):
    """A GRPO run config whose policy section is the built model (or ``model``) in the
    profile's precision (learning rate: the profile's, or ``lr``)."""
    from nrl_core.config.schema import GRPOConfig, OptimizerConfig, PolicyConfig

    p = ctx.profile
    policy = PolicyConfig(
        backend=backend,
        model_name=str(model or _require_model(ctx)),
        precision=p.dtype,
        num_workers=1,
        train_global_batch_size=p.train_batch,
        train_micro_batch_size=p.micro_batch,
        logprob_batch_size=p.micro_batch,
        max_total_sequence_length=p.train_seq,
        max_grad_norm=1.0,
        optimizer=OptimizerConfig(name="adamw", lr=lr or p.lr),
    )
    return GRPOConfig(seed=0, policy=policy)


def _train_batch(ctx: StageContext, vocab_size: int):
    """Random sequences, lengths between half and all of ``train_seq``, loss on all but the
    first 4 tokens (a "prompt")."""
    import torch

    from nrl_core.data import Batch, pad_sequences

    p = ctx.profile
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(p.train_seq // 2, p.train_seq + 1, (p.train_batch,), generator=g)
    rows = [torch.randint(7, vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    ids = pad_sequences(rows, pad_value=0)
    pos = torch.arange(ids.shape[1])[None, :]
    return Batch(
        {
            "input_ids": ids,
            "lengths": lengths,
            "loss_mask": ((pos >= 4) & (pos < lengths[:, None])).float(),
            "sample_mask": torch.ones(p.train_batch),
        }
    )


def _measure_policy(ctx: StageContext, worker, policy, vocab_size: int) -> dict[str, Any]:
    """Warm-up step, timed steps and a timed logprob pass over one batch; checks that the
    loss is finite and goes down on the batch it trains on, and that logprobs are sane. Then
    the colocated-engine hand-over (:func:`_offload_round_trip`)."""
    import math

    import torch

    from nrl_core.losses.nll import NLLLoss

    p = ctx.profile
    batch = _train_batch(ctx, vocab_size)
    tokens = int(batch["lengths"].sum())
    loss = NLLLoss()
    _reset_peak_memory(ctx)
    first = policy.train(batch, loss)
    check(math.isfinite(first["loss"]), f"warm-up loss is {first['loss']}")
    _synchronize(ctx)
    started = time.perf_counter()
    for _ in range(p.train_steps):
        last = policy.train(batch, loss)
    _synchronize(ctx)
    train_s = time.perf_counter() - started
    check(math.isfinite(last["grad_norm"]) and last["grad_norm"] > 0, f"grad_norm {last}")
    check(
        last["loss"] < first["loss"],
        f"loss did not go down on the batch it trains on: {first['loss']} -> {last['loss']}",
    )
    policy.get_logprobs(batch)  # warm-up of the no-grad path
    _synchronize(ctx)
    started = time.perf_counter()
    logprobs = policy.get_logprobs(batch)
    _synchronize(ctx)
    logprob_s = time.perf_counter() - started
    valid = torch.arange(logprobs.shape[1])[None, :] < batch["lengths"][:, None]
    valid[:, 0] = False
    check(tuple(logprobs.shape) == tuple(batch["input_ids"].shape), f"logprobs {logprobs.shape}")
    check(bool(torch.isfinite(logprobs).all()), "non-finite logprobs")
    check(bool((logprobs[valid] <= 0).all()), "a logprob above 0")
    peak_gb = _peak_memory_gb(ctx)
    handover = _offload_round_trip(ctx, worker, lambda: policy.train(batch, loss), last["loss"])
    return {
        "train_tokens_per_s": round(tokens * p.train_steps / train_s, 1),
        "logprob_tokens_per_s": round(tokens / logprob_s, 1),
        "tokens_per_step": tokens,
        "train_step_s": round(train_s / p.train_steps, 4),
        "loss_first": round(first["loss"], 4),
        "loss_last": round(last["loss"], 4),
        "grad_norm": round(last["grad_norm"], 4),
        "peak_mem_gb": round(peak_gb, 3),
        "dtype": p.dtype,
        **handover,
    }


def _offload_round_trip(ctx: StageContext, worker, train_step, loss_before: float) -> dict:
    """What the core does around a refit into engines colocated on the policy's GPU
    (:class:`nrl_core.generation.GenerationEngines`): ``offload(["optimizer"])``, then
    ``offload(["weights"])``, then ``onload()`` before the next step. On a GPU the memory
    must go down and come back; on CPU both are no-ops. The step after must still train."""
    import math

    def allocated() -> float:
        if not ctx.on_gpu:
            return 0.0
        import torch

        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**30

    before = allocated()
    started = time.perf_counter()
    worker.offload(["optimizer"])
    worker.offload(["weights"])
    offload_s = time.perf_counter() - started
    during = allocated()
    if ctx.on_gpu:
        # Weights, gradients and Adam state are most of what a trained policy holds.
        check(during < 0.5 * before, f"offload left {during:.2f} of {before:.2f} GiB on the GPU")
    started = time.perf_counter()
    worker.onload()
    onload_s = time.perf_counter() - started
    after_onload = allocated()
    after = train_step()
    check(
        math.isfinite(after["loss"]) and after["loss"] < loss_before,
        f"the step after offload/onload did not train: loss {loss_before} -> {after['loss']}",
    )
    return {
        "mem_before_offload_gb": round(before, 3),
        "mem_offloaded_gb": round(during, 3),
        "mem_after_onload_gb": round(after_onload, 3),
        "offload_freed_gb": round(before - during, 3),
        "offload_s": round(offload_s, 3),
        "onload_s": round(onload_s, 3),
        "loss_after_onload": round(after["loss"], 4),
    }


def stage_dtensor(ctx: StageContext) -> dict[str, Any]:
    """One rank of the dtensor policy in a real torch.distributed world of size 1."""
    # The variables a WorkerGroup gives its ranks: the worker then initialises the default
    # process group itself (env://), NCCL on a GPU and gloo otherwise, and applies FSDP2.
    os.environ.update(
        {
            "WORLD_SIZE": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
    )
    import torch.distributed as dist
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    config = _run_config(ctx, "dtensor")
    context = ComponentContext(config=config, rank=0, world_size=1, seed=config.seed)
    # FSDP2 explicitly: `auto` replicates small models on CPU, and this stage checks FSDP2.
    worker = DTensorPolicyWorker(DTensorConfig(data_parallel="shard"), context)
    try:
        backend = dist.get_backend()
        want = "nccl" if ctx.on_gpu else "gloo"
        check(backend == want, f"process group backend {backend}, expected {want}")
        params = list(worker.model.parameters())
        check(
            all(hasattr(p, "device_mesh") for p in params),
            "FSDP2 was not applied (parameters are not DTensors)",
        )
        devices = {p.device.type for p in params}
        check(devices == {ctx.device}, f"parameters on {devices}, expected {ctx.device}")
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        figures = _measure_policy(ctx, worker, policy, worker.hf_config.vocab_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"backend": backend, "fsdp": True, **figures}


def _have_megatron() -> bool:
    import importlib.util

    try:  # find_spec of a submodule raises when the parent package is missing
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _check_megatron_path(ctx: StageContext, worker: Any) -> bool:
    """On a GPU the worker must take Megatron's own path (DDP + distributed optimizer) with its
    parameters on the device; on CPU it falls back to torch.optim over the same module (see
    nrl_megatron.worker). Returns whether Megatron's distributed optimizer is in use."""
    uses_megatron_optimizer = worker.megatron_optimizer is not None
    check(
        uses_megatron_optimizer == ctx.on_gpu,
        f"Megatron distributed optimizer in use: {uses_megatron_optimizer} on {ctx.device}",
    )
    devices = {p.device.type for p in worker.module.parameters()}
    check(devices == {ctx.device}, f"parameters on {devices}, expected {ctx.device}")
    return uses_megatron_optimizer


def stage_megatron(ctx: StageContext) -> dict[str, Any]:
    """One rank of the megatron policy (it starts its own one-rank world)."""
    if not _have_megatron():
        raise Skip(
            "megatron-core not installed (the GPU bundle brings its wheel: "
            "benchmarks/gpu_bundle.py; on CPU: nox -s plugin-megatron)"
        )
    import torch.distributed as dist
    from nrl_megatron.config import MegatronConfig
    from nrl_megatron.worker import MegatronPolicyWorker

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    config = _run_config(ctx, "megatron")
    worker = MegatronPolicyWorker(MegatronConfig(), ComponentContext(config=config, seed=0))
    try:
        uses_megatron_optimizer = _check_megatron_path(ctx, worker)
        refit = _megatron_refit_content(ctx, worker)
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        # policy.sequence_packing=auto: the steps and logprobs above run packed (THD).
        check(policy.packing, "the megatron policy did not pack (sequence_packing=auto)")
        figures = {**_measure_policy(ctx, worker, policy, worker.hf_config.vocab_size), **refit}
        figures.update(_packed_against_padded(ctx, worker, config, policy))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    optimizer = "megatron-distributed" if uses_megatron_optimizer else "torch"
    return {"optimizer": optimizer, "backend": "nccl" if ctx.on_gpu else "gloo", **figures}


def _packed_against_padded(ctx: StageContext, worker, config, packed) -> dict[str, Any]:
    """Logprobs of one batch through the packed (THD) path and the padded one, same weights:
    the packed row attends within each sample (Megatron's ``PackedSeqParams``), so the two
    agree up to the precision's rounding (bf16 on a GPU: different kernel shapes round
    differently; float32 on CPU: within 1e-4 on average)."""
    import attrs
    import torch

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.policy import Policy

    padded = Policy.from_config(
        InProcessGroup(worker), attrs.evolve(config.policy, sequence_packing=False)
    )
    check(not padded.packing, "sequence_packing=false still packs")
    batch = _train_batch(ctx, worker.hf_config.vocab_size)
    got, want = packed.get_logprobs(batch), padded.get_logprobs(batch)
    valid = torch.arange(got.shape[1])[None, :] < batch["lengths"][:, None]
    valid[:, 0] = False
    diff = (got - want)[valid].abs()
    mean_tol = 0.05 if ctx.on_gpu else 1e-4
    check(
        float(diff.mean()) <= mean_tol,
        f"packed and padded logprobs differ by {float(diff.mean()):.3g} on average "
        f"(max {float(diff.max()):.3g}; allowed mean {mean_tol})",
    )
    return {
        "packed": True,
        "packed_vs_padded_mean_abs": float(f"{float(diff.mean()):.3g}"),
        "packed_vs_padded_max_abs": float(f"{float(diff.max()):.3g}"),
    }


def _megatron_refit_content(ctx: StageContext, worker) -> dict[str, Any]:
    """What a refit from this worker sends an engine, before any step: the Hugging Face-named
    buckets of ``state_dict_buckets`` (Megatron -> HF conversion, gathered on the device) must
    be bit-exact copies of the checkpoint the worker loaded."""
    import torch
    from safetensors.torch import load_file

    p = ctx.profile
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(_require_model(ctx).glob("*.safetensors")):
        saved.update(load_file(str(file)))
    _synchronize(ctx)
    started = time.perf_counter()
    sent: dict[str, str] = {}
    total_bytes = buckets = 0
    differ = []
    for bucket in worker.state_dict_buckets(int(p.refit_bucket_mb * 2**20)):
        buckets += 1
        for name, tensor in bucket.items():
            sent[name] = str(tensor.device.type)
            total_bytes += tensor.numel() * tensor.element_size()
            if name in saved and not torch.equal(tensor.cpu(), saved[name]):
                differ.append(name)
    _synchronize(ctx)
    seconds = time.perf_counter() - started
    # Tied embeddings: a checkpoint may hold lm_head.weight or not; the engine ties it either way.
    missing = sorted(set(saved) - set(sent) - {"lm_head.weight"})
    extra = sorted(set(sent) - set(saved) - {"lm_head.weight"})
    check(not missing, f"refit lacks {len(missing)} checkpoint tensors, e.g. {missing[:3]}")
    check(not extra, f"refit sends {len(extra)} names the checkpoint lacks, e.g. {extra[:3]}")
    check(not differ, f"refit: {len(differ)} tensors differ from the checkpoint: {differ[:3]}")
    check(set(sent.values()) == {ctx.device}, f"refit buckets on {set(sent.values())}")
    return {
        "refit_tensors": len(sent),
        "refit_buckets": buckets,
        "refit_gb": round(total_bytes / 1e9, 4),
        "refit_gather_gb_per_s": round(total_bytes / 1e9 / seconds, 3),
        "refit_bit_exact": True,
    }


MOE_EXPERTS, MOE_TOP_K = 4, 2
"""The tiny Qwen3-MoE of the ``megatron_moe`` stage (as plugins/nrl-megatron/tests/test_moe.py)."""


def _moe_model(ctx: StageContext) -> Path:
    """The tiny Qwen3-MoE (every layer a mixture of 4 experts, top-2) in the profile's
    precision, built once per workdir; whatever the profile, the stage checks the MoE path,
    not throughput."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.testing.tiny import build_tiny_model

    target = Path(ctx.workdir) / f"moe-{ctx.profile.dtype}"
    if (target / "config.json").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    source = build_tiny_model(
        partial.with_name(partial.name + "-f32"),
        arch="qwen3_moe",
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    # transformers' router init (std 0.02) routes nearly every token to the same experts;
    # larger router weights spread them, so that the routing and its statistics mean something.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    # Saved in the policy's precision, so that the refit and the export can be bit-exact.
    model = model.to(_torch_dtype(ctx.profile.dtype))
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(source).save_pretrained(partial)
    shutil.rmtree(source, ignore_errors=True)
    del model
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def stage_megatron_moe(ctx: StageContext) -> dict[str, Any]:
    """One rank of the megatron policy on the tiny Qwen3-MoE: on ``cuda`` the path CPU cannot
    build (Megatron-Core's ``alltoall`` dispatcher creates a CUDA stream; Megatron DDP with the
    experts in its buffers; the distributed optimizer), bf16; on ``cpu`` the ``allgather``
    dispatcher and torch.optim, float32. Checks, in order: the refit's Hugging Face-named
    tensors are transformers' in-memory state dict, each name once, bit-exact; ``export_hf``
    writes the checkpoint's per-expert files, each expert once, bit-exact; logprobs equal
    transformers' forward of the same weights on the device; training steps lower the loss and
    report the router statistics (``train/moe/*``)."""
    if not _have_megatron():
        raise Skip(
            "megatron-core not installed (the GPU bundle brings its wheel: "
            "benchmarks/gpu_bundle.py; on CPU: nox -s plugin-megatron)"
        )
    import math

    import torch
    import torch.distributed as dist
    from nrl_megatron.config import MegatronConfig
    from nrl_megatron.moe import METRIC_REDUCTIONS
    from nrl_megatron.worker import MegatronPolicyWorker
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.losses.nll import NLLLoss
    from nrl_core.policy import Policy

    p = ctx.profile
    path = _moe_model(ctx)
    # The tiny model's learning rate whatever the profile: a few steps must lower the loss
    # clearly above bf16's rounding (the 0.5B profiles' 1e-4 is sized for the 0.5B model).
    config = _run_config(ctx, "megatron", model=path, lr=1e-3)
    dtype = _torch_dtype(p.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    worker = MegatronPolicyWorker(MegatronConfig(), ComponentContext(config=config, seed=0))
    try:
        dispatcher = worker.module.config.moe_token_dispatcher_type
        want = "alltoall" if ctx.on_gpu else "allgather"
        check(dispatcher == want, f"MoE token dispatcher {dispatcher!r}, expected {want!r}")
        uses_megatron_optimizer = _check_megatron_path(ctx, worker)

        # The refit: transformers' in-memory names (experts stacked), each once, bit-exact.
        sent: list[str] = []
        differ = []
        for bucket in worker.state_dict_buckets(int(p.refit_bucket_mb * 2**20)):
            for name, tensor in bucket.items():
                sent.append(name)
                want_t = hf_state.get(name)
                if want_t is None or not torch.equal(tensor.cpu(), want_t):
                    differ.append(name)
        twice = sorted({n for n in sent if sent.count(n) > 1})
        check(not twice, f"refit sends {len(twice)} names more than once, e.g. {twice[:3]}")
        missing = sorted(set(hf_state) - set(sent) - {"lm_head.weight"})
        check(not missing, f"refit lacks {len(missing)} tensors, e.g. {missing[:3]}")
        check(not differ, f"refit: {len(differ)} tensors differ from transformers': {differ[:3]}")

        # The export: the checkpoint's published (per-expert) files, each expert once.
        exported = Path(ctx.workdir) / "moe-export"
        shutil.rmtree(exported, ignore_errors=True)
        worker.export_hf(str(exported))
        saved = _safetensors(path, load_file)
        written = _safetensors(exported, load_file)
        experts = [n for n in written if ".mlp.experts." in n]
        layers = worker.hf_config.num_hidden_layers
        # gate, up and down of every expert of every layer, each under its own name.
        check(
            len(experts) == len(set(experts)) == 3 * MOE_EXPERTS * layers,
            f"export holds {len(experts)} expert tensors, expected {3 * MOE_EXPERTS * layers}",
        )
        check(
            written.keys() == saved.keys(),
            f"export names differ from the checkpoint's: {sorted(written.keys() ^ saved.keys())[:3]}",
        )
        differ = [n for n in saved if not torch.equal(written[n], saved[n])]
        check(not differ, f"export: {len(differ)} tensors differ from the checkpoint: {differ[:3]}")

        # Logprobs before any step against transformers' forward of the same weights.
        policy = Policy.from_config(InProcessGroup(worker), config.policy)
        batch = _train_batch(ctx, worker.hf_config.vocab_size)
        got = policy.get_logprobs(batch).float()
        hf.to(ctx.device)
        ids = batch["input_ids"].to(ctx.device)
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids).logits[:, :-1].float(), -1)
        want_lp = torch.nn.functional.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        del hf
        valid = torch.arange(got.shape[1])[None, :] < batch["lengths"][:, None]
        valid[:, 0] = False
        diff = (got - want_lp.cpu())[valid].abs()
        # float32 on CPU: the experts' outputs are summed in another order (test_moe.py: 1e-5
        # absolute per token); bf16 on a GPU rounds each kernel shape differently.
        mean_tol = 0.05 if ctx.on_gpu else 1e-5
        check(
            float(diff.mean()) <= mean_tol,
            f"Megatron and transformers logprobs differ by {float(diff.mean()):.3g} on average "
            f"(max {float(diff.max()):.3g}; allowed mean {mean_tol})",
        )

        # Training steps with the router statistics of each.
        loss = NLLLoss()
        tokens = int(batch["lengths"].sum())
        _reset_peak_memory(ctx)
        first = policy.train(batch, loss)
        _synchronize(ctx)
        started = time.perf_counter()
        for _ in range(p.train_steps):
            last = policy.train(batch, loss)
        _synchronize(ctx)
        train_s = time.perf_counter() - started
        check(
            math.isfinite(first["loss"]) and last["loss"] < first["loss"],
            f"loss did not go down on the batch it trains on: {first['loss']} -> {last['loss']}",
        )
        check(math.isfinite(last["grad_norm"]) and last["grad_norm"] > 0, f"grad_norm {last}")
        moe = {}
        for key in METRIC_REDUCTIONS:
            check(key in last, f"the step reports no {key} (keys: {sorted(last)})")
            check(math.isfinite(last[key]), f"{key} is {last[key]}")
            moe[f"train/{key}"] = round(float(last[key]), 5)
        # Dropless top-k routing: the busiest expert takes at least the mean load and at most
        # every token (num_experts / top_k times the mean).
        check(
            1 <= moe["train/moe/max_load"] <= MOE_EXPERTS / MOE_TOP_K + 1e-6,
            f"train/moe/max_load {moe['train/moe/max_load']} outside [1, {MOE_EXPERTS / MOE_TOP_K}]",
        )
        peak_gb = _peak_memory_gb(ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "dispatcher": dispatcher,
        "optimizer": "megatron-distributed" if uses_megatron_optimizer else "torch",
        "backend": "nccl" if ctx.on_gpu else "gloo",
        "dtype": p.dtype,
        "experts": MOE_EXPERTS,
        "top_k": MOE_TOP_K,
        "hf_logprob_mean_abs": float(f"{float(diff.mean()):.3g}"),
        "hf_logprob_max_abs": float(f"{float(diff.max()):.3g}"),
        "refit_tensors": len(sent),
        "refit_bit_exact": True,
        "export_tensors": len(written),
        "export_expert_tensors": len(experts),
        "export_bit_exact": True,
        "train_tokens_per_s": round(tokens * p.train_steps / train_s, 1),
        "loss_first": round(first["loss"], 4),
        "loss_last": round(last["loss"], 4),
        "grad_norm": round(last["grad_norm"], 4),
        "peak_mem_gb": round(peak_gb, 3),
        **moe,
    }


def _safetensors(folder: Path, load_file) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


# ---------------------------------------------------------------------------------------------
# Stage: generation


def _device(ctx: StageContext):
    import torch

    if not ctx.on_gpu:
        return torch.device("cpu")
    from nrl_core.distributed.devices import select_cuda_device

    return select_cuda_device()


def stage_generation(ctx: StageContext) -> dict[str, Any]:
    """TorchGenerator over the built model on the device: sampled tokens/s."""
    import math

    import torch
    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.generation import TorchGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_core.interfaces import SamplingParams

    p = ctx.profile
    path = _require_model(ctx)
    device = _device(ctx)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(p.dtype))
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    generator = TorchGenerator(
        # Fixed-length samples: a random model's EOS would make the token count luck.
        TorchGenerationConfig(generation_batch_size=p.gen_prompts, stop_at_eos=False),
        model=model,
        tokenizer=tokenizer,
        device=device,
    )
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(7, len(tokenizer), (p.gen_prompts, p.gen_prompt_len), generator=g)
    prompts = prompts.tolist()
    params = SamplingParams(max_new_tokens=p.gen_new_tokens, temperature=1.0, seed=0)
    generator.generate(prompts, params)  # warm-up: allocator, kernels
    _reset_peak_memory(ctx)
    _synchronize(ctx)
    started = time.perf_counter()
    out = generator.generate(prompts, params)
    _synchronize(ctx)
    seconds = time.perf_counter() - started
    lengths = {len(t) for t in out.token_ids}
    check(lengths == {p.gen_new_tokens}, f"generated lengths {lengths}, want {p.gen_new_tokens}")
    check(
        all(len(lp) == len(t) for lp, t in zip(out.logprobs, out.token_ids, strict=True)),
        "one logprob per generated token",
    )
    flat = [x for row in out.logprobs for x in row]
    check(all(math.isfinite(x) and x <= 0 for x in flat), "generated logprobs not finite and <= 0")
    vocab = model.config.vocab_size
    check(all(0 <= t < vocab for row in out.token_ids for t in row), "token id out of range")
    tokens = sum(len(t) for t in out.token_ids)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "prompts": p.gen_prompts,
        "new_tokens": p.gen_new_tokens,
        "seconds": round(seconds, 3),
        "peak_mem_gb": round(_peak_memory_gb(ctx), 3),
        "dtype": p.dtype,
    }


# ---------------------------------------------------------------------------------------------
# Stage: cuda_ipc_refit


class RefitEndpoint:
    """One end of the refit stage, built in a Ray actor by a WorkerGroup: the sender holds the
    built model's weights (as a policy rank holds its state dict) and pushes them through a
    :class:`~nrl_core.weight_sync.WeightSender`; the receiver implements the engine side of
    :class:`~nrl_core.interfaces.WeightSync` with :func:`~nrl_core.weight_sync.receive_into`
    and keeps copies of what arrived, for the bit-exact check.

    With :meth:`use_wire_form` on, the receiver first sends each message through msgpack in
    nrl's wire form (``BucketMeta.to_wire`` / ``handle_to_wire``), as an engine behind a
    plain-data RPC layer receives it (vLLM's engine core; see nrl_core/weight_sync/wire.py), and
    opens the rebuilt handle: on a GPU, CUDA IPC handles that crossed msgpack."""

    def __init__(self, model_path: str, device: str, dtype: str, load: bool) -> None:
        import torch

        if device == "cuda":
            from nrl_core.distributed.devices import select_cuda_device

            self.device = select_cuda_device()
        else:
            self.device = torch.device("cpu")
        self.tensors: dict[str, torch.Tensor] = {}
        if load:
            from safetensors.torch import load_file

            for file in sorted(Path(model_path).glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    self.tensors[name] = tensor.to(self.device, getattr(torch, dtype))
        self.received: dict[str, torch.Tensor] = {}
        self.updates = 0
        self.wire_form = False

    def memory_gb(self) -> float:
        """GPU memory torch holds in this process (0 on CPU)."""
        import torch

        if self.device.type != "cuda":
            return 0.0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) / 2**30

    def describe(self) -> dict[str, Any]:
        """Process id, device and (on a GPU) the GPU's UUID and CUDA_VISIBLE_DEVICES."""
        import torch

        info = {"pid": os.getpid(), "device": str(self.device)}
        if self.device.type == "cuda":
            info["gpu_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
            info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        return info

    # -- sender

    def push_weights(self, sender, bucket_bytes: int):
        """Send every tensor through ``sender`` (as ``DTensorPolicyWorker.push_weights`` on a
        single rank); returns the :class:`~nrl_core.weight_sync.RefitStats`."""
        from nrl_core.weight_sync import iter_buckets

        return sender.send(iter_buckets(iter(self.tensors.items()), bucket_bytes))

    # -- receiver (WeightSync)

    def use_wire_form(self, on: bool) -> None:
        """Receive the next refits through msgpack in the wire form (see the class doc)."""
        self.wire_form = on

    def begin_weight_update(self) -> None:
        self.received = {}

    def receive_bucket(self, meta, handle) -> int:
        from nrl_core.weight_sync import receive_into

        if self.wire_form:
            import msgpack  # a dependency of Ray, so present wherever this actor runs

            from nrl_core.weight_sync import BucketMeta, handle_from_wire, handle_to_wire

            packed = msgpack.packb([meta.to_wire(), handle_to_wire(handle)])
            wire_meta, wire_handle = msgpack.unpackb(packed)
            meta, handle = BucketMeta.from_wire(wire_meta), handle_from_wire(wire_handle)

        def load(named) -> None:
            for name, tensor in named:
                self.received[name] = tensor.clone()  # the views die with the bucket

        return receive_into(meta, handle, load, device=self.device)

    def finish_weight_update(self) -> None:
        self.updates += 1

    # -- both

    def digests(self, which: str) -> dict[str, str]:
        """sha256 of each tensor's bytes (``which``: ``tensors`` or ``received``)."""
        import hashlib

        import torch

        out = {}
        for name, tensor in getattr(self, which).items():
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha256(raw).hexdigest()
        return out


def stage_cuda_ipc_refit(ctx: StageContext) -> dict[str, Any]:
    """The built model's weights from one Ray actor to another through WeightSender."""
    import uuid

    from nrl_core.config.schema import ClusterConfig, RunConfig
    from nrl_core.distributed.cluster import LocalCluster
    from nrl_core.distributed.worker_group import WorkerGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.weight_sync import WeightSender

    p = ctx.profile
    path = str(_require_model(ctx))
    transport = "cuda_ipc" if ctx.on_gpu else "shm"
    config = RunConfig(cluster=ClusterConfig(num_cpus=2, gpus_per_node=1 if ctx.on_gpu else 0))
    cluster = LocalCluster(
        None,
        ComponentContext(config=config),
        log_dir=Path(ctx.workdir) / "refit-ray",
        temp_dir=f"/tmp/nrl-acc-{uuid.uuid4().hex[:6]}",
    )
    cluster.start()
    groups = []
    try:
        # Half a GPU each: Ray places both actors on the one GPU, each with its own narrowed
        # CUDA_VISIBLE_DEVICES, as a colocated policy rank and engine are placed.
        common = {
            "num_cpus_per_worker": 0.5,
            "num_gpus_per_worker": 0.5 if ctx.on_gpu else 0,
            "timeout_s": ctx.limit_s,
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
            },
        }
        target = f"{Path(__file__).stem}:RefitEndpoint"
        sender_group = WorkerGroup.start(
            target, 1, args=(path, ctx.device, p.dtype, True), name="refit-sender", **common
        )
        groups.append(sender_group)
        receiver_group = WorkerGroup.start(
            target, 1, args=(path, ctx.device, p.dtype, False), name="refit-receiver", **common
        )
        groups.append(receiver_group)
        ends = [sender_group.run_all("describe")[0], receiver_group.run_all("describe")[0]]
        check(ends[0]["pid"] != ends[1]["pid"], "sender and receiver share a process")
        if ctx.on_gpu:
            check(
                ends[0]["gpu_uuid"] == ends[1]["gpu_uuid"],
                f"sender and receiver on different GPUs: {ends}",
            )
        sender = WeightSender(
            receivers=receiver_group.actors, transport=transport, timeout_s=ctx.limit_s
        )
        bucket_bytes = int(p.refit_bucket_mb * 2**20)
        sent = sender_group.run_all("digests", "tensors")[0]

        def refits(count: int, phase: str) -> list:
            runs = [
                sender_group.run_all("push_weights", sender, bucket_bytes)[0] for _ in range(count)
            ]
            got = receiver_group.run_all("digests", "received")[0]
            check(
                sorted(got) == sorted(sent),
                f"{phase}: received names differ: {sorted(set(got) ^ set(sent))[:5]}",
            )
            differ = [name for name in sent if got[name] != sent[name]]
            check(not differ, f"{phase}: {len(differ)} tensors differ, e.g. {differ[:3]}")
            return runs

        memory = {"before": [g.run_all("memory_gb")[0] for g in groups]}
        runs = refits(1, "first refit")
        memory["after_first"] = [g.run_all("memory_gb")[0] for g in groups]
        runs += refits(p.refit_repeats, "refit")
        memory["after_last"] = [g.run_all("memory_gb")[0] for g in groups]
        # Repeated refits must not pile up memory in either process (a bucket each at most:
        # a transport may keep its staging buffer for the next refit).
        bucket_gb = bucket_bytes / 2**30
        grown = [b - a for a, b in zip(memory["after_first"], memory["after_last"], strict=True)]
        check(
            max(grown) <= bucket_gb + 0.01,
            f"memory grew by {grown} GiB (sender, receiver) over {p.refit_repeats} refits",
        )
        receiver_group.run_all("use_wire_form", True)
        wire = refits(1, "refit through msgpack in the wire form")
    finally:
        for group in reversed(groups):
            group.shutdown()
        cluster.shutdown()
    best = min(runs[1:], key=lambda r: r.seconds)
    return {
        "transport": transport,
        "gb_per_s": round(best.bytes / 1e9 / best.seconds, 3),
        "first_gb_per_s": round(runs[0].bytes / 1e9 / runs[0].seconds, 3),
        "gb": round(best.bytes / 1e9, 4),
        "buckets": best.buckets,
        "tensors": best.tensors,
        "seconds": round(best.seconds, 4),
        "bit_exact": True,
        "wire_form_gb_per_s": round(wire[0].bytes / 1e9 / wire[0].seconds, 3),
        "mem_gb_sender_receiver": {k: [round(x, 3) for x in v] for k, v in memory.items()},
        "processes": [ends[0]["pid"], ends[1]["pid"]],
        "devices": [ends[0]["device"], ends[1]["device"]],
    }


# ---------------------------------------------------------------------------------------------
# Stage: grpo_step


GRPO_KEYS = (
    "timing/step_s",
    "timing/generation_s",
    "timing/logprobs_s",
    "timing/train_s",
    "timing/refit_s",
    "throughput/tokens_per_s",
    "train/loss",
    "train/response_length_mean",
    "train/gen_logprob_error",
    "train/gen_logprob_error_max",
)


def stage_grpo_step(ctx: StageContext) -> dict[str, Any]:
    """``nrl run grpo`` for 2 steps on the built model; figures of the last step."""
    import math

    path = _require_model(ctx)
    log_dir = Path(ctx.workdir) / "grpo"
    shutil.rmtree(log_dir, ignore_errors=True)  # a finished run would not train again
    steps = 2
    command = [
        sys.executable,
        "-m",
        "nrl_core.cli",
        "run",
        "grpo",
        "-q",
        f"policy.model_name={path}",
        f"policy.precision={ctx.profile.dtype}",
        "policy.backend=dtensor",
        "policy.num_workers=1",
        f"policy.optimizer.lr={ctx.profile.lr}",
        "generation.backend=torch",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.sft_warmup_steps=0",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.run_name=run",
        "cluster.num_cpus=2" if not ctx.on_gpu else f"cluster.num_cpus={os.cpu_count() or 2}",
        f"cluster.gpus_per_node={1 if ctx.on_gpu else 0}",
        f"cluster.worker_timeout_s={ctx.limit_s}",
        # The trainer recomputes the rollouts' logprobs, so that train/gen_logprob_error
        # measures how far torch generation and the trainer agree (bf16 on a GPU).
        "loss.clipped_pg.on_policy_shortcut=false",
        *ctx.profile.grpo_overrides,
    ]
    print("$", " ".join(command), flush=True)
    # NRL_ACTOR_ENV=system: the actors run in this interpreter, no per-plugin venv is built.
    env = {**os.environ, "NRL_ACTOR_ENV": "system"}
    run = subprocess.Popen(command, env=env)
    try:
        code = run.wait(max(30, ctx.limit_s - GRACE_S))
    except subprocess.TimeoutExpired:
        run.terminate()  # nrl stops its Ray head and exits 143 on SIGTERM
        code = run.wait()
    check(code == 0, f"nrl run grpo exited {code}; its log: {log_dir / 'run' / 'nrl.log'}")
    lines = (log_dir / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    trained = [r for r in records if "timing/step_s" in r]
    check(len(trained) == steps, f"{len(trained)} training steps logged, want {steps}")
    last = trained[-1]
    missing = [k for k in GRPO_KEYS if k not in last]
    check(not missing, f"metrics.jsonl lacks {missing}")
    check(last["throughput/tokens_per_s"] > 0, "throughput/tokens_per_s is 0")
    check(math.isfinite(last["train/loss"]), f"train/loss is {last['train/loss']}")
    return {
        "tokens_per_s": round(last["throughput/tokens_per_s"], 1),
        "first_step_tokens_per_s": round(trained[0]["throughput/tokens_per_s"], 1),
        "step_s": round(last["timing/step_s"], 3),
        "generation_s": round(last["timing/generation_s"], 3),
        "logprobs_s": round(last["timing/logprobs_s"], 3),
        "train_s": round(last["timing/train_s"], 3),
        "refit_s": round(last["timing/refit_s"], 3),
        "response_length_mean": last["train/response_length_mean"],
        # exp(|trainer - generator| logprob), token mean and max: 1.0 is exact agreement.
        "gen_logprob_error": round(last["train/gen_logprob_error"], 5),
        "gen_logprob_error_max": round(last["train/gen_logprob_error_max"], 4),
        "steps": steps,
    }


STAGE_FUNCTIONS = {
    "model": stage_model,
    "dtensor": stage_dtensor,
    "generation": stage_generation,
    "cuda_ipc_refit": stage_cuda_ipc_refit,
    "megatron": stage_megatron,
    "megatron_moe": stage_megatron_moe,
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


# ---------------------------------------------------------------------------------------------
# The parent: stages in subprocesses, the report


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
            str(Path(__file__).resolve()),
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
    parser = _Parser(description=__doc__.splitlines()[0])
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
