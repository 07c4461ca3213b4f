"""What every stage shares: the outcomes (:class:`Skip`, :class:`StageFailed`, :func:`check`),
the :class:`StageContext` a stage receives, and the device plumbing (dtype, synchronisation,
peak memory). Nothing heavy at import time: torch is imported inside the functions."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .profiles import Profile

MEGATRON_MISSING = (
    "megatron-core not installed (the GPU bundle brings its wheel: "
    "benchmarks/gpu_bundle.py; on CPU: nox -s plugin-megatron)"
)
"""The SKIP reason of the Megatron stages where megatron-core cannot be imported."""


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


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def synchronize(ctx: StageContext) -> None:
    if ctx.on_gpu:
        import torch

        torch.cuda.synchronize()


def reset_peak_memory(ctx: StageContext) -> None:
    if ctx.on_gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb(ctx: StageContext) -> float:
    """Peak GPU memory allocated by torch on ``cuda``; the process's peak RSS on ``cpu``."""
    if ctx.on_gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_model(ctx: StageContext) -> Path:
    """The built model's folder; FAIL when the ``model`` stage has not built it."""
    if not (ctx.model_dir / "acceptance.json").exists():
        raise StageFailed(f"no built model in {ctx.model_dir}; run the `model` stage first")
    return ctx.model_dir


def load_safetensors(folder: Path, load_file) -> dict[str, Any]:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name."""
    out: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def have_megatron() -> bool:
    """Whether megatron-core is importable (it is not in the dev venv)."""
    import importlib.util

    try:  # find_spec of a submodule raises when the parent package is missing
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def torch_device(ctx: StageContext):
    """The stage's torch device: the GPU nrl selects on ``cuda``, else the CPU."""
    import torch

    if not ctx.on_gpu:
        return torch.device("cpu")
    from nrl_core.distributed.devices import select_cuda_device

    return select_cuda_device()
