"""The dataset-loader suite: :class:`DatasetConformance`."""

from __future__ import annotations

import pytest

from nrl_core.testing.conformance.common import _check_registration


class DatasetConformance:
    """The :class:`~nrl_core.interfaces.DatasetLoader` contract.

    Provide the fixture ``loader`` (a built loader). Optional: ``splits`` (the splits the
    dataset has; default ``("train",)``) and ``registered_name``.
    """

    splits: tuple[str, ...] = ("train",)
    registered_name: str | None = None

    @pytest.fixture
    def loader(self):
        """The dataset loader under test (override)."""
        pytest.fail("define a `loader` fixture that builds the dataset loader")

    def test_splits_hold_samples(self, loader):
        from nrl_core.data import Sample

        for split in self.splits:
            samples = loader.load(split)
            assert isinstance(samples, list) and samples, f"split {split!r} is empty"
            for sample in samples:
                assert isinstance(sample, Sample)
                assert isinstance(sample.task, str) and sample.task
                assert isinstance(sample.metadata, dict)

    def test_prompts_are_chat_messages(self, loader):
        for split in self.splits:
            for sample in loader.load(split):
                assert sample.messages, "a sample needs at least one message"
                for message in sample.messages:
                    assert message.get("role") in ("system", "user", "assistant")
                    assert isinstance(message.get("content"), str)
                # The policy answers the prompt, so it must not end with the answer already.
                assert sample.messages[-1]["role"] != "assistant"

    def test_deterministic(self, loader):
        for split in self.splits:
            assert loader.load(split) == loader.load(split)

    def test_unknown_split_raises_key_error(self, loader):
        # load_splits() falls back to a held-out fraction on KeyError, and only on KeyError.
        with pytest.raises(KeyError):
            loader.load("no-such-split")

    def test_registered(self, loader):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("dataset", self.registered_name, loader)
