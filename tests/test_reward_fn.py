"""The ``reward_fn`` environment: a reward function in one file, no plugin (issue 39).

The function is the user's file, loaded for real from ``tmp_path``; the environment runs inside
the core's :class:`~nrl_core.environments.EnvironmentActor` wrapper exactly as in the actors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from nrl_core.cli import main
from nrl_core.config.loader import resolve_config
from nrl_core.env_failures import failure_of
from nrl_core.environments import EnvironmentActor
from nrl_core.errors import ConfigError
from nrl_core.reward_fn import (
    RewardFnConfig,
    RewardFunctionEnvironment,
    RewardFunctionError,
    RewardFunctionExit,
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


def test_the_function_gets_prompt_completion_and_the_rows_fields(tmp_path, monkeypatch, capsys):
    _write(
        tmp_path,
        """
        import json

        def score(prompt, completion, **row):
            print(json.dumps([prompt, completion, row]))  # printed here, by its host
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
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        ["2+2=", "four", meta]
    ]


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
    assert failure_of(results[0]) is None and results[1].error is not None  # train/env_errors
    assert failure_of(results[1]).startswith("error: KeyError: 'no such thing' (")
    assert failure_of(results[1]).endswith("my_reward.py:4)")  # the line that raised
    [nan] = actor.step(([_conversation("p", "nan")], [meta]))
    assert nan.reward == 0.0 and "returned nan" in failure_of(nan)
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


# -- user code that ends its process (issue 47) ------------------------------------------------

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(2) for b in range(2)]


def nrl_run_grpo(folder, reward: str, *overrides: str) -> subprocess.CompletedProcess:
    """`nrl run grpo` (its own process: the function may end it) on four prompts with the
    reward function ``reward`` (the text of my_reward.py), one rank, 4 samples a step; its run
    folder is ``folder/runs/r``."""
    _write(folder, reward)
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", "run", "grpo", "-q", "data.dataset=prompts",
         "data.prompts.path=prompts.jsonl", "env.name=reward_fn",
         "env.reward_fn.path=my_reward.py:score", "policy.num_workers=1",
         "grpo.max_num_steps=1", "grpo.sft_warmup_steps=0", "grpo.val_period=0",
         "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
         "checkpointing.enabled=false", "logger.log_dir=runs", "logger.run_name=r", *overrides],
        cwd=folder, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system"},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("sys.exit(0)", "called sys.exit(0) ({file}:5) while scoring 4 samples"),
        ("os._exit(3)", "its process ended (exit code 3) while scoring 4 samples"),
    ],
    ids=["sys.exit(0)", "os._exit(3)"],
)
def test_a_function_that_ends_its_process_fails_the_run_in_one_line(tmp_path, body, says):
    """It ended the `nrl` process (on the in-process cluster the environment runs there): exit
    0 with nothing trained for sys.exit(0), exit 3 and no word for os._exit(3). Now the function
    runs in a process of its own, and either is one line naming it, exit 1."""
    run = nrl_run_grpo(
        tmp_path, f"import os\nimport sys\n\ndef score(prompt, completion, **row):\n    {body}\n"
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-3000:]
    assert f"reward function my_reward.py:score{':' if 'its' in says else ''} " in lines[0]
    assert says.format(file=tmp_path / "my_reward.py") in lines[0]
    assert "(env.reward_fn.path=my_reward.py:score)" in lines[0]
    assert "Traceback" not in run.stderr
    metrics = tmp_path / "runs/r/metrics.jsonl"
    assert not metrics.exists() or "train/loss" not in metrics.read_text()  # nothing trained


def test_a_killed_function_process_is_named_with_its_signal(tmp_path):
    _write(
        tmp_path,
        """
        import os, signal

        def score(prompt, completion, **row):
            if completion == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            return 1.0
        """,
    )
    env = RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))
    meta = {"answer": 1, "task": "t"}
    assert [s.reward for s in env.step([_conversation("p", "ok")], [meta])] == [1.0]
    with pytest.raises(RewardFunctionExit) as exc:
        env.step([_conversation("p", "ok"), _conversation("p", "die")], [meta, meta])
    assert str(exc.value).startswith(
        "reward function my_reward.py:score: its process was killed by SIGKILL while scoring 2 "
        "samples"
    )
    assert exc.value.exit_code == 1 and "\n" not in str(exc.value)


def test_sys_exit_while_importing_the_file_is_a_config_error(tmp_path):
    _write(tmp_path, "import sys\nsys.exit('no')\n\ndef score(p, c, **row):\n    return 1\n")
    with pytest.raises(ConfigError, match=r"importing my_reward\.py failed: SystemExit: no$"):
        RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))


def test_the_function_runs_in_one_process_kept_for_every_batch(tmp_path):
    """No process per call: the same child scores every batch, and close() stops it."""
    _write(tmp_path, "import os\n\ndef score(prompt, completion, **row):\n    return os.getpid()\n")
    env = RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))
    meta = {"answer": 1, "task": "t"}
    pids = {s.reward for _ in range(3) for s in env.step([_conversation("p", "x")] * 2, [meta] * 2)}
    assert pids == {float(env.process.proc.pid)} and env.process.proc.pid != os.getpid()
    env.close()
    assert env.process.proc.poll() is not None


def test_a_raising_sample_fails_alone_and_the_function_is_called_once_per_sample(tmp_path):
    """The batch was retried sample by sample after one raised: every other sample was scored
    twice (a function with side effects saw them twice)."""
    calls = tmp_path / "calls.txt"
    _write(
        tmp_path,
        f"""
        def score(prompt, completion, **row):
            with open({str(calls)!r}, "a") as file:
                file.write(completion + "\\n")
            if completion == "boom":
                raise ValueError("no")
            return 1.0
        """,
    )
    actor = EnvironmentActor(TARGET, RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"), None)
    meta = {"answer": 1, "task": "t"}
    results = actor.step(([_conversation("p", c) for c in ("a", "boom", "b")], [meta] * 3))
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert [r.error is not None for r in results] == [False, True, False]
    assert calls.read_text().split() == ["a", "boom", "b"]
    actor.shutdown()  # the group's shutdown stops the function's process
    assert actor.env.process.proc.poll() is not None


def test_what_a_thread_of_the_function_prints_meanwhile_keeps_the_answers_intact(tmp_path, capsys):
    """Its output shares the socket with the answers: a thread printing while the call does
    must not garble either."""
    _write(
        tmp_path,
        """
        import threading

        def score(prompt, completion, **row):
            thread = threading.Thread(target=lambda: [print("t" * 999) for _ in range(300)])
            thread.start()
            for _ in range(300):
                print("m" * 999)
            thread.join()
            return 1.0
        """,
    )
    env = RewardFunctionEnvironment(RewardFnConfig(path=f"{tmp_path}/my_reward.py:score"))
    meta = {"answer": 1, "task": "t"}
    assert [s.reward for s in env.step([_conversation("p", "x")] * 3, [meta] * 3)] == [1.0] * 3
    out = capsys.readouterr().out
    assert out.count("t") == out.count("m") == 3 * 300 * 999
    env.close()
