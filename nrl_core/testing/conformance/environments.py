"""The environment suite: :class:`EnvironmentConformance` and its cases (:class:`EnvCase`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from nrl_core.data import Message
from nrl_core.testing.conformance.common import _check_registration


@attrs.frozen
class EnvCase:
    """One sample for the environment suite: a conversation ending with the assistant's
    response, the sample's metadata (what the core passes: the dataset's ``answer`` and
    ``task`` plus the sample's own metadata) and, optionally, the expected total reward."""

    messages: list[Message]
    metadata: dict[str, Any]
    reward: float | None = None


def _total(reward: float | dict[str, float]) -> float:
    return float(sum(reward.values())) if isinstance(reward, dict) else float(reward)


class EnvironmentConformance:
    """The :class:`~nrl_core.interfaces.Environment` contract.

    Provide the fixtures ``environment`` (a built environment) and ``cases`` (a list of
    :class:`EnvCase`; include at least one rewarded and one unrewarded response). Optional:

    - ``registered_name``: the name the plugin registers; checks that the registered target is
      the tested class and that its config class is documented and default-constructible.
    - ``single_turn``: ``True`` (default) requires every step to end the episode.
    """

    registered_name: str | None = None
    single_turn: bool = True

    @pytest.fixture
    def environment(self):
        """The environment under test (override)."""
        pytest.fail("define an `environment` fixture that builds the environment")

    @pytest.fixture
    def cases(self) -> list[EnvCase]:
        """The samples to step (override)."""
        pytest.fail("define a `cases` fixture returning a list of EnvCase")

    @staticmethod
    def _step(environment, cases: Sequence[EnvCase]):
        return environment.step([c.messages for c in cases], [c.metadata for c in cases])

    def test_step_returns_one_envstep_per_sample(self, environment, cases):
        from nrl_core.interfaces import EnvStep

        assert len(cases) >= 2, "give at least two cases (one rewarded, one not)"
        steps = list(self._step(environment, cases))
        assert len(steps) == len(cases)
        for step in steps:
            assert isinstance(step, EnvStep), f"step must return EnvStep, got {type(step)}"

    def test_rewards_are_finite_numbers(self, environment, cases):
        for step in self._step(environment, cases):
            values = step.reward.values() if isinstance(step.reward, dict) else [step.reward]
            if isinstance(step.reward, dict):
                assert step.reward and all(isinstance(k, str) for k in step.reward)
            for value in values:
                assert isinstance(value, (int, float)) and not isinstance(value, bool)
                assert math.isfinite(value), f"reward {value} is not finite"

    def test_expected_rewards(self, environment, cases):
        expected = [(i, c.reward) for i, c in enumerate(cases) if c.reward is not None]
        assert expected, "give the expected reward of at least one case"
        steps = self._step(environment, cases)
        for i, reward in expected:
            assert _total(steps[i].reward) == pytest.approx(reward), f"case {i}"
        totals = {_total(s.reward) for s in steps}
        assert len(totals) > 1, "every case got the same reward: the reward cannot teach anything"

    def test_deterministic(self, environment, cases):
        first = [_total(s.reward) for s in self._step(environment, cases)]
        again = [_total(s.reward) for s in self._step(environment, cases)]
        assert first == again

    def test_batch_composition_does_not_change_results(self, environment, cases):
        # The core splits batches across environment actors and retries failing batches sample
        # by sample, so each sample's result must not depend on its neighbours.
        batched = [_total(s.reward) for s in self._step(environment, cases)]
        single = [_total(self._step(environment, [c])[0].reward) for c in cases]
        reverse = [_total(s.reward) for s in self._step(environment, cases[::-1])][::-1]
        assert batched == single == reverse

    def test_empty_batch(self, environment):
        assert list(environment.step([], [])) == []

    def test_inputs_are_not_mutated(self, environment, cases):
        messages = [copy.deepcopy(c.messages) for c in cases]
        metadata = [copy.deepcopy(c.metadata) for c in cases]
        self._step(environment, cases)
        assert [c.messages for c in cases] == messages
        assert [c.metadata for c in cases] == metadata

    def test_turn_structure(self, environment, cases):
        for step in self._step(environment, cases):
            if self.single_turn:
                assert step.terminated, "a single-turn environment must end every episode"
            if not step.terminated:
                assert step.observation is not None, "a continuing episode needs an observation"
            if step.observation is not None:
                assert isinstance(step.observation.get("role"), str)
                assert isinstance(step.observation.get("content"), str)
            if step.stop_strings is not None:
                assert all(isinstance(s, str) and s for s in step.stop_strings)
            if step.metadata is not None:
                assert isinstance(step.metadata, dict)

    def test_registered(self, environment):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("environment", self.registered_name, environment)
