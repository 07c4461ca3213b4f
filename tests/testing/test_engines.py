"""nrl_core.testing.engines: a generate call kept running while the test acts on the engines."""

from __future__ import annotations

import threading

import pytest

from nrl_core.testing.engines import generate_in_flight


class _Engines:
    """Engines of one engine whose generate call runs until released; ``group.run_all`` reads
    an attribute as the core's group does (here in this process)."""

    def __init__(self, fail: bool = False, starts: bool = True):
        self.running = 0
        self.release = threading.Event()
        self.fail, self.starts = fail, starts
        self.group = self

    def run_all(self, read):
        return [read(self)]

    def generate(self, prompts, params):
        self.running += int(self.starts)
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("engine died")
        return [p + params for p in prompts]


def test_the_block_runs_while_the_call_runs_and_gets_its_output():
    engines = _Engines()
    with generate_in_flight(engines, [1, 2], 10, busy="running") as call:
        assert engines.running == 1 and call.output is None
        engines.release.set()
    assert call.output == [11, 12]


def test_the_calls_error_is_raised_when_the_block_ends():
    engines = _Engines(fail=True)
    with (
        pytest.raises(RuntimeError, match="engine died"),
        generate_in_flight(engines, [1], 0, busy="running"),
    ):
        engines.release.set()


def test_a_call_that_never_starts_fails_the_test():
    engines = _Engines(starts=False)
    with (
        pytest.raises(AssertionError, match=r"did not start in 0\.2 s"),
        generate_in_flight(engines, [1], 0, busy="running", start_timeout_s=0.2),
    ):
        pass
    engines.release.set()
