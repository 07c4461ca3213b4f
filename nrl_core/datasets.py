"""Loading a run's samples through the registered dataset loaders, and drawing them in a
resumable, seeded order."""

from __future__ import annotations

import random
from typing import Any

from nrl_core.config.schema import DataConfig
from nrl_core.data import Sample
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.registry import Registry

JSONL_DATASET = "jsonl"
"""The registered dataset that reads ``data.dataset`` when it is a path to a JSONL file."""


def _loader(
    name: str, data: DataConfig, registry: Registry, context: ComponentContext, key: str
) -> Any:
    if name.endswith(".jsonl"):
        spec = registry.get("dataset", JSONL_DATASET, key=key)
        options = data.options_for(JSONL_DATASET) or spec.load_config_class()()
        import attrs

        options = attrs.evolve(options, path=name)
    else:
        spec = registry.get("dataset", name, key=key)
        options = data.options_for(name)
        if options is None and spec.config is not None:
            options = spec.load_config_class()()
    return spec.load()(options, context)


def load_splits(
    data: DataConfig, registry: Registry, context: ComponentContext
) -> tuple[list[Sample], list[Sample]]:
    """The train and validation samples of ``data``.

    Validation comes from ``data.val_dataset``, else from the dataset's own ``validation``
    split, else from a seeded ``data.val_fraction`` of the training samples.
    """
    loader = _loader(data.dataset, data, registry, context, "data.dataset")
    train = list(loader.load("train"))
    if not train:
        raise ConfigError(f"data.dataset={data.dataset} has no training samples")
    if data.val_dataset:
        val = list(
            _loader(data.val_dataset, data, registry, context, "data.val_dataset").load(
                "validation"
            )
        )
    else:
        try:
            val = list(loader.load("validation"))
        except KeyError:
            order = list(range(len(train)))
            random.Random(context.seed).shuffle(order)
            cut = max(1, int(len(train) * data.val_fraction)) if data.val_fraction > 0 else 0
            val = [train[i] for i in order[:cut]]
            held = set(order[:cut])
            train = [s for i, s in enumerate(train) if i not in held]
    return train, val[: data.max_val_samples]


class DataStream:
    """Draws training samples epoch by epoch in a seeded order; its position is resumable."""

    def __init__(self, samples: list[Sample], *, seed: int, shuffle: bool = True) -> None:
        self.samples = samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[Sample]:
        out = []
        while len(out) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._order_of(self.epoch)
            out.append(self.samples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)
