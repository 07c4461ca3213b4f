"""The math verifier: math-verify on real answers, and the process pool's hard time limit."""

from __future__ import annotations

import time

import pytest
from nrl_math_env.verify import last_boxed, math_verify_reward
from nrl_math_env.workers import VerifierPool, VerifierStartError

VERIFY_FN = "nrl_math_env.verify:math_verify_reward"
# sympy evaluates this power tower as one huge integer power in C: no signal interrupts it,
# so math-verify's own timeout never fires and only killing the process ends it.
PATHOLOGICAL = r"The answer is \boxed{9^{9^{9^{9}}}}"


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("1/2", "0.5"),
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        (r"So the answer is $\boxed{\dfrac12}$.", "1/2"),
        (r"\boxed{\dfrac12}", r"\frac{1}{2}"),
        (r"First \boxed{3}, but actually \boxed{5}", "5"),
        ("The total is 1,000", "1000"),
    ],
)
def test_equal_answers_score_1(response, answer):
    assert math_verify_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("1/3", "1/2"),
        (r"\boxed{0.6}", r"\frac{1}{2}"),
        (r"First \boxed{5}, but actually \boxed{3}", "5"),  # only the last box counts
        ("", "1/2"),
        ("I do not know", "1/2"),
        (r"\boxed{\frac{1}{", "1/2"),  # unclosed, unparseable
    ],
)
def test_wrong_empty_and_unparseable_answers_score_0(response, answer):
    assert math_verify_reward(response, answer) == 0.0


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\boxed{\frac{1}{2}}"
    assert last_boxed(r"\boxed 7$") == r"\boxed{7}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("no box") is None


@pytest.fixture(scope="module")
def pool():
    pool = VerifierPool(VERIFY_FN, num_workers=2, timeout_s=1.5)
    yield pool
    pool.close()


@pytest.mark.slow
def test_pool_scores_in_order(pool):
    verdicts = pool.map([(r"\boxed{\dfrac12}", "1/2"), ("7", "8"), ("", "1")])
    assert [(v.reward, v.status) for v in verdicts] == [(1.0, "ok"), (0.0, "ok"), (0.0, "ok")]


@pytest.mark.slow
def test_pathological_expression_times_out_within_the_limit(pool):
    items = [(PATHOLOGICAL, "1"), *[(r"\boxed{2}", "2")] * 4]
    start = time.monotonic()
    verdicts = pool.map(items)
    elapsed = time.monotonic() - start
    assert verdicts[0].reward == 0.0 and verdicts[0].status == "timeout"
    assert all(v.reward == 1.0 for v in verdicts[1:])
    # The limit is 1.5 s; the rest is slack for a loaded 2-core machine, far below "never".
    assert elapsed < 10
    # The killed worker was replaced: the pool keeps scoring, with both workers.
    assert [v.reward for v in pool.map([("3", "3"), ("4", "5")])] == [1.0, 0.0]
    assert all(w.proc.poll() is None for w in pool._workers)


@pytest.mark.slow
def test_verify_fn_that_cannot_import_fails_at_construction():
    with pytest.raises(VerifierStartError, match="no_such_module"):
        VerifierPool("no_such_module:verify", num_workers=1, timeout_s=1.0)


HERE = __import__("pathlib").Path(__file__).parent


def test_a_verifier_that_kills_its_process_stops_the_pool_quickly_in_one_line(monkeypatch):
    """Issue 40: a verify function calling os._exit scored every sample as "crashed" (reward 0,
    counted nowhere) after restarting its process for each one: 85-112 s steps. Now a run of
    crashes with no reply between them is a broken verifier: one line, within seconds."""
    from nrl_math_env.workers import VerifierCrashError

    monkeypatch.syspath_prepend(str(HERE))  # broken_verifiers, for the worker processes
    pool = VerifierPool("broken_verifiers:exits", num_workers=2, timeout_s=5.0)
    start = time.monotonic()
    with pytest.raises(VerifierCrashError) as caught:
        pool.map([("1", "1")] * 64)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert "'broken_verifiers:exits' crashed on 4 samples in a row" in message
    assert "exited with code 3" in message
    assert pool._workers == []  # every process stopped


def test_a_verifier_that_raises_is_an_error_verdict_the_environment_reports(monkeypatch):
    """The math environment reports its verifier's failures to the core (EnvStep.failure),
    which counts them (train/env_error_frac) and may stop the run."""
    from nrl_math_env.config import MathEnvConfig
    from nrl_math_env.math_env import MathEnvironment

    monkeypatch.syspath_prepend(str(HERE))
    env = MathEnvironment(MathEnvConfig(verify_fn="broken_verifiers:raises", num_workers=1), None)
    try:
        conversation = [{"role": "assistant", "content": "7"}]
        steps = env.step([conversation], [{"answer": "7"}])
    finally:
        env.close()
    assert steps[0].reward == 0.0
    assert steps[0].failure == "error: ValueError: cannot parse the answer"
    assert steps[0].metadata["verify_status"] == "error"
