"""The megatron policy's setup error (its own module so every part of the worker can raise it)."""

from __future__ import annotations

from nrl_core.errors import NrlError


class MegatronSetupError(NrlError):
    """The megatron policy's options do not fit the model, the cluster or this machine."""
