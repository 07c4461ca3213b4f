"""Options of this plugin's environments (``env.<name>``) and datasets (``data.<name>``).

Import-light (attrs only): the driver structures these from the YAML config without importing
the environments, math-verify or sympy.
"""

from __future__ import annotations

import re

import attrs

from nrl_core.config.schema import FINITE, NON_EMPTY, Valid, ge, gt, option, optional

MATH_PROMPT = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
"""Default user message of the math datasets; ``{problem}`` is replaced by the problem."""

_at_least_1 = ge(1)
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_TEMPLATE_DOC = (
    "User message; `{problem}` is replaced by the problem text (other braces stay as written)."
)

# -- environments ----------------------------------------------------------------------------


@attrs.define
class MathEnvConfig:
    """Options of the ``math`` environment (``env.math``)."""

    num_workers: int = option(2, "Verifier processes working in parallel.", validator=_at_least_1)
    timeout_s: float = option(
        5.0,
        "Time limit of one verification; a verifier over it is killed, the reward is 0, and "
        "the response counts as a timeout.",
        validator=gt(0),
    )
    verify_fn: str = option(
        "nrl_math_env.verify:math_verify_reward",
        "`module:function` each verifier process calls as fn(response, answer) -> reward.",
        validator=Valid("`module:function`", lambda s: bool(_TARGET.fullmatch(s))),
    )


@attrs.define
class GuessNumberEnvConfig:
    """Options of the ``guess_number`` environment (``env.guess_number``)."""

    max_turns: int = option(
        5, "Guesses allowed; the episode ends after them.", validator=_at_least_1
    )
    stop_strings: list[str] = option(
        ["\n"],
        "Stop strings of the guesses after the first (the first turn uses generation.stop_strings).",
    )


# -- datasets --------------------------------------------------------------------------------


@attrs.define
class ArithmeticDataConfig:
    """Options of the generated ``arithmetic`` dataset (``data.arithmetic``)."""

    num_digits: int = option(1, "Operands have up to this many digits.", validator=_at_least_1)
    operations: list[str] = option(
        ["+"],
        "Operations drawn from: `+`, `-`, `*` (usual precedence).",
        validator=attrs.validators.deep_iterable(attrs.validators.in_(("+", "-", "*"))),
    )
    num_operands: int = option(2, "Numbers per problem.", validator=attrs.validators.ge(2))
    train_size: int = option(2048, "Training problems.", validator=_at_least_1)
    validation_size: int = option(128, "Validation problems.", validator=ge(0))
    seed: int | None = option(
        None, "Generation seed (default: the run's seed).", validator=optional(ge(0))
    )


@attrs.define
class GuessNumberDataConfig:
    """Options of the ``guess_number`` dataset (``data.guess_number``): one game per sample."""

    low: int = option(1, "Smallest secret number.", validator=FINITE)
    high: int = option(16, "Largest secret number (at least low).", validator=FINITE)
    train_size: int = option(1024, "Training games.", validator=_at_least_1)
    validation_size: int = option(64, "Validation games.", validator=ge(0))
    seed: int | None = option(
        None, "Seed of the secret numbers (default: the run's seed).", validator=optional(ge(0))
    )

    def __attrs_post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be at least low ({self.low})")


@attrs.define
class JsonlDataConfig:
    """Options of the ``jsonl`` dataset (``data.jsonl``): one JSON object per line.

    The validation split is ``data.val_dataset`` when set, else a ``data.val_fraction`` share
    of the file.
    """

    path: str | None = option(None, "The JSONL file (default: data.dataset when it is a path).")
    problem_field: str = option("problem", "Field holding the problem text.", validator=NON_EMPTY)
    answer_field: str = option("answer", "Field holding the reference answer.", validator=NON_EMPTY)
    prompt_template: str = option(MATH_PROMPT, _TEMPLATE_DOC)
    task: str = option("math", "Task name of every sample (routes it to its environment).")


@attrs.define
class WordProblemsDataConfig:
    """Options of ``word_problems`` (``data.word_problems``): the shipped generated set."""

    prompt_template: str = option(MATH_PROMPT, _TEMPLATE_DOC)


@attrs.define
class HFDatasetConfig:
    """Options of the Hugging Face math datasets (``data.gsm8k``, ``data.math500``, ...)."""

    path: str | None = option(
        None,
        "A local JSONL file of the dataset's rows in its hub format (unset: load from the hub "
        "with the `datasets` library).",
    )
    prompt_template: str = option(MATH_PROMPT, _TEMPLATE_DOC)
    max_samples: int | None = option(
        None, "Keep at most this many samples per split.", validator=optional(_at_least_1)
    )
