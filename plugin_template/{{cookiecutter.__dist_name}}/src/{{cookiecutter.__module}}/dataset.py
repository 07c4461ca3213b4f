"""The dataset: random lower-case words, the same for the same seed."""

from __future__ import annotations

import random
import string

from nrl_core.data import Sample
from nrl_core.interfaces import ComponentContext

from {{ cookiecutter.__module }}.config import {{ cookiecutter.__class_prefix }}DataConfig

PROMPT = "reverse: {word}"
"""The user message of every sample."""


class {{ cookiecutter.__class_prefix }}Dataset:
    """Built by nrl as ``{{ cookiecutter.__class_prefix }}Dataset(options, context)``; ``load(split)`` returns samples whose
    ``answer`` is the reversed word."""

    def __init__(self, options: {{ cookiecutter.__class_prefix }}DataConfig, context: ComponentContext) -> None:
        self.options = options
        self.seed = context.seed if options.seed is None else options.seed

    def load(self, split: str) -> list[Sample]:
        """The words of ``split`` (``train`` or ``validation``; others raise ``KeyError``)."""
        size = {"train": self.options.train_size, "validation": self.options.validation_size}[split]
        # A string seed names an independent, reproducible stream per split.
        rng = random.Random(f"{{ cookiecutter.__component }}/{split}/{self.seed}")
        samples = []
        for _ in range(size):
            length = rng.randint(self.options.min_length, self.options.max_length)
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
            samples.append(
                Sample(
                    messages=[{"role": "user", "content": PROMPT.format(word=word)}],
                    answer=word[::-1],
                    task="{{ cookiecutter.__component }}",
                )
            )
        return samples
