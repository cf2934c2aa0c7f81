"""The training plots of notebooks 08, 08a and 08b draw what they are given, with titles and labels."""

import math

import numpy as np
import pytest

from tutorial_lib.plotting import plot_grad_norms, plot_schedules, plot_training_curves
from tutorial_lib.train import History, inverse_sqrt_schedule, warmup_cosine_schedule


def test_plot_schedules_draws_each_multiplier_times_the_peak_from_step_1():
    ax = plot_schedules({"a": inverse_sqrt_schedule(4), "b": warmup_cosine_schedule(2, 10)}, 10, peak=0.5)
    (a, b) = ax.get_lines()
    assert list(a.get_xdata()) == list(range(1, 11))
    assert np.allclose(a.get_ydata(), [0.5 * inverse_sqrt_schedule(4)(k) for k in range(10)])
    assert b.get_ydata()[0] == pytest.approx(0.25) and ax.get_ylabel() == "learning rate"
    assert ax.get_title() and ax.get_xlabel() == "optimiser step"
    assert plot_schedules({"a": inverse_sqrt_schedule(4)}, 3).get_ylabel() == "multiplier of the peak rate"
    with pytest.raises(ValueError, match="at least one schedule"):
        plot_schedules({}, 5)


def test_plot_training_curves_accepts_histories_and_lists_and_hides_non_finite_values():
    history = History(step=[3, 4, 5], loss=[2.0, 1.5, 1.2])
    ax = plot_training_curves({"run": history, "list": [3.0, math.nan, 1.0]}, styles={"list": "--"}, logy=True)
    run, listed = ax.get_lines()
    assert list(run.get_xdata()) == [3, 4, 5] and list(run.get_ydata()) == [2.0, 1.5, 1.2]
    assert list(listed.get_xdata()) == [1, 2, 3] and np.isnan(listed.get_ydata()[1])
    assert listed.get_linestyle() == "--" and ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["run", "list"]
    with pytest.raises(ValueError, match="at least one curve"):
        plot_training_curves({})


def test_plot_grad_norms_marks_the_clipped_steps():
    history = History(step=[1, 2, 3, 4], grad_norm=[0.5, 3.0, 0.8, 2.0])
    ax = plot_grad_norms(history, clip_norm=1.0)
    norms, marks = ax.get_lines()[0], ax.get_lines()[-1]
    assert list(norms.get_ydata()) == [0.5, 3.0, 0.8, 2.0]
    assert list(marks.get_xdata()) == [2, 4] and list(marks.get_ydata()) == [3.0, 2.0]
    assert "clipped (2 steps)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "global gradient norm" and ax.get_title()
    with pytest.raises(ValueError, match="no steps"):
        plot_grad_norms(History())
