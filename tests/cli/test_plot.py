"""``nrl plot``: smoothing, labels, titles, integer steps, legends, skipped charts and the
comparison of several runs (issue 20, item 7).

The runs are ``metrics.jsonl`` files written by hand; the figures are inspected before they are
saved (:func:`nrl_core.cli.plot.draw_charts`), the PNGs through ``nrl_core.cli.main``.
"""

from __future__ import annotations

import json

import pytest

from nrl_core.cli import main
from nrl_core.cli.plot import draw_charts, ema, load_runs

MaxNLocator = pytest.importorskip("matplotlib.ticker").MaxNLocator

REWARDS = [0.1, 0.4, 0.2, 0.5, 0.3, 0.6]


def write_run(path, rewards=REWARDS, val_every=2, kl_coef=0.0, kl=None):
    """A GRPO-like run: ``train/*`` every step, ``val/accuracy`` at step 0 and every
    ``val_every`` steps, ``timing/*``, ``train/kl`` null unless ``kl`` is given, and a
    ``config.yaml`` with ``loss.clipped_pg.kl_coef``."""
    path.mkdir(parents=True)
    rows = [{"step": 0, "val/accuracy": 0.1}]
    for step, reward in enumerate(rewards, 1):
        row = {
            "step": step,
            "train/reward_mean": reward,
            "train/loss": 1.0 / step,
            "train/entropy": 2.0 - 0.1 * step,
            "train/kl": None if kl is None else kl * step,
            "timing/generation_s": 0.5,
            "timing/train_s": 1.0,
            "timing/step_s": 1.75,
        }
        if step % val_every == 0:
            row["val/accuracy"] = 0.1 + 0.05 * step
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(
        f"loss:\n  name: clipped_pg\n  clipped_pg:\n    kl_coef: {kl_coef}\n"
    )
    return path


def charts(*paths, smooth=0.6):
    return draw_charts(load_runs(paths), smooth).figures


def visible_lines(ax):
    return [line for line in ax.get_lines() if line.get_alpha() in (None, 1)]


def faint_lines(ax):
    return [
        line for line in ax.get_lines() if line.get_alpha() is not None and line.get_alpha() < 1
    ]


# -- one run ----------------------------------------------------------------------------------


def test_one_run_writes_the_charts_next_to_its_metrics(tmp_path, capsys):
    run = write_run(tmp_path / "grpo-a")
    assert main(["plot", str(run), "--smooth", "0.9"]) == 0
    out = capsys.readouterr().out.split()
    names = {"reward.png", "val_accuracy.png", "entropy.png", "loss.png", "step_time.png"}
    assert {p.rsplit("/", 1)[1] for p in out} == names
    for name in names:
        assert (run / name).stat().st_size > 1000


def test_every_chart_names_step_its_quantity_and_the_run(tmp_path):
    figures = charts(write_run(tmp_path / "grpo-a"))
    ylabels = {
        "reward": "mean reward",
        "val_accuracy": "accuracy",
        "entropy": "nats per token",
        "loss": "loss",
        "step_time": "seconds",
    }
    assert set(figures) == set(ylabels)
    for name, fig in figures.items():
        (ax,) = fig.axes
        assert ax.get_xlabel() == "step", name
        assert ax.get_ylabel() == ylabels[name], name
        assert ax.get_title().endswith(" — grpo-a"), (name, ax.get_title())
        locator = ax.xaxis.get_major_locator()
        assert isinstance(locator, MaxNLocator) and locator._integer, name


def test_a_three_step_run_has_whole_step_ticks(tmp_path):
    # Validated at step 0 only: its chart is one point, and still gets whole steps.
    run = write_run(tmp_path / "short", rewards=[0.1, 0.2, 0.3], val_every=10)
    figures = charts(run)
    assert len(figures["val_accuracy"].axes[0].get_lines()[0].get_xdata()) == 1
    for name, fig in figures.items():
        fig.canvas.draw()
        (ax,) = fig.axes
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        # Every chart spans the run's steps 0..3, so the charts line up.
        assert ticks == [0, 1, 2, 3], (name, ticks)


def test_noisy_series_get_a_debiased_ema_over_the_faint_raw_series(tmp_path):
    (ax,) = charts(write_run(tmp_path / "a"), smooth=0.5)["reward"].axes
    (raw,) = faint_lines(ax)
    (smooth,) = visible_lines(ax)
    assert list(raw.get_ydata()) == REWARDS
    assert raw.get_color() == smooth.get_color()
    # By hand, weight 0.5: r_n = 0.5 r_{n-1} + 0.5 x_n, r_0 = 0, s_n = r_n / (1 - 0.5**n):
    # r = 0.05, 0.225, 0.2125, 0.35625, 0.328125, 0.4640625.
    expected = [0.1, 0.3, 0.2428571, 0.38, 0.3387097, 0.4714286]
    assert list(smooth.get_ydata()) == pytest.approx(expected, abs=1e-6)
    assert ema([1, 0, 1, 0], 0.5) == pytest.approx([1, 1 / 3, 5 / 7, 1 / 3])
    assert ema([3.0, 3.0, 3.0], 0.99) == pytest.approx([3.0, 3.0, 3.0])  # debiased: no pull to 0


def test_validation_points_short_series_and_smooth_zero_are_drawn_raw(tmp_path):
    figures = charts(write_run(tmp_path / "a"))
    (val,) = figures["val_accuracy"].axes[0].get_lines()
    assert val.get_marker() == "o"
    assert list(val.get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4])  # not averaged
    short = charts(write_run(tmp_path / "b", rewards=[0.1, 0.5, 0.2, 0.6]))
    assert len(short["reward"].axes[0].get_lines()) == 1  # 4 points: too few to smooth
    (line,) = charts(tmp_path / "a", smooth=0)["reward"].axes[0].get_lines()
    assert list(line.get_ydata()) == REWARDS


def test_the_validation_chart_labels_its_best_and_its_last_point(tmp_path):
    """Issue 53: a curve that ends below its peak names both, not only what the eye finds."""
    run = write_run(tmp_path / "a", rewards=[0.1] * 6)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row, value in zip(rows[2::2], (0.8, 0.5, 0.6), strict=True):
        row["val/accuracy"] = value
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [t.get_text() for t in charts(run)["val_accuracy"].axes[0].texts]
    assert texts == ["best 0.800 (step 2)", "last 0.600 (step 6)"]
    # A run that ends at its best: one label.
    rising = charts(write_run(tmp_path / "b"))["val_accuracy"].axes[0]
    assert [t.get_text() for t in rising.texts] == ["best 0.400 (step 6)"]


def test_a_single_series_has_no_legend_and_a_legend_never_covers_the_axes(tmp_path):
    run = write_run(tmp_path / "a")
    figures = charts(run)
    for name in ("reward", "val_accuracy", "entropy", "loss"):
        fig = figures[name]
        assert not fig.legends and fig.axes[0].get_legend() is None, name
    # The step-time bars (several phases) have one, below the axes.
    fig = figures["step_time"]
    fig.canvas.draw()
    (legend,) = fig.legends
    renderer = fig.canvas.get_renderer()
    assert not legend.get_window_extent(renderer).overlaps(fig.axes[0].get_window_extent())
    labels = [t.get_text() for t in legend.get_texts()]
    # Only the phases the run has: no empty "logprobs_s"/"teacher_s" entries.
    assert labels == ["generation_s", "train_s", "other"]


def test_a_missing_kl_is_reported_with_why_unless_quiet(tmp_path, capsys):
    run = write_run(tmp_path / "a", kl_coef=0.0)
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kl: not drawn: no train/kl values in metrics.jsonl (loss.clipped_pg.kl_coef is 0: the "
        "KL penalty is off, so the KL is not measured)"
    ]
    assert not (run / "kl.png").exists()
    assert main(["plot", "-q", str(run)]) == 0
    assert capsys.readouterr() == ("", "")
    # With the penalty on, the chart is drawn and nothing is said.
    on = write_run(tmp_path / "b", kl_coef=0.1, kl=0.01)
    assert main(["plot", str(on)]) == 0
    assert capsys.readouterr().err == ""
    assert (on / "kl.png").is_file()


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5", "abc", "nan"])
def test_a_bad_smooth_is_one_line_and_exit_2(tmp_path, capsys, value):
    run = write_run(tmp_path / "a")
    assert main(["plot", str(run), "--smooth", value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --smooth {value}: "), lines
    assert "[0, 1)" in lines[0]
    assert not list(run.glob("*.png"))


# -- several runs -----------------------------------------------------------------------------


def test_two_runs_are_drawn_on_one_chart_a_colour_each(tmp_path):
    a = write_run(tmp_path / "grpo-a")
    b = write_run(tmp_path / "grpo-b", rewards=[0.2, 0.3, 0.1, 0.4, 0.6, 0.5, 0.7])
    figures = charts(a, b)
    (ax,) = figures["reward"].axes
    assert ax.get_title() == "reward — grpo-a vs grpo-b"
    smooth = visible_lines(ax)
    assert len(smooth) == 2 and len(faint_lines(ax)) == 2  # raw + EMA per run
    assert smooth[0].get_color() != smooth[1].get_color()
    assert [len(line.get_xdata()) for line in smooth] == [6, 7]
    (legend,) = figures["reward"].legends
    assert [t.get_text() for t in legend.get_texts()] == ["grpo-a", "grpo-b"]
    # Step time of several runs: lines of seconds per step, not stacked bars.
    (ax,) = figures["step_time"].axes
    assert not ax.patches
    assert len(visible_lines(ax)) == 2
    assert ax.get_ylabel() == "seconds per step"


def test_runs_with_the_same_folder_name_are_told_apart_by_their_parent(tmp_path):
    a = write_run(tmp_path / "lr1e-5" / "grpo")
    b = write_run(tmp_path / "lr3e-5" / "grpo")
    assert [r.label for r in load_runs([a, b])] == ["lr1e-5/grpo", "lr3e-5/grpo"]


def test_two_runs_write_a_comparison_folder(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path / "runs" / "grpo-a")
    b = write_run(tmp_path / "runs" / "grpo-b")
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b)]) == 0
    compare = tmp_path / "compare-grpo-a-vs-grpo-b"
    names = {"reward.png", "val_accuracy.png", "entropy.png", "loss.png", "step_time.png"}
    assert {p.name for p in compare.iterdir()} == names
    assert not list(a.glob("*.png")) and not list(b.glob("*.png"))
    # Both runs lack train/kl: one line says so for both.
    assert capsys.readouterr().err.splitlines() == [
        "kl: not drawn: no train/kl values in metrics.jsonl (loss.clipped_pg.kl_coef is 0: the "
        "KL penalty is off, so the KL is not measured) (grpo-a, grpo-b)"
    ]
    out = tmp_path / "elsewhere" / "charts"
    assert main(["plot", "-q", str(a), str(b), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == names


def test_a_missing_run_among_two_is_one_line_before_any_drawing(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path / "grpo-a")
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(tmp_path / "grpo-typo")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{tmp_path / 'grpo-typo'} has no metrics.jsonl" in lines[0]
    assert not list(tmp_path.rglob("*.png"))
    assert [p.name for p in tmp_path.iterdir()] == ["grpo-a"]


def test_an_async_run_gets_age_and_mismatch_by_version_gap_charts(tmp_path):
    run = write_run(tmp_path / "async")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        row.update(
            {
                "async/age_mean": 0.5,
                "async/age_max": 1.0,
                "train/gen_logprob_error": 1.02,
                "async/gen_logprob_error_gap0": 1.01,
                "async/gen_logprob_error_gap1": 1.04,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = charts(run)
    (age,) = figures["async_age"].axes
    assert age.get_ylabel() == "optimizer steps"
    assert {line.get_label() for line in visible_lines(age)} >= {"async/age_mean", "async/age_max"}
    (mismatch,) = figures["mismatch"].axes
    labels = {line.get_label() for line in visible_lines(mismatch)}
    assert {"async/gen_logprob_error_gap0", "async/gen_logprob_error_gap1"} <= labels
    assert "async/gen_logprob_error_gap2" not in labels  # never logged: not drawn
