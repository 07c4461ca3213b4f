"""Generated grade-school word problems; the shipped ``data/word_problems.jsonl`` is their output.

Generated rather than copied from a public set so that the package ships no third-party data.
Regenerate the file with ``python -m nrl_math_env.word_problems > data/word_problems.jsonl``
(a test checks that the shipped file matches the generator).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Zoe", "Ivan", "Nia"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards"]

Template = Callable[[random.Random], tuple[str, int]]


def _buys_more(r: random.Random) -> tuple[str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 30), r.randint(2, 30)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b


def _gives_away(r: random.Random) -> tuple[str, int]:
    name, other, item = *r.sample(NAMES, 2), r.choice(ITEMS)
    a = r.randint(10, 60)
    b = r.randint(1, a - 1)
    return f"{name} had {a} {item} and gave {b} to {other}. How many {item} are left?", a - b


def _boxes(r: random.Random) -> tuple[str, int]:
    item, boxes, per = r.choice(ITEMS), r.randint(2, 12), r.randint(2, 12)
    return f"There are {boxes} boxes of {per} {item}. How many {item} in all?", boxes * per


def _share(r: random.Random) -> tuple[str, int]:
    name, item, friends, each = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 9), r.randint(2, 12)
    total = friends * each
    text = f"{name} shares {total} {item} equally among {friends} friends. How many each?"
    return text, each


def _price(r: random.Random) -> tuple[str, int]:
    name, count, price = r.choice(NAMES), r.randint(2, 9), r.randint(2, 15)
    paid = count * price + r.randint(0, 20)
    text = (
        f"{name} buys {count} notebooks at {price} dollars each and pays with {paid} dollars. "
        f"How much change does {name} get?"
    )
    return text, paid - count * price


def _two_days(r: random.Random) -> tuple[str, int]:
    name, first, extra = r.choice(NAMES), r.randint(3, 40), r.randint(1, 20)
    text = (
        f"{name} read {first} pages on Monday and {extra} more pages on Tuesday than on "
        f"Monday. How many pages did {name} read in the two days?"
    )
    return text, first + first + extra


def _weeks(r: random.Random) -> tuple[str, int]:
    name, per_day, weeks = r.choice(NAMES), r.randint(1, 9), r.randint(1, 4)
    text = f"{name} saves {per_day} dollars every day. How many dollars in {weeks} weeks?"
    return text, per_day * 7 * weeks


def _rows(r: random.Random) -> tuple[str, int]:
    rows, seats = r.randint(3, 15), r.randint(4, 12)
    empty = r.randint(0, rows * seats // 2)
    text = f"A hall has {rows} rows of {seats} chairs; {empty} are empty. How many are taken?"
    return text, rows * seats - empty


TEMPLATES: list[Template] = [
    _buys_more,
    _gives_away,
    _boxes,
    _share,
    _price,
    _two_days,
    _weeks,
    _rows,
]


def generate(num_problems: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """``num_problems`` distinct rows ``{"problem": ..., "answer": ...}``, the same for the
    same seed."""
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    while len(rows) < num_problems:
        problem, answer = rng.choice(TEMPLATES)(rng)
        rows.setdefault(problem, str(answer))
    return [{"problem": problem, "answer": answer} for problem, answer in rows.items()]


if __name__ == "__main__":
    for row in generate():
        print(json.dumps(row))
