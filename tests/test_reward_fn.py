"""The ``reward_fn`` environment: a reward function in one file, no plugin (issue 39).

The function is the user's file, loaded for real from ``tmp_path``; the environment runs inside
the core's :class:`~nrl_core.environments.EnvironmentActor` wrapper exactly as in the actors.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from nrl_core.cli import main
from nrl_core.config.loader import resolve_config
from nrl_core.environments import EnvironmentActor
from nrl_core.errors import ConfigError
from nrl_core.reward_fn import (
    RewardFnConfig,
    RewardFunctionEnvironment,
    RewardFunctionError,
)
from nrl_core.testing.conformance import EnvCase, EnvironmentConformance

TARGET = "nrl_core.reward_fn:RewardFunctionEnvironment"


def _write(folder, text: str, name: str = "my_reward.py"):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _conversation(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


@pytest.fixture
def reward_file(tmp_path):
    return _write(
        tmp_path,
        """
        def score(prompt, completion, **row):
            # partial credit: the right answer anywhere, full credit when it is all there is
            answer = str(row["answer"])
            if completion.strip() == answer:
                return 1.0
            return 0.25 if answer in completion else 0.0
        """,
    )


class TestConformance(EnvironmentConformance):
    registered_name = "reward_fn"

    @pytest.fixture
    def environment(self, reward_file):
        return RewardFunctionEnvironment(RewardFnConfig(path=f"{reward_file}:score"))

    @pytest.fixture
    def cases(self):
        meta = {"answer": 7, "task": "prompts"}
        return [
            EnvCase(_conversation("3+4=", "7"), meta, 1.0),
            EnvCase(_conversation("3+4=", "it is 7"), meta, 0.25),
            EnvCase(_conversation("3+4=", "8"), meta, 0.0),
        ]


def test_the_function_gets_prompt_completion_and_the_rows_fields(tmp_path, monkeypatch):
    _write(
        tmp_path,
        """
        SEEN = []

        def score(prompt, completion, **row):
            SEEN.append((prompt, completion, row))
            return len(completion)
        """,
    )
    monkeypatch.chdir(tmp_path)  # a relative path: against the folder the run starts in
    env = RewardFunctionEnvironment(RewardFnConfig(path="my_reward.py:score"))
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "four"},
    ]
    meta = {"answer": 4, "task": "prompts", "difficulty": "easy"}
    [step] = env.step([conversation], [meta])
    assert step.reward == 4.0 and isinstance(step.reward, float) and step.terminated
    seen = sys.modules["nrl_reward_fn_my_reward"].SEEN
    assert seen == [("2+2=", "four", meta)]


def test_a_function_without_row_gets_only_the_fields_it_names(tmp_path):
    _write(tmp_path, "def score(prompt, completion, answer):\n    return completion == answer\n")
    env = RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))
    steps = env.step(
        [_conversation("p", "4"), _conversation("p", "5")],
        [{"answer": "4", "task": "t", "extra": 1}, {"answer": "4", "task": "t", "extra": 2}],
    )
    assert [s.reward for s in steps] == [1.0, 0.0]  # True/False count as 1/0, as in TRL


def test_what_the_actor_makes_of_bad_returns_and_raising_samples(tmp_path):
    _write(
        tmp_path,
        """
        def score(prompt, completion, **row):
            if completion == "boom":
                raise KeyError("no such thing")
            if completion == "nan":
                return float("nan")
            if completion == "none":
                return None
            return 1.0
        """,
    )
    actor = EnvironmentActor(TARGET, RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"), None)
    meta = {"answer": 1, "task": "t"}
    results = actor.step(([_conversation("p", "ok"), _conversation("p", "boom")], [meta, meta]))
    assert [r.reward for r in results] == [1.0, 0.0]
    assert results[0].error is None and "KeyError" in results[1].error  # counted, run goes on
    [nan] = actor.step(([_conversation("p", "nan")], [meta]))
    assert nan.reward == 0.0 and "returned nan" in nan.error
    # None cannot be any sample's fault: the function is wrong, the run stops in one line.
    with pytest.raises(RewardFunctionError, match=r"my_reward.py:score returned NoneType None"):
        actor.step(([_conversation("p", "none")], [meta]))
    assert math.isclose(actor.step(([_conversation("p", "ok")], [meta]))[0].reward, 1.0)


@pytest.mark.parametrize(
    ("content", "reference", "says"),
    [
        (None, "missing.py:score", "missing.py does not exist; check the path"),
        ("def score(prompt, completion:\n", "my_reward.py:score", "my_reward.py:1: syntax error"),
        ("def other(p, c):\n    return 1\n", "my_reward.py:score", "defines no function 'score'"),
    ],
    ids=["missing-file", "syntax-error", "missing-function"],
)
def test_file_problems_are_one_line_before_anything_starts(tmp_path, content, reference, says):
    if content is not None:
        _write(tmp_path, content)
    options = RewardFnConfig(path=f"{tmp_path}/{reference}")
    with pytest.raises(ConfigError, match=says) as exc:
        options.preflight("env.reward_fn")
    assert str(exc.value).startswith(f"env.reward_fn.path={tmp_path}/{reference}: ")
    assert "\n" not in str(exc.value)


def test_an_import_error_in_the_file_names_it(tmp_path):
    _write(tmp_path, "import no_such_module_anywhere\n\ndef score(p, c, **row):\n    return 1\n")
    with pytest.raises(ConfigError, match=r"importing my_reward\.py failed: ModuleNotFoundError"):
        RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))


def test_a_function_that_cannot_take_a_completion_is_refused(tmp_path):
    _write(tmp_path, "def score(prompt):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"must take \(prompt, completion, \*\*row\)"):
        RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))


def test_the_reference_must_name_a_py_file_and_a_function(nrl_registry):
    with pytest.raises(ConfigError, match=r"env.reward_fn.path must be `FILE.py:FUNCTION`"):
        resolve_config(
            "grpo", None, ["env.name=reward_fn", "env.reward_fn.path=my_reward.py"], nrl_registry
        )


def _run_exit(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["run", "grpo", "-q", "env.name=reward_fn", *overrides])
    return code, capsys.readouterr().err


def test_nrl_run_refuses_a_broken_reference_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _run_exit(capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: env.reward_fn.path is not set; name your reward function as "
        "env.reward_fn.path=FILE.py:FUNCTION"
    ]
    _write(tmp_path, "def grade(prompt, completion, **row):\n    return 1.0\n")
    code, err = _run_exit(capsys, "env.reward_fn.path=my_reward.py:score")
    assert code == 2
    assert err.strip() == (
        "error: env.reward_fn.path=my_reward.py:score: "
        f"{tmp_path}/my_reward.py defines no function 'score' (it defines grade)"
    )


def test_the_check_happens_before_torch_is_imported(tmp_path):
    """Exit 2 before anything heavy: the driver only parses the file."""
    _write(tmp_path, "def grade(prompt, completion, **row):\n    return 1.0\n")
    code = (
        "import sys\nfrom nrl_core.cli import main\n"
        "code = main(['run', 'grpo', '-q', 'env.name=reward_fn',"
        " 'env.reward_fn.path=my_reward.py:score'])\n"
        "print(code, 'torch' in sys.modules, 'ray' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
