"""Answer checking with math-verify: the function each verifier worker process runs.

:func:`math_verify_reward` is the default ``env.math.verify_fn``. It runs inside a
:class:`~nrl_math_env.workers.VerifierPool` worker, which enforces the time limit by killing the
process, so math-verify's own signal-based timeouts are switched off here (they cannot interrupt
C code such as a huge integer power anyway, and only work in a main thread).
"""

from __future__ import annotations

import logging
from typing import Any

# Imported here, not lazily: a worker imports this module before it reports ready, so the
# seconds sympy takes to import never count against the first verification's time limit.
from math_verify import parse, verify

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    r"""The last ``\boxed{...}`` (or ``\fbox{...}``, ``\boxed x``) in ``text``, or ``None``.

    Braces are matched, so ``\boxed{\frac{1}{2}}`` is returned whole; an unclosed box is
    ignored. Only the last box counts: math-verify would otherwise join every boxed answer of a
    response into one set.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command) :]
    if rest.startswith(" "):  # "\boxed 5": the box holds one token
        token = rest.split(maxsplit=1)[0].split("$")[0] if rest.strip() else ""
        return f"\\boxed{{{token}}}" if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for end, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return f"\\boxed{rest[: end + 1]}"
    return None


def math_verify_reward(response: str, answer: Any) -> float:
    r"""1.0 when ``response`` states ``answer``, as judged by math-verify; 0.0 otherwise.

    The response's last ``\boxed{}`` is its answer when it has one; otherwise math-verify
    extracts the last LaTeX or plain expression it finds. ``answer`` may be LaTeX with or
    without ``$``/``\boxed`` (``\frac{1}{2}``), or a plain expression or number (``1/2``, 0.5).
    """
    _silence_timeout_warning()
    gold_text = str(answer).strip()
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = f"\\boxed{{{gold_text}}}"
    gold = parse(gold_text, parsing_timeout=None)
    predicted = parse(last_boxed(response) or response, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once per process that its timeout is off; ours is the worker kill.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _silence_timeout_warning() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutDisabledWarning) for f in logger.filters):
            logger.addFilter(_DropTimeoutDisabledWarning())
