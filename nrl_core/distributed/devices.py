"""Which GPU a rank runs on.

Ray gives every actor that asks for GPUs its own ``CUDA_VISIBLE_DEVICES``: only the GPUs of
its placement bundle, renumbered from 0. ``LOCAL_RANK`` counts the group's ranks on a node, so
``cuda:LOCAL_RANK`` is not a device such an actor can see: rank 1 of a node would ask for
``cuda:1`` while seeing one GPU ("invalid device ordinal"). The device is therefore the
position of the actor's Ray-assigned GPU in its visible list. Outside Ray's GPU accounting
(``torchrun``, a plain script) ``LOCAL_RANK`` keeps its usual meaning.

Policy plugins call :func:`select_cuda_device` once, before ``init_process_group``; the core
owns this choice so that every plugin makes it the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from nrl_core.errors import NrlError


def nvidia_smi(field: str) -> list[str] | None:
    """One line per GPU of ``nvidia-smi --query-gpu=FIELD`` (``name``, ``memory.total``...; no
    header, no units), or ``None`` without a working ``nvidia-smi``. Light: no CUDA context."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def nvidia_gpus() -> list[str] | None:
    """The NVIDIA GPUs the driver lists (names), without importing torch; ``None`` when no
    driver is found. ``CUDA_VISIBLE_DEVICES`` is not applied (``nrl doctor -v`` asks torch).
    Light: imports neither torch nor Ray, so config-only commands can call it."""
    from pathlib import Path

    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        names = []
        for info in sorted(proc.glob("*/information")):
            model = next(
                (ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
                 if ln.startswith("Model:")),
                "NVIDIA GPU",
            )  # fmt: skip
            names.append(model)
        return names
    return nvidia_smi("name")


def machine_has_gpus() -> bool:
    """Whether this machine has NVIDIA GPUs a Ray node started here would count: the driver's
    list (:func:`nvidia_gpus`) narrowed by ``CUDA_VISIBLE_DEVICES`` when it is set, as Ray's
    own detection does. What ``nrl venvs build`` and ``nrl doctor`` go by, where no cluster is
    running (runs decide by their cluster's GPUs instead); imports neither torch nor Ray."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if not ids or ids[0] in ("-1", "NoDevFiles"):
            return False
    return bool(nvidia_gpus())


def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned to this process (strings, Ray's physical numbering), or an
    empty list outside a Ray worker or when no GPU was asked for."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a core dependency
        return []
    if not ray.is_initialized():
        return []
    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    return [str(i) for i in ids]


def visible_gpu_index(
    env: Mapping[str, str] | None = None, assigned: Sequence[str] | None = None
) -> int:
    """The index, in this process's CUDA numbering, of the GPU it should use.

    Args:
        env: the environment to read (default: ``os.environ``): ``CUDA_VISIBLE_DEVICES`` and,
            outside Ray, ``LOCAL_RANK``.
        assigned: the GPU ids Ray assigned to this process (default: :func:`ray_gpu_ids`);
            the first one is used (a policy rank asks for one GPU or a share of one).

    Raises:
        NrlError: Ray assigned a GPU that ``CUDA_VISIBLE_DEVICES`` hides.
    """
    env = os.environ if env is None else env
    assigned = ray_gpu_ids() if assigned is None else [str(a) for a in assigned]
    raw = env.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in raw.split(",") if d.strip()] if raw is not None else None
    if assigned:
        if visible is None:  # nothing narrowed (RAY_EXPERIMENTAL_NOSET_*): physical numbering
            return int(assigned[0])
        if assigned[0] in visible:
            return visible.index(assigned[0])
        raise NrlError(
            f"Ray assigned GPU {assigned[0]} to this worker but CUDA_VISIBLE_DEVICES={raw!r} "
            "hides it; do not override CUDA_VISIBLE_DEVICES in the workers' environment"
        )
    return int(env.get("LOCAL_RANK", 0))


def select_cuda_device() -> Any:
    """Make :func:`visible_gpu_index`'s GPU this process's current CUDA device; return it as a
    ``torch.device``. Call before ``torch.distributed.init_process_group``."""
    import torch

    device = torch.device("cuda", visible_gpu_index())
    torch.cuda.set_device(device)
    return device
