"""The mask, position and probe figures draw the values they are given, with titles and labels."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from tutorial_lib.masks import causal_mask, sliding_window_mask
from tutorial_lib.plotting import plot_mask, plot_mask_grid, plot_position_bias, plot_positions, plot_probe
from tutorial_lib.positions import alibi_bias, sinusoidal_table
from tutorial_lib.probes import ProbeReport


def labelled(ax):
    return bool(ax.get_title() and ax.get_xlabel() and ax.get_ylabel())


def test_plot_mask_draws_allowed_cells_and_labels_tokens():
    mask = causal_mask(2, 3)
    fig, ax = plt.subplots()
    assert plot_mask(mask, ["x", "y"], ["a", "b", "c"], ax=ax, title="cross") is ax
    np.testing.assert_array_equal(ax.images[0].get_array(), mask.float().numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]
    assert labelled(ax) and ax.get_title() == "cross"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["may attend", "blocked"]


@pytest.mark.parametrize("bad, message", [(torch.ones(1, 1, 2, 2, dtype=torch.bool), r"shape \(T, S\)"),
                                          (torch.full((2, 2), 0.5), "boolean mask")])
def test_plot_mask_rejects_what_is_not_a_2d_boolean_mask(bad, message):
    with pytest.raises(ValueError, match=message):
        plot_mask(bad)


def test_plot_mask_grid_has_one_panel_per_mask_in_order():
    masks = {"causal": causal_mask(4), "window 2": sliding_window_mask(4, 2)}
    axes = plot_mask_grid(masks, title="two masks")
    drawn = [ax for ax in np.ravel(axes) if ax.images]
    assert [ax.get_title() for ax in drawn] == list(masks)
    for ax, m in zip(drawn, masks.values()):
        np.testing.assert_array_equal(ax.images[0].get_array(), m.float().numpy())
    assert drawn[0].get_legend() is None and drawn[-1].get_legend() is not None
    with pytest.raises(ValueError, match="empty"):
        plot_mask_grid({})


def test_plot_positions_draws_the_table_on_a_symmetric_scale():
    table = sinusoidal_table(10, 8)
    ax = plot_positions(table, title="sinusoidal")
    np.testing.assert_allclose(ax.images[0].get_array(), table.numpy())
    assert ax.images[0].get_clim() == pytest.approx((-1.0, 1.0), abs=1e-6)
    assert labelled(ax)


def test_plot_position_bias_draws_each_head_on_one_scale():
    bias = alibi_bias(4, 5)
    axes = plot_position_bias(bias, title="ALiBi")
    drawn = [ax for ax in np.ravel(axes) if ax.images]
    assert len(drawn) == 4
    for i, ax in enumerate(drawn):
        np.testing.assert_allclose(ax.images[0].get_array(), bias[i].numpy())
        assert ax.images[0].get_clim() == pytest.approx((float(bias.min()), 0.0))
        assert labelled(ax)


def test_plot_probe_colours_positions_above_the_tolerance():
    report = ProbeReport("causal leakage", False, 0.3, 1, torch.tensor([0.0, 0.3, 1e-7]), 1e-5)
    ax = plot_probe(report)
    colours = [bar.get_facecolor() for bar in ax.patches]
    red, green = plt.matplotlib.colors.to_rgba("tab:red"), plt.matplotlib.colors.to_rgba("tab:green")
    assert colours == [green, red, green]
    assert ax.patches[1].get_height() == pytest.approx(0.3)
    assert "failed from position 1" in ax.get_title() and ax.get_xlabel() and ax.get_ylabel()


def test_plot_position_bias_leaves_nan_entries_blank_and_scales_by_the_rest():
    bias = alibi_bias(2, 4).masked_fill(~causal_mask(4), float("nan"))
    axes = plot_position_bias(bias)
    image = [ax for ax in np.ravel(axes) if ax.images][0].images[0]
    drawn = np.ma.filled(image.get_array().astype(float), np.nan)
    assert np.isnan(drawn[0, 1]) and not np.isnan(drawn[1, 0])
    assert image.get_clim() == pytest.approx((float(bias[~bias.isnan()].min()), 0.0))


def test_plot_position_bias_draws_masked_entries_in_a_colour_no_bias_value_has():
    bias = alibi_bias(2, 4).masked_fill(~causal_mask(4), float("nan"))
    axes = plot_position_bias(bias)
    image = [ax for ax in np.ravel(axes) if ax.images][0].images[0]
    def seen_on_white(rgba):                                     # what the eye sees on a white page
        rgba = np.atleast_2d(rgba)
        return rgba[:, :3] * rgba[:, 3:] + (1.0 - rgba[:, 3:])

    masked = seen_on_white(image.cmap.get_bad())
    palette = seen_on_white(image.cmap(np.linspace(0.0, 1.0, 256)))  # every colour a bias value can get
    assert np.abs(palette - masked).sum(axis=1).min() > 0.3, "a masked entry must not look like a bias"


def test_plot_probe_says_so_when_no_output_changed():
    report = ProbeReport("causal leakage", True, 0.0, None, torch.zeros(4), 1e-5)
    ax = plot_probe(report)
    assert [t.get_text() for t in ax.texts] == ["all changes = 0"]
    failing = ProbeReport("causal leakage", False, 0.3, 1, torch.tensor([0.0, 0.3, 0.0]), 1e-5)
    assert len(plot_probe(failing).texts) == 0


def test_plot_positions_labels_its_colour_bar_as_the_table_value():
    ax = plot_positions(sinusoidal_table(6, 4))
    colour_bar_axes = [other for other in ax.figure.axes if other is not ax]
    assert [other.get_ylabel() for other in colour_bar_axes] == ["value"]
