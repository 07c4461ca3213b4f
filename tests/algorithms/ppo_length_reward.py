"""The reward of tests/algorithms/test_ppo_cli.py: the completion's length, in [0, 1]."""


def score(prompt: str, completion: str, **row) -> float:
    return min(len(completion), 4) / 4.0
