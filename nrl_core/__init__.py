"""nrl: RL post-training for LLMs as a small core plus entry-point plugins.

Plugin authors import one thing from here, the :data:`hookimpl` marker::

    from nrl_core import hookimpl

    @hookimpl
    def nrl_register_environments(register):
        register("my_env", "my_plugin.env:MyEnvironment", description="...")

This module must stay import-light: the CLI imports it on every start.
"""

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "nrl"
"""The pluggy project name; hook implementations must use the marker below."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for hook implementations in nrl plugins (see :mod:`nrl_core.hookspecs`)."""

__all__ = ["PROJECT_NAME", "__version__", "hookimpl"]
