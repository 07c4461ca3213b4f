"""Options of the environment (``env.{{ cookiecutter.__component }}``) and the dataset
(``data.{{ cookiecutter.__component }}``).

Import-light (attrs only): the driver reads these from the YAML config without importing the
environment. Every field is documented with ``option(default, doc)``; ``nrl config show``
and the configuration reference print the docs.
"""

from __future__ import annotations

import attrs

from nrl_core.config.schema import option


@attrs.define
class {{ cookiecutter.__class_prefix }}EnvConfig:
    """Options of the ``{{ cookiecutter.__component }}`` environment."""

    partial_credit: float = option(
        0.5,
        "Reward of a wrong answer per right character, scaled: partial_credit * (right "
        "characters / word length). 0 gives a pure exact-match reward.",
        validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)],
    )


@attrs.define
class {{ cookiecutter.__class_prefix }}DataConfig:
    """Options of the ``{{ cookiecutter.__component }}`` dataset."""

    min_length: int = option(2, "Shortest word.", validator=attrs.validators.ge(1))
    max_length: int = option(4, "Longest word.", validator=attrs.validators.ge(1))
    train_size: int = option(512, "Training words.")
    validation_size: int = option(64, "Validation words.")
    seed: int | None = option(None, "Generation seed (default: the run's seed).")
