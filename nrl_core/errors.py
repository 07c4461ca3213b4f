"""Errors that the CLI reports as one line, with an exit code, and no traceback.

Anything a user can fix (a config key, a plugin name, a missing engine) raises a subclass of
:class:`NrlError` whose message says what is wrong and how to fix it.
"""


class NrlError(Exception):
    """Base of every user-facing nrl error."""

    exit_code = 1


class ConfigError(NrlError):
    """The configuration (a YAML file, an override, a value) is invalid."""

    exit_code = 2


class PluginError(NrlError):
    """Plugins conflict, or a requested plugin is not installed."""

    exit_code = 2


class UnknownComponentError(NrlError):
    """A config names a component that no loaded plugin registers."""

    exit_code = 2


class NonFiniteError(NrlError):
    """A training step met a reward, advantage, loss or gradient that is NaN or infinite; the
    message names its source (the environment and the first bad sample, or the loss)."""


class ComponentLoadError(NrlError):
    """A registered ``"module:attr"`` target could not be imported."""


class NotImplementedYet(NrlError):
    """A documented feature that this version does not provide yet."""

    exit_code = 3
