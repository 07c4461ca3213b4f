"""The generation-worker suite: :class:`GenerationConformance`."""

from __future__ import annotations

import math

import pytest

from nrl_core.testing.conformance.common import _check_registration


class GenerationConformance:
    """The :class:`~nrl_core.interfaces.GenerationWorker` contract.

    Provide the fixtures ``generator`` and ``prompts`` (at least three token-id prompts of
    different lengths, valid for the model). Optional fixture ``tokenizer`` (default ``None``;
    enables the stop-string check) and class attribute ``max_new_tokens``.
    """

    max_new_tokens: int = 8
    registered_name: str | None = None

    @pytest.fixture
    def generator(self):
        """The generation worker under test (override)."""
        pytest.fail("define a `generator` fixture that builds the generation worker")

    @pytest.fixture
    def prompts(self) -> list[list[int]]:
        """Token-id prompts (override)."""
        pytest.fail("define a `prompts` fixture: token-id prompts of different lengths")

    @pytest.fixture
    def tokenizer(self):
        """The model's tokenizer, or ``None`` to skip the text checks."""
        return None

    def _params(self, **kwargs):
        from nrl_core.interfaces import SamplingParams

        kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        return SamplingParams(**kwargs)

    def test_output_structure(self, generator, prompts):
        from nrl_core.interfaces import GenerationOutput

        assert len(prompts) >= 3 and len({len(p) for p in prompts}) > 1
        out = generator.generate(prompts, self._params(seed=0))
        assert isinstance(out, GenerationOutput)
        assert len(out.token_ids) == len(out.logprobs) == len(out.finish_reasons) == len(prompts)
        for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons, strict=True):
            assert all(isinstance(t, int) and t >= 0 for t in ids), "token ids must be ints"
            assert len(ids) == len(lps) and 1 <= len(ids) <= self.max_new_tokens
            assert all(math.isfinite(x) and x <= 1e-5 for x in lps), "logprobs must be <= 0"
            assert reason in ("stop", "length")
            if reason == "length":
                assert len(ids) == self.max_new_tokens
            else:
                assert len(ids) <= self.max_new_tokens

    def test_greedy_is_deterministic_and_batch_independent(self, generator, prompts):
        params = self._params(temperature=0.0)
        out = generator.generate(prompts, params)
        assert generator.generate(prompts, params).token_ids == out.token_ids
        # Padding and batching must not leak between prompts.
        alone = [generator.generate([p], params).token_ids[0] for p in prompts]
        assert alone == out.token_ids

    def test_seeded_sampling_is_reproducible(self, generator, prompts):
        runs = [
            generator.generate(prompts, self._params(max_new_tokens=16, seed=s)).token_ids
            for s in (1, 1, 2)
        ]
        assert runs[0] == runs[1], "the same seed must give the same samples"
        assert runs[0] != runs[2], "different seeds gave identical samples"

    def test_token_ids_round_trip_as_prompts(self, generator, prompts):
        # Feeding a prompt plus the first generated ids back must continue identically (greedy):
        # the ids generation returns are exactly the ids the model saw.
        params = self._params(temperature=0.0)
        out = generator.generate(prompts, params)
        cut = 3
        resumed = generator.generate(
            [list(p) + ids[:cut] for p, ids in zip(prompts, out.token_ids, strict=True)],
            self._params(temperature=0.0, max_new_tokens=self.max_new_tokens - cut),
        )
        for ids, rest, reason in zip(
            out.token_ids, resumed.token_ids, out.finish_reasons, strict=True
        ):
            if len(ids) > cut:
                assert rest[: len(ids) - cut] == ids[cut:]
            elif reason == "stop":
                continue  # already stopped inside the prefix

    def test_stop_token_ids(self, generator, prompts):
        greedy = generator.generate(prompts, self._params(temperature=0.0))
        ids = greedy.token_ids[0]
        if len(ids) < 3:
            pytest.skip("greedy generation stopped too early to pick a stop token")
        stop = ids[2]
        out = generator.generate(prompts, self._params(temperature=0.0, stop_token_ids=(stop,)))
        first = out.token_ids[0]
        assert first == ids[: ids.index(stop) + 1], "must stop at (and include) the stop token"
        assert out.finish_reasons[0] == "stop"

    def test_per_sample_stop_strings(self, generator, prompts, tokenizer):
        if tokenizer is None:
            pytest.skip("no tokenizer fixture")
        greedy = generator.generate(prompts, self._params(temperature=0.0))
        text = tokenizer.decode(greedy.token_ids[0], skip_special_tokens=True)
        if len(text) < 3:
            pytest.skip("greedy text too short to pick a stop string")
        stop = text[1:3]
        out = generator.generate(
            prompts,
            self._params(temperature=0.0),
            stop_strings=[(stop,)] + [None] * (len(prompts) - 1),
        )
        got = tokenizer.decode(out.token_ids[0], skip_special_tokens=True)
        assert stop in got and len(out.token_ids[0]) <= len(greedy.token_ids[0])
        assert out.finish_reasons[0] == "stop"
        assert out.token_ids[1:] == greedy.token_ids[1:], "a stop string leaked to other samples"

    def test_registered(self, generator):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("generation", self.registered_name, generator)
