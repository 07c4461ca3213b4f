"""What plugins register: named components of eight kinds, each with a lazily imported target.

A component is registered with a ``"module:attr"`` string (or the object itself). The string is
imported only when the component is used, and usually only inside the Ray actor that runs it,
in the plugin's own virtualenv, so the driver never imports vLLM, SGLang or Megatron.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, get_args

import attrs

from nrl_core.errors import ComponentLoadError, UnknownComponentError

ComponentKind = Literal[
    "policy", "generation", "environment", "agent", "loss", "cluster", "dataset", "tool_parser"
]
KINDS: tuple[ComponentKind, ...] = get_args(ComponentKind)

# Component names appear in config keys (``policy.backend=dtensor``, ``generation.vllm.*``).
_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_\-]*$")


class Register(Protocol):
    """The callable every ``nrl_register_*`` hook receives.

    Args:
        name: the component's name as users write it in config (``env.name=math``); lower case
            letters, digits, ``_`` and ``-``, starting with a letter.
        target: a ``"module:attr"`` string, imported lazily where the component runs, or the
            object itself (fine for light, pure-Python objects such as test environments).
        description: one line shown by ``nrl plugins``.
        extras: the extras of the registering distribution that this component's actors need
            (``["engine"]`` for vLLM); the actor-environment builder installs them.
        config: a ``"module:attr"`` string (or the class) of the attrs class holding this
            component's options, structured from the config section named after the component
            (``generation.vllm`` for generation ``vllm``). It must import without heavy
            dependencies.
        **metadata: anything else the component's kind documents.
    """

    def __call__(
        self,
        name: str,
        target: str | object,
        *,
        description: str = "",
        extras: Sequence[str] = (),
        config: str | type | None = None,
        **metadata: Any,
    ) -> None: ...


def resolve_target(target: str | object, what: str = "target") -> Any:
    """Import a ``"module:attr"`` string (``attr`` may be dotted); objects pass through."""
    if not isinstance(target, str):
        return target
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ComponentLoadError(f"{what} {target!r} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ComponentLoadError(f"cannot import {what} {target!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ComponentLoadError(
                f"cannot load {what} {target!r}: module {module_name!r} has no {part!r}"
            ) from exc
    return obj


def target_string(target: str | object) -> str:
    """How a target is shown: the string itself, or ``module:qualname`` of an object."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


@attrs.frozen
class ComponentSpec:
    """One registered component."""

    kind: ComponentKind
    """Which interface the target honours (see :mod:`nrl_core.hookspecs`)."""
    name: str
    """The name users select it by in config."""
    target: str | object
    """``"module:attr"`` (imported lazily) or the object itself."""
    plugin: str
    """Short name of the plugin that registered it (``core`` for built-ins)."""
    distribution: str | None = None
    """The Python distribution that ships the plugin; ``None`` for objects registered in-process."""
    description: str = ""
    """One line for ``nrl plugins``."""
    extras: tuple[str, ...] = ()
    """Extras of :attr:`distribution` that the component's actors need."""
    config: str | type | None = None
    """The attrs class (or its ``"module:attr"``) of this component's config section."""
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    """Any further metadata given at registration."""

    @property
    def target_str(self) -> str:
        return target_string(self.target)

    def load(self) -> Any:
        """Import and return the target. Call this where the component runs, not in the driver."""
        return resolve_target(self.target, what=f"{self.kind} {self.name!r} (plugin {self.plugin})")

    def load_config_class(self) -> type | None:
        if self.config is None:
            return None
        return resolve_target(
            self.config, what=f"config class of {self.kind} {self.name!r} (plugin {self.plugin})"
        )


def make_spec(
    kind: ComponentKind,
    plugin: str,
    distribution: str | None,
    name: Any,
    target: Any,
    description: Any = "",
    extras: Any = (),
    config: Any = None,
    **metadata: Any,
) -> ComponentSpec:
    """Validate one ``register(...)`` call and build its spec; raises ``ValueError`` when bad."""
    if not isinstance(name, str) or not _NAME_PATTERN.match(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid: use lower-case letters, digits, '_' or '-', "
            "starting with a letter"
        )
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"{kind} {name!r}: target {target!r} must look like 'module:attribute'")
    if target is None:
        raise ValueError(f"{kind} {name!r}: target is None")
    if isinstance(extras, str) or not all(isinstance(e, str) for e in extras):
        raise ValueError(f"{kind} {name!r}: extras must be a list of strings, got {extras!r}")
    if not isinstance(description, str):
        raise ValueError(f"{kind} {name!r}: description must be a string")
    return ComponentSpec(
        kind=kind,
        name=name,
        target=target,
        plugin=plugin,
        distribution=distribution,
        description=description,
        extras=tuple(extras),
        config=config,
        metadata=dict(metadata),
    )


class Registry:
    """All components registered by the loaded plugins, by kind and name."""

    def __init__(self, specs: Sequence[ComponentSpec] = ()) -> None:
        self._specs: dict[tuple[str, str], ComponentSpec] = {}
        for spec in specs:
            self._specs[(spec.kind, spec.name)] = spec

    def __iter__(self) -> Iterator[ComponentSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._specs

    def names(self, kind: ComponentKind) -> list[str]:
        """Registered names of one kind, sorted."""
        return sorted(name for (k, name) in self._specs if k == kind)

    def find(self, kind: ComponentKind, name: str) -> ComponentSpec | None:
        return self._specs.get((kind, name))

    def get(self, kind: ComponentKind, name: str, *, key: str | None = None) -> ComponentSpec:
        """The spec for ``kind``/``name``, or an error listing what is registered.

        Args:
            key: the config key that named the component, quoted in the error.
        """
        spec = self._specs.get((kind, name))
        if spec is not None:
            return spec
        known = self.names(kind)
        where = f" ({key}={name})" if key else ""
        message = f"no {kind} named {name!r} is registered{where}; "
        message += f"registered: {', '.join(known)}" if known else f"no plugin registers a {kind}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        from nrl_core.first_party import install_hint

        hint = install_hint(kind, name)  # a plugin of this repository that is not installed
        message += hint or " (`nrl plugins` shows every plugin and its errors)"
        raise UnknownComponentError(message)
