"""Hosting one plugin component (an environment, an agent) inside a Ray actor: building it from
its target, checking what it returns, closing it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from nrl_core.interfaces import ComponentContext
from nrl_core.registry import resolve_target


class ComponentActor:
    """The part every component-hosting actor shares; a subclass names its :attr:`kind` and
    what its component returns, and adds the methods the driver calls (``step``, ``run``).

    Args:
        target: the component's ``"module:attr"`` (or the class), imported here, in the actor.
        options: the component's options object (its registered config class).
        context: the run-wide :class:`~nrl_core.interfaces.ComponentContext`.
    """

    kind: ClassVar[str] = "component"
    """What the component is, as errors name it (``"environment"``, ``"agent"``)."""
    result_type: ClassVar[type] = object
    """The type of each item the component's methods return, one per input."""
    result_name: ClassVar[str] = "object"
    """``result_type`` as errors name it (``"EnvStep"``)."""
    results_word: ClassVar[str] = "results"
    inputs_word: ClassVar[str] = "inputs"
    """How errors count the results and the inputs (``"3 trajectories for 4 rows"``)."""

    def __init__(self, target: str | object, options: Any, context: ComponentContext) -> None:
        self.component = resolve_target(target, what=self.kind)(options, context)

    def checked(self, results: Iterable[Any], method: str, inputs: int) -> list[Any]:
        """``results`` of the component's ``method`` as a list, refused unless there is one per
        input (``"<Class>.<method> returned 3 <results_word> for 4 <inputs_word>"``) and each
        is a :attr:`result_type` (``"... must return <result_name> objects, got <type>"``)."""
        out = list(results)
        name = type(self.component).__name__
        if len(out) != inputs:
            raise ValueError(
                f"{name}.{method} returned {len(out)} {self.results_word} "
                f"for {inputs} {self.inputs_word}"
            )
        for item in out:
            if not isinstance(item, self.result_type):
                raise TypeError(
                    f"{name}.{method} must return {self.result_name} objects, "
                    f"got {type(item).__name__}"
                )
        return out

    def close(self) -> None:
        """Close the component when it has a ``close`` (its sessions, subprocesses)."""
        close = getattr(self.component, "close", None)
        if callable(close):
            close()
