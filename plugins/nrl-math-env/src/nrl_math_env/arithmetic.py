"""Generated integer arithmetic ("12+7=" -> "19"): the problems, their dataset, their reward.

Small enough for a ~1M-parameter character-level model to learn with GRPO on a CPU: the
prompt is the bare expression and the answer a bare integer, with no chat formatting needed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from nrl_core.data import Message, Sample
from nrl_core.interfaces import ComponentContext, EnvStep
from nrl_math_env.common import last_integer, response_text
from nrl_math_env.config import ArithmeticDataConfig
from nrl_math_env.metrics import episode_metrics


def make_problem(
    rng: random.Random, num_digits: int, operations: Sequence[str], num_operands: int
) -> tuple[str, int]:
    """One random expression such as ``"12+7"`` and its value (``*`` binds tighter)."""
    numbers = [rng.randrange(10**num_digits) for _ in range(num_operands)]
    ops = [rng.choice(operations) for _ in range(num_operands - 1)]
    terms = [numbers[0]]
    for op, number in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= number
        else:
            terms.append(number if op == "+" else -number)
    expression = str(numbers[0]) + "".join(
        f"{op}{n}" for op, n in zip(ops, numbers[1:], strict=True)
    )
    return expression, sum(terms)


class ArithmeticDataset:
    """The ``arithmetic`` dataset: problems generated from the seed, the same on every call.

    Each sample's user message is ``"<expression>="``, its answer the value as a string and its
    task ``arithmetic``. Training and validation problems come from separate random streams.
    """

    def __init__(self, options: ArithmeticDataConfig, context: ComponentContext) -> None:
        self.options = options
        self.seed = context.seed if options.seed is None else options.seed

    def load(self, split: str) -> list[Sample]:
        """The problems of ``split`` (``train`` or ``validation``)."""
        sizes = {"train": self.options.train_size, "validation": self.options.validation_size}
        # A string seed is hashed deterministically (unlike hash()), and names the stream.
        rng = random.Random(f"arithmetic/{split}/{self.seed}")
        o = self.options
        samples = []
        for _ in range(sizes[split]):
            expression, value = make_problem(rng, o.num_digits, o.operations, o.num_operands)
            samples.append(
                Sample(
                    messages=[{"role": "user", "content": f"{expression}="}],
                    answer=str(value),
                    task="arithmetic",
                )
            )
        return samples


class ArithmeticEnvironment:
    """Exact-answer reward: 1.0 when the response's integer equals ``metadata["answer"]``.

    The response's integer is read by :func:`~nrl_math_env.common.last_integer`: the last
    integer after the last ``=``, so "19", "12+7=19" and "it is 19" all answer 19.
    """

    defines_correctness = True
    """Reward 1.0 is a correct response, 0.0 a wrong one."""

    def __init__(self, options: None, context: ComponentContext) -> None:
        self.context = context

    def step(
        self, conversations: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> list[EnvStep]:
        """Score each response; every episode ends after one turn."""
        return [
            EnvStep(reward=float(last_integer(response_text(c)) == int(m["answer"])))
            for c, m in zip(conversations, metadata, strict=True)
        ]

    def metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """Accuracy, pass@k, finished fraction and mean response length; ``batch`` as
        :func:`~nrl_math_env.metrics.episode_metrics` documents."""
        return episode_metrics(batch)
