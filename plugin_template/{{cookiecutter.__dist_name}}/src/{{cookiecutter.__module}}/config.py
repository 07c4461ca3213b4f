"""Options of the environment (``env.{{ cookiecutter.__component }}``) and the dataset
(``data.{{ cookiecutter.__component }}``).

Import-light (attrs only): the driver reads these from the YAML config without importing the
environment. Every field is documented with ``option(default, doc)``; ``nrl config show``
and the configuration reference print the docs. Each field's ``validator=`` gives its valid
range (``ge(1)``, ``between(0, 1)``, ``one_of(...)`` from ``nrl_core.config.schema``): a value
outside it is refused when the config is loaded, in one line naming the key
(``env.<name>.partial_credit must be in [0, 1), got 2``), and the reference shows the range.
"""

from __future__ import annotations

import attrs

from nrl_core.config.schema import between, ge, option, optional


@attrs.define
class {{ cookiecutter.__class_prefix }}EnvConfig:
    """Options of the ``{{ cookiecutter.__component }}`` environment."""

    partial_credit: float = option(
        0.5,
        "Reward of a wrong answer per right character, scaled: partial_credit * (right "
        "characters / word length). 0 gives a pure exact-match reward.",
        validator=between(0, 1, high_open=True),
    )


@attrs.define
class {{ cookiecutter.__class_prefix }}DataConfig:
    """Options of the ``{{ cookiecutter.__component }}`` dataset."""

    min_length: int = option(2, "Shortest word.", validator=ge(1))
    max_length: int = option(4, "Longest word (at least min_length).", validator=ge(1))
    train_size: int = option(512, "Training words.", validator=ge(1))
    validation_size: int = option(64, "Validation words.", validator=ge(0))
    seed: int | None = option(
        None, "Generation seed (default: the run's seed).", validator=optional(ge(0))
    )

    def __attrs_post_init__(self) -> None:
        # Checks that involve two fields go here; the message names both.
        if self.max_length < self.min_length:
            raise ValueError(
                f"max_length ({self.max_length}) must be at least min_length ({self.min_length})"
            )
