"""Conformance suites: the interface contract of each component kind, as pytest test classes.

A plugin's test module subclasses the suite of its component kind and provides the fixtures
that build the component; every ``test_*`` method of the suite then runs against it::

    import pytest
    from nrl_core.interfaces import ComponentContext
    from nrl_core.testing.conformance import EnvCase, EnvironmentConformance

    class TestMyEnvironment(EnvironmentConformance):
        registered_name = "my_env"          # also check the plugin registers it

        @pytest.fixture
        def environment(self):
            return MyEnvironment(None, ComponentContext(config=None))

        @pytest.fixture
        def cases(self):
            return [EnvCase(conversation("2+2=", "4"), {"answer": "4"}, reward=1.0)]

Suites (fixtures to provide in brackets; see each class for the optional ones):

- :class:`EnvironmentConformance` (``environment``, ``cases``)
- :class:`DatasetConformance` (``loader``)
- :class:`LossConformance` (``loss_fn``)
- :class:`PolicyConformance` (``policy``)
- :class:`GenerationConformance` (``generator``, ``prompts``)

The suites only use the component through its interface (:mod:`nrl_core.interfaces`) and run
in one process without Ray, so a whole suite takes seconds on a CPU with the tiny model.
This package imports torch lazily: the environment and dataset suites do not need it. One
module per suite (:mod:`.environments`, :mod:`.datasets`, :mod:`.losses`, :mod:`.policies`,
:mod:`.generation`), every name re-exported here.
"""

from nrl_core.testing.conformance.common import conversation
from nrl_core.testing.conformance.datasets import DatasetConformance
from nrl_core.testing.conformance.environments import EnvCase, EnvironmentConformance
from nrl_core.testing.conformance.generation import GenerationConformance
from nrl_core.testing.conformance.losses import LossConformance, TokenMeanNLL, random_batch
from nrl_core.testing.conformance.policies import PolicyConformance

__all__ = [
    "DatasetConformance",
    "EnvCase",
    "EnvironmentConformance",
    "GenerationConformance",
    "LossConformance",
    "PolicyConformance",
    "TokenMeanNLL",
    "conversation",
    "random_batch",
]
