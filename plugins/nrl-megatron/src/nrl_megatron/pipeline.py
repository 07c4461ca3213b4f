"""Pipeline parallelism helpers: which layers a stage holds, and Megatron-Core's pipeline
schedule on CPU.

Megatron-Core's pipeline schedule (``get_forward_backward_func()``) runs on gloo once
three hard-coded CUDA device choices are mapped to the CPU; nothing else in it needs a GPU
(``benchmarks/megatron_pp_probe.py --cpu-devices`` first showed PP=2 equals PP=1 that way).
None of them can be chosen through an argument (0.16.1 and 0.19.2 alike):
``forward_backward_*`` accept a ``p2p_communicator`` and a ``pg_collection`` (process groups
only), but

- ``schedules.py`` allocates its token counter with ``torch.zeros([], ..., device="cuda")``
  (0.16.1: lines 596, 983 and 2138, one per schedule; 0.19.2: lines 749, 1121, 2292);
- ``p2p_communication.P2PCommunicator`` allocates every receive buffer and every shape
  message on ``torch.cuda.current_device()`` (0.16.1: lines 190-202, 313, 321; 0.19.2:
  211-223, 334, 342) and calls ``torch.cuda.synchronize()`` after batched sends (0.16.1:
  lines 242, 398; 0.19.2: 263, 419).

:func:`megatron_pipeline_on_cpu` is the adapter for exactly these: for the duration of one
schedule call, the name ``torch`` *inside those two Megatron modules only* refers to a proxy
of ``torch`` whose ``zeros(device="cuda")`` allocates on the CPU, whose
``cuda.current_device()`` is ``"cpu"`` and whose ``cuda.synchronize()`` does nothing (there is
no stream to wait for on the CPU; gloo's requests have been waited on). Everything else,
including ``torch`` itself, is untouched, and the originals are restored on exit. It is used
on CPU only: on a GPU the worker calls the schedule unchanged. It refuses a megatron-core
outside :data:`CHECKED_VERSIONS`, so that an upgrade re-checks those lines; the test
``test_megatron_source_has_what_the_cpu_adapter_maps`` (tests/test_pipeline.py) reads the
installed modules' source and names what moved.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from types import SimpleNamespace

import torch

CHECKED_VERSIONS = ("0.16.1", "0.19.2")
"""The megatron-core releases whose ``schedules.py`` and ``p2p_communication.py`` the CPU
adapter was read against; any release of their ``major.minor`` series is accepted
(:func:`check_megatron_core_version`). 0.16.1 is the lock's on Python 3.11, 0.19.2 on 3.12+
(megatron-core 0.17 and newer require Python 3.12: docs/compatibility.md)."""


def _series(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release[:2]


def check_megatron_core_version(found: str) -> None:
    """Raise ``RuntimeError`` (one line, naming ``found``) unless megatron-core ``found``
    belongs to a series of :data:`CHECKED_VERSIONS`."""
    if _series(found) not in {_series(v) for v in CHECKED_VERSIONS}:
        checked = ", ".join(CHECKED_VERSIONS)
        raise RuntimeError(
            f"nrl_megatron.pipeline's CPU adapter was checked against megatron-core {checked}, "
            f"found {found}: re-read schedules.py and p2p_communication.py for hard-coded CUDA "
            "devices (tests/test_pipeline.py names what moved) and update CHECKED_VERSIONS"
        )


class _CpuTorch:
    """``torch`` as Megatron's schedule and p2p modules see it on CPU (see module doc)."""

    def __init__(self) -> None:
        self.cuda = SimpleNamespace(
            current_device=lambda: "cpu",
            synchronize=lambda *args, **kwargs: None,
        )

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def megatron_pipeline_on_cpu() -> Iterator[None]:
    """Run Megatron-Core's pipeline schedule on CPU tensors (gloo) inside this context; see the
    module docstring for exactly what changes. Raises ``RuntimeError`` on a megatron-core
    release outside :data:`CHECKED_VERSIONS`' series."""
    from importlib.metadata import version

    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules

    check_megatron_core_version(version("megatron-core"))
    modules = (schedules, p2p)
    saved = [module.torch for module in modules]
    proxy = _CpuTorch()
    for module in modules:
        module.torch = proxy
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.torch = original


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def layers_per_stage(num_layers: int, pp: int) -> int:
    """Decoder layers on each of ``pp`` stages (Megatron-Core's even split; ``pp`` must
    divide ``num_layers``, which the worker checks)."""
    return num_layers // pp


def global_name(name: str, offset: int) -> str:
    """A stage's local Megatron parameter name with its decoder layer index shifted by
    ``offset`` (the stage's first layer): the name in the whole model."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)


def stage_of(name: str, num_layers: int, pp: int) -> int:
    """The stage that holds the whole model's parameter ``name``: a decoder layer's stage by its
    index, the embeddings on the first, the final norm and the output layer on the last."""
    match = _LAYER.match(name)
    if match:
        return int(match[1]) // layers_per_stage(num_layers, pp)
    return 0 if name.startswith("embedding.") else pp - 1


def local_state(full: dict[str, torch.Tensor], stage: int, num_layers: int, pp: int) -> dict:
    """The part of the whole model's state ``full`` (Megatron names) that ``stage`` holds,
    under the stage's local names."""
    per = layers_per_stage(num_layers, pp)
    out = {}
    for name, tensor in full.items():
        if stage_of(name, num_layers, pp) != stage:
            continue
        out[global_name(name, -stage * per)] = tensor
    return out
