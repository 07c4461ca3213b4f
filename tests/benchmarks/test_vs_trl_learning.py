"""``benchmarks/vs_trl.py --learning``'s own logic: the validation problems both sides share,
and the verdict on synthetic curves (the runs themselves need trl: ``nox -s bench-trl``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location(
        "vs_trl_learning", REPO / "benchmarks" / "vs_trl_learning.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_problems_are_nrls_arithmetic_split(learning):
    validation = learning.problems("validation")
    assert len(validation) == 64 and len(learning.problems("train")) == 2048
    assert validation == learning.problems("validation")  # the same for every run
    for expression, value in validation:
        a, b = expression.split("+")
        assert int(a) + int(b) == value
    assert validation[:8] != learning.problems("train")[:8]  # separate streams


def curves(learning, side, finals, steps=20):
    out = []
    for seed, final in enumerate(finals):
        curve = learning.Curve(side, seed, val={0: 0.1, 10: 0.5, steps: final})
        for step in range(1, steps + 1):
            curve.reward[step], curve.train_s[step] = 0.5, float(step)
        out.append(curve)
    return out


@pytest.mark.parametrize(
    ("nrl_finals", "verdict"),
    [([0.8, 0.9, 0.85], True), ([0.76, 0.77, 0.78], True), ([0.6, 0.65, 0.7], False)],
)
def test_verdict_is_trl_mean_minus_its_spread(learning, tmp_path, capsys, nrl_finals, verdict):
    # TRL's final mean 0.85, spread 0.9 - 0.8 = 0.1: nrl passes at a mean of 0.75 or more.
    runs = curves(learning, "trl", [0.8, 0.9, 0.85]) + curves(learning, "nrl2", nrl_finals)
    line = learning.report(runs, ["trl", "nrl2"], 20, 10, tmp_path)
    assert line.startswith("trl_final=0.850 trl_spread=0.100 nrl2_final=")
    assert line.endswith(f"nrl_at_least_trl={verdict}")
    assert (tmp_path / "learning.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "0.850 [0.80..0.90]" in table  # TRL's last row: mean [min..max]
