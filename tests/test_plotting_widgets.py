import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from tutorial_lib.plotting import plot_attention
from tutorial_lib.widgets import AttentionExplorer, attention_explorer, render_attention, show_with_picture


def weights(L=2, h=3, T=4, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(L, h, T, S, generator=g).softmax(-1)


def test_plot_attention_draws_the_given_weights_with_labels():
    w = weights(1, 1)[0, 0]
    fig, ax = plt.subplots()
    returned = plot_attention(w, list("abcd"), list("vwxyz"), ax=ax)
    assert returned is ax
    np.testing.assert_allclose(ax.images[0].get_array(), w.numpy())
    assert [t.get_text() for t in ax.get_yticklabels()] == list("abcd")
    assert [t.get_text() for t in ax.get_xticklabels()] == list("vwxyz")
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_plot_attention_grid_has_one_heatmap_per_head():
    w = weights(1, 3)[0]
    axes = plot_attention(w)
    drawn = [ax for ax in np.ravel(axes) if ax.images]
    assert len(drawn) == 3
    for i, ax in enumerate(drawn):
        np.testing.assert_allclose(ax.images[0].get_array(), w[i].numpy())


def test_plot_attention_rejects_mismatched_labels_and_shapes():
    with pytest.raises(ValueError, match="3 query tokens for 4"):
        plot_attention(weights(1, 1)[0, 0], list("abc"))
    with pytest.raises(ValueError, match="expected weights of shape"):
        plot_attention(torch.rand(5))


def test_render_attention_shows_the_chosen_layer_head_and_query():
    w = weights()
    fig = render_attention(w, layer=1, head=2, query=3)
    heatmap, bars = fig.axes[:2]
    np.testing.assert_allclose(heatmap.images[0].get_array(), w[1, 2].numpy())
    heights = [p.get_height() for p in bars.patches]
    np.testing.assert_allclose(heights, w[1, 2, 3].numpy(), rtol=1e-6)
    assert "layer 1, head 2" in heatmap.get_title()
    with pytest.raises(ValueError, match="head must lie in"):
        render_attention(w, head=3)


def test_explorer_slider_changes_the_picture():
    w = weights()
    explorer = AttentionExplorer(w, list("abcd"), list("vwxyz"))
    before = explorer.image.value
    assert before[:4] == b"\x89PNG"
    explorer.head.value = 1
    after = explorer.image.value
    assert after != before
    heatmap = explorer._figure.axes[0]
    np.testing.assert_allclose(heatmap.images[0].get_array(), w[0, 1].numpy())
    explorer.layer.value = 1
    np.testing.assert_allclose(explorer._figure.axes[0].images[0].get_array(), w[1, 1].numpy())


def test_explorer_falls_back_to_a_static_figure_outside_a_kernel():
    fig = attention_explorer(weights(1, 2))  # no IPython kernel in pytest
    assert isinstance(fig, Figure)
    assert isinstance(attention_explorer(weights(1, 2), static=False), AttentionExplorer)


def test_a_displayed_explorer_carries_a_picture_for_static_views(monkeypatch):
    """A saved notebook opened without a kernel (GitHub, the site) shows the PNG, not 'VBox(...)'."""
    import base64

    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    explorer = AttentionExplorer(weights(), list("abcd"), list("vwxyz"))
    explorer.head.value = 1
    explorer._ipython_display_()
    (bundle, raw), = shown
    assert raw and "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.image.value), "the picture of the current setting"
    assert "VBox" not in bundle["text/plain"]
    with pytest.raises(ValueError, match="PNG bytes"):
        show_with_picture(explorer.widget, b"not a png")
