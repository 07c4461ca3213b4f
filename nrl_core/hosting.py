"""Hosting one plugin component (an environment, an agent) inside a Ray actor: building it from
its target, checking what it returns, closing it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from nrl_core.interfaces import ComponentContext
from nrl_core.registry import resolve_target


class ComponentActor:
    """The part every component-hosting actor shares; a subclass names its :attr:`kind` and
    adds the methods the driver calls (``step``, ``run``).

    Args:
        target: the component's ``"module:attr"`` (or the class), imported here, in the actor.
        options: the component's options object (its registered config class).
        context: the run-wide :class:`~nrl_core.interfaces.ComponentContext`.
    """

    kind: ClassVar[str] = "component"
    """What the component is, as errors name it (``"environment"``, ``"agent"``)."""

    def __init__(self, target: str | object, options: Any, context: ComponentContext) -> None:
        self.component = resolve_target(target, what=self.kind)(options, context)

    def checked(
        self,
        results: Iterable[Any],
        *,
        method: str,
        inputs: int,
        unit: str,
        noun: str,
        item_type: type,
        type_name: str,
    ) -> list[Any]:
        """``results`` of the component's ``method`` as a list, refused unless there is one per
        input (``"<Class>.<method> returned 3 <noun> for 4 <unit>"``) and each is an
        ``item_type`` (``"... must return <type_name> objects, got <type>"``)."""
        out = list(results)
        name = type(self.component).__name__
        if len(out) != inputs:
            raise ValueError(f"{name}.{method} returned {len(out)} {noun} for {inputs} {unit}")
        for item in out:
            if not isinstance(item, item_type):
                raise TypeError(
                    f"{name}.{method} must return {type_name} objects, got {type(item).__name__}"
                )
        return out

    def close(self) -> None:
        """Close the component when it has a ``close`` (its sessions, subprocesses)."""
        close = getattr(self.component, "close", None)
        if callable(close):
            close()
