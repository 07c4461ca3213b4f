"""Field helpers: ``option`` (a documented field), the validators (``Valid``, ``gt``,
``between``, ``one_of``, ...) and how the reference describes them, and
:class:`ComponentSection`, the base of sections that select a registered component."""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from nrl_core.registry import ComponentKind


def option(default: Any, doc: str, **kwargs: Any) -> Any:
    """An attrs field with a default and its documentation.

    Pass ``validator=`` (one of the validators below, or attrs' own) to give the field its
    valid range: it runs whenever the class is built (from YAML, or with ``attrs.evolve`` in
    code), and the configuration reference shows it (see :func:`describe_validator`).
    """
    if isinstance(default, (list, dict)) or attrs.has(type(default)):
        # A deep copy per instance: a shallow one (attrs.evolve) shared the nested sections,
        # so setting `config.grpo.async_.enabled` on one config changed every later default.
        return attrs.field(factory=lambda: copy.deepcopy(default), metadata={"doc": doc}, **kwargs)
    return attrs.field(default=default, metadata={"doc": doc}, **kwargs)


class FieldValueError(ValueError):
    """A config field holds a value outside its valid range.

    Carries the field's name apart from the problem, so that the config loader can name the
    full dotted key (``policy.optimizer.lr must be > 0, got -1``).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        """The attribute's name (the last part of the dotted key)."""
        self.problem = problem
        """What is wrong, e.g. ``must be > 0, got -1``."""


def show_value(value: Any) -> str:
    """A value as a user wrote it: ``-1`` rather than ``-1.0``, strings quoted."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return format(value, "g")
    return repr(value)


@attrs.frozen
class Valid:
    """An attrs validator whose valid values are described in words (``> 0``, ``in [0, 1)``).

    The words are the error message (``must be <text>, got <value>``) and the "valid" column
    of the generated configuration reference. ``None`` passes when ``allow_none`` is set (for
    ``int | None`` fields whose ``None`` means "unset").
    """

    text: str
    """The valid values, completing "must be ..."."""
    test: Callable[[Any], bool] = attrs.field(eq=False, repr=False)
    allow_none: bool = False

    def __call__(self, _instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and self.allow_none:
            return
        try:
            ok = bool(self.test(value))
        except TypeError:  # e.g. a number compared with a string, in code that skipped YAML
            ok = False
        if not ok:
            raise FieldValueError(
                attribute.name, f"must be {self.describe()}, got {show_value(value)}"
            )

    def describe(self) -> str:
        """The valid values, as the configuration reference shows them."""
        return f"{self.text} or null" if self.allow_none else self.text


_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _finite(value: Any) -> bool:
    """NaN and infinities (``.inf``, ``1e400`` in YAML) lie in no range a setting has."""
    return not isinstance(value, float) or math.isfinite(value)


def _compare(op: str, bound: float) -> Valid:
    compare = _COMPARE[op]
    return Valid(
        f"{op} {show_value(bound)}",
        lambda value: _finite(value) and compare(value, bound),
    )


def gt(bound: float) -> Valid:
    """Valid when ``value > bound``."""
    return _compare(">", bound)


def ge(bound: float) -> Valid:
    """Valid when ``value >= bound``."""
    return _compare(">=", bound)


def le(bound: float) -> Valid:
    """Valid when ``value <= bound``."""
    return _compare("<=", bound)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Valid:
    """Valid when ``value`` lies in the interval from ``low`` to ``high`` (closed unless the
    ``*_open`` flags say otherwise), written ``in [0, 1)``."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def test(value: Any) -> bool:
        if not _finite(value):
            return False
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return above and below

    return Valid(f"in {left}{show_value(low)}, {show_value(high)}{right}", test)


def optional(valid: Valid) -> Valid:
    """``valid``, or ``None`` (unset)."""
    return attrs.evolve(valid, allow_none=True)


def each(valid: Valid, text: str | None = None) -> Valid:
    """Valid for a list whose every item passes ``valid`` (``text``: the words for that,
    default ``a list of items <valid's words>``)."""
    item = valid.test
    return Valid(
        text or f"a list of items {valid.text}",
        lambda items: isinstance(items, list) and all(item(i) for i in items),
    )


FINITE = Valid("a finite number", math.isfinite)
"""Any number but infinity and NaN (a field whose every value is meaningful)."""


NON_EMPTY = Valid("a non-empty string", lambda value: isinstance(value, str) and value != "")
"""A string that must not be empty (names, paths)."""


MAX_NAME_BYTES = 255
"""Longest file or folder name (in UTF-8 bytes) that Linux file systems (ext4, xfs, btrfs)
allow."""

RUN_NAME = Valid(
    "a non-empty string naming one folder (at most 255 bytes in UTF-8; no `/`, `\\`, `.` or "
    "`..` alone, no control characters)",
    lambda value: (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\")
        and value.isprintable()
        and len(value.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
    ),
)
"""One folder name inside ``logger.log_dir``: it can never point outside it."""


def one_of(*choices: Any) -> Any:
    """An enumeration: ``attrs.validators.in_`` (the loader and the reference read its
    options)."""
    return attrs.validators.in_(choices)


def describe_validator(validator: Any) -> str | None:
    """The valid values ``validator`` accepts, in words, or ``None`` when it cannot say.

    Understands :class:`Valid` and attrs' ``in_``, ``ge``/``gt``/``le``/``lt``, ``and_``,
    ``optional`` and ``deep_iterable``, and any callable with a ``describe()`` method.
    """
    if validator is None:
        return None
    describe = getattr(validator, "describe", None)
    if callable(describe):
        return describe()
    inner = getattr(validator, "_validators", None)  # attrs.validators.and_ (or a list)
    if inner is not None:
        parts = [describe_validator(v) for v in inner]
        return " and ".join(p for p in parts if p) or None
    if hasattr(validator, "options") and type(validator).__name__ == "_InValidator":
        options = getattr(validator, "_original_options", validator.options)
        return "one of " + ", ".join(f"`{o}`" for o in options)
    if hasattr(validator, "compare_op") and hasattr(validator, "bound"):
        return f"{validator.compare_op} {show_value(validator.bound)}"
    if type(validator).__name__ == "_OptionalValidator":
        text = describe_validator(validator.validator)
        return f"{text} or null" if text else None
    member = getattr(validator, "member_validator", None)  # attrs.validators.deep_iterable
    if member is not None:
        text = describe_validator(member)
        return f"a list of items {text}" if text else None
    return None


@attrs.define
class ComponentSection:
    """Base of sections that select a registered component by name."""

    component_kind: ClassVar[ComponentKind]
    selector: ClassVar[str]
    """The field holding the selected component's name."""

    options: dict[str, Any] = attrs.field(
        factory=dict,
        metadata={
            "doc": (
                "Options of registered components, keyed by component name (filled from sub-sections "
                "such as `policy.dtensor`); structured with each component's config class."
            )
        },
    )
    actor_env: str | None = option(
        None,
        (
            "Where this component's actors run: unset for the plugin's own virtualenv, `system` "
            "for the driver's interpreter, or a path to a Python interpreter."
        ),
    )

    @property
    def selected(self) -> str:
        return getattr(self, self.selector)

    def options_for(self, name: str | None = None) -> Any:
        """The options object of component ``name`` (default: the selected one), or ``None``."""
        return self.options.get(name or self.selected)

    def options_or_defaults(self, name: str, spec: Any) -> Any:
        """Component ``name``'s options, or its config class's defaults when this section has
        none for it (a component named elsewhere, e.g. by ``data.tasks``); ``spec`` is its
        :class:`~nrl_core.registry.ComponentSpec`. ``None`` when it registers no config."""
        options = self.options_for(name)
        if options is None and spec.config is not None:
            options = spec.load_config_class()()
        return options
