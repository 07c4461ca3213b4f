"""Verify functions that fail, for the verifier pool's tests (imported by its worker processes,
which see this folder through PYTHONPATH)."""

import os


def exits(response: str, answer: str) -> float:
    """Kills its own process, as a segfault or the out-of-memory killer would."""
    os._exit(3)


def raises(response: str, answer: str) -> float:
    raise ValueError("cannot parse the answer")
