"""GPU acceptance: run on one GPU what of nrl's GPU path can run without vLLM or SGLang.

    python benchmarks/gpu_acceptance.py [--device auto|cuda|cpu] [--only STAGE,...]
                                        [--out REPORT.json] [--workdir DIR] [--budget-s S]
                                        [--profile quick|qwen2-0.5b|tiny] [--jobs N]

The stages and the runner live in the ``acceptance`` package next to this file (one module per
stage; its docstring describes every stage); this script puts this folder on ``sys.path`` (it
is not an installed package, and the lent GPU machine runs it from the repository root) and
calls the package's ``main``. It also serves as each stage's child process (``--stage``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# What tests/benchmarks/test_gpu_acceptance.py reads from this script (loaded by path).
from acceptance.profiles import (  # noqa: E402
    DEFAULT_PROFILE,
    GRACE_S,
    INSTALL_ESTIMATE_S,
    PROFILES,
    QUICK_PLAN_S,
    STAGES,
    plan_seconds,
)
from acceptance.runner import main  # noqa: E402

__all__ = [
    "DEFAULT_PROFILE",
    "GRACE_S",
    "INSTALL_ESTIMATE_S",
    "PROFILES",
    "QUICK_PLAN_S",
    "STAGES",
    "main",
    "plan_seconds",
]

if __name__ == "__main__":
    sys.exit(main())
