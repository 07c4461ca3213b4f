"""A reward function in one file: the ``reward_fn`` environment (no plugin needed).

``env.name=reward_fn env.reward_fn.path=my_reward.py:score`` scores each response with a plain
Python function, as TRL's reward functions do::

    def score(prompt, completion, **row):
        return 1.0 if completion.strip() == str(row["answer"]) else 0.0

* ``prompt``: the text of the prompt's last user message (the whole prompt for a one-message
  prompt, which is what the ``prompts`` dataset makes of a text field);
* ``completion``: the model's response text;
* ``row``: the sample's other fields: ``answer``, ``task``, and every other column of a
  ``prompts`` JSONL row under its own name. Take ``**row`` so that new fields never break it.

It returns the reward: an ``int`` or ``float`` (``bool`` too), finite. A function that raises
for a sample, or returns NaN or infinity, gives that sample reward 0 and is counted in
``train/env_errors`` (like any environment); one that returns anything else (``None``, a
string) fails the run in one line naming the file and function, since no sample can be scored.

The function runs in a process of its own that each environment worker starts once and keeps
(:mod:`nrl_core.reward_fn_process`; single turn, ``env.step_timeout_s`` bounds each batch),
imported there from its file: the file is the user's own code, named on their command line, and
code may end its process. A function that calls ``sys.exit`` (any code, 0 too) or whose process
ends (``os._exit``, a crash, a kill) fails the run in one line naming the function and the exit
code or signal (exit code 1), never the ``nrl`` process itself. What it prints goes where the
environment's output goes (the run log ``nrl.log``, capped per line and per step; the console
with ``nrl run -v``). The driver only reads the file (:meth:`RewardFnConfig.preflight`): a
missing file, a syntax error or a missing function is a ``ConfigError`` (exit 2) before Ray
starts.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

import attrs

from nrl_core.config.schema import Valid, option
from nrl_core.errors import ConfigError, NrlError
from nrl_core.interfaces import EnvStep
from nrl_core.reward_fn_process import (
    RewardFunctionExit,
    RewardFunctionProcess,
    accepted_fields,
    load_reward_function,
    split_reference,
)

__all__ = [
    "NAME",
    "RewardFnConfig",
    "RewardFunctionEnvironment",
    "RewardFunctionError",
    "RewardFunctionExit",
    "accepted_fields",
    "load_reward_function",
    "prompt_text",
    "split_reference",
]

NAME = "reward_fn"
"""The environment's registered name (``env.name: reward_fn``; options under ``env.reward_fn``)."""


def _looks_like_reference(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    file, sep, function = value.rpartition(":")
    return bool(sep) and file.endswith(".py") and function.isidentifier()


REFERENCE = Valid("`FILE.py:FUNCTION`", _looks_like_reference, allow_none=True)


@attrs.define
class RewardFnConfig:
    """Options of the ``reward_fn`` environment (``env.reward_fn``)."""

    path: str | None = option(
        None,
        "The reward function, as `FILE.py:FUNCTION` (a path relative to the folder `nrl run` "
        "starts in, or absolute): `FUNCTION(prompt, completion, **row)` returns a float.",
        validator=REFERENCE,
    )
    correctness: bool = option(
        False,
        "The function returns 1.0 for a correct completion and 0.0 for a wrong one: validation "
        "then reports `val/accuracy` and `nrl eval` accuracy and pass@k (else the mean reward "
        "only, as partial credit is no accuracy).",
    )

    def preflight(self, key: str) -> None:
        """Driver-side check before anything starts, without running the file: it exists,
        parses, and defines the function at its top level. ``key`` is this section's config
        key (``env.reward_fn``)."""
        if self.path is None:
            raise ConfigError(
                f"{key}.path is not set; name your reward function as {key}.path=FILE.py:FUNCTION"
            )
        file, function = split_reference(self.path)
        where = f"{key}.path={self.path}"
        if not file.is_file():
            raise ConfigError(f"{where}: {file} does not exist; check the path")
        try:
            tree = ast.parse(file.read_bytes(), str(file))
        except SyntaxError as exc:
            raise ConfigError(
                f"{where}: {file}:{exc.lineno}: syntax error: {exc.msg}; fix the file"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: cannot read {file}: {exc}") from None
        defined = _top_level_functions(tree)
        if function not in defined and not _binds_name(tree, function):
            known = f" (it defines {', '.join(sorted(defined))})" if defined else ""
            raise ConfigError(f"{where}: {file} defines no function {function!r}{known}")


def _top_level_functions(tree: ast.Module) -> set[str]:
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


def _binds_name(tree: ast.Module, name: str) -> bool:
    """Whether the module binds ``name`` otherwise (``score = make_scorer()``, an import)."""
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, ast.Import | ast.ImportFrom) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def prompt_text(conversation: Sequence[dict]) -> str:
    """The prompt's last user message before the response (empty when there is none)."""
    for message in reversed(conversation[:-1]):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


class RewardFunctionEnvironment:
    """Scores each response with the function :attr:`RewardFnConfig.path` names; single turn.
    Registered as ``reward_fn`` (see the module docstring for the function's contract). The
    function runs in a child process this environment starts (:class:`RewardFunctionProcess`)
    and stops with :meth:`close`."""

    def __init__(self, options: RewardFnConfig | None = None, context: Any = None) -> None:
        options = options or RewardFnConfig()
        if options.path is None:
            raise ConfigError(
                "env.reward_fn.path is not set; name your reward function as "
                "env.reward_fn.path=FILE.py:FUNCTION"
            )
        self.reference = options.path
        self.defines_correctness = options.correctness
        self.process = RewardFunctionProcess(options.path)
        self.name = self.process.name
        self.fields = self.process.fields
        self.context = context

    def step(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[EnvStep]:
        """One :class:`EnvStep` per sample; a sample whose call raised (or returned NaN or
        infinity) gets reward 0 and an ``EnvStep.failure`` saying why."""
        return [
            r.step if r.error is None else attrs.evolve(r.step, failure=f"error: {r.error}")
            for r in self.step_results(conversations, metadata)
        ]

    def step_results(
        self, conversations: Sequence[Sequence[dict]], metadata: Sequence[dict]
    ) -> list[Any]:
        """As :meth:`step`, as :class:`~nrl_core.environments.StepResult`: a raising sample's
        error in ``StepResult.error``, which the environment actor counts as the step raising
        for that sample (``train/env_errors``) without calling the function again."""
        from nrl_core.environments import StepResult

        items = []
        for conversation, meta in zip(conversations, metadata, strict=True):
            completion = str(conversation[-1].get("content") or "")
            row = meta if self.fields is None else {k: meta[k] for k in self.fields if k in meta}
            items.append((prompt_text(conversation), completion, dict(row)))
        if not items:
            return []
        results = []
        for outcome in self.process.score(items):
            if "bad" in outcome:
                # No sample can be at fault for this: the function is wrong, the run stops.
                raise RewardFunctionError(
                    f"reward function {self.name} returned {outcome['bad']}; it must return a "
                    f"float (env.reward_fn.path={self.reference})"
                )
            if "error" in outcome:  # it raised, or returned NaN or infinity: reward 0, counted
                results.append(StepResult(EnvStep(reward=0.0), error=outcome["error"]))
            else:
                results.append(StepResult(EnvStep(reward=outcome["reward"])))
        return results

    def close(self) -> None:
        """Stop the function's process."""
        self.process.close()


class RewardFunctionError(NrlError):
    """The reward function returns something that is not a number: no sample can be scored
    (exit code 2: the user fixes their function)."""

    exit_code = 2
