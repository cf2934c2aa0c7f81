"""Interactive explorers. Each wraps a pure ``render_*`` function that returns a matplotlib
figure, so tests need no browser; where widgets cannot run, the static figure is returned."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from .plotting import plot_attention, to_numpy


def _as_layers(weights) -> np.ndarray:
    """Attention weights as an array (L, h, T, S). Accepts (h, T, S), (L, h, T, S) or a list of
    (h, T, S) / (1, h, T, S) per layer."""
    if isinstance(weights, (list, tuple)):
        weights = np.stack([to_numpy(w).reshape(to_numpy(w).shape[-3:]) for w in weights])
    w = to_numpy(weights)
    if w.ndim == 3:
        w = w[None]
    if w.ndim != 4:
        raise ValueError(
            f"expected weights of shape (heads, T, S) or (layers, heads, T, S), got shape {w.shape}"
        )
    return w


def render_attention(weights, layer: int = 0, head: int = 0, query: int = 0,
                     q_tokens: Sequence[str] | None = None, k_tokens: Sequence[str] | None = None,
                     fig: Figure | None = None) -> Figure:
    """The figure the explorer shows: the heatmap of one (layer, head), with the chosen query's
    row outlined, and a bar chart of that query's weights over the keys."""
    w = _as_layers(weights)
    L, h, T, S = w.shape
    for name, value, limit in (("layer", layer, L), ("head", head, h), ("query", query, T)):
        if not 0 <= value < limit:
            raise ValueError(f"{name} must lie in [0, {limit - 1}], got {value}")
    if fig is None:
        fig = plt.figure(figsize=(10, 4))
    fig.clear()
    ax_map, ax_bar = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    title = f"layer {layer}, head {head}" if L > 1 else f"head {head}"
    plot_attention(w[layer, head], q_tokens, k_tokens, ax=ax_map, title=title, colorbar=False)
    ax_map.add_patch(plt.Rectangle((-0.5, query - 0.5), S, 1, fill=False, edgecolor="red", lw=2))
    keys = k_tokens if k_tokens is not None else (q_tokens if S == T else None)
    labels = [str(t) for t in keys] if keys is not None else [str(i) for i in range(S)]
    q_label = q_tokens[query] if q_tokens is not None else str(query)
    ax_bar.bar(range(S), w[layer, head, query], color="tab:blue")
    ax_bar.set_xticks(range(S), labels, rotation=90 if max(map(len, labels)) > 2 else 0)
    ax_bar.set_ylim(0, 1)
    ax_bar.set_xlabel("key")
    ax_bar.set_ylabel("weight")
    ax_bar.set_title(f"where query {query} ({q_label!r}) looks")
    fig.set_layout_engine("constrained")
    return fig


def _figure_png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def widgets_available() -> bool:
    """True inside a running IPython kernel with ipywidgets installed."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class AttentionExplorer:
    """Sliders for layer, head and query over a fixed set of attention weights.

    ``.widget`` is what the notebook displays; ``.image.value`` holds the current picture as
    PNG bytes. Changing a slider re-renders through :func:`render_attention`.
    """

    def __init__(self, weights, q_tokens=None, k_tokens=None):
        import ipywidgets as W

        self.weights = _as_layers(weights)
        L, h, T, _ = self.weights.shape
        self.q_tokens, self.k_tokens = q_tokens, k_tokens
        self.layer = W.IntSlider(value=0, min=0, max=L - 1, description="layer", continuous_update=False,
                                 layout=W.Layout(display="none" if L == 1 else None))
        self.head = W.IntSlider(value=0, min=0, max=h - 1, description="head",
                                continuous_update=False)
        self.query = W.IntSlider(value=0, min=0, max=T - 1, description="query",
                                 continuous_update=False)
        self.image = W.Image(format="png")
        self._figure = plt.figure(figsize=(10, 4))
        plt.close(self._figure)  # drawn into the Image widget only, never shown twice
        for slider in (self.layer, self.head, self.query):
            slider.observe(self._update, names="value")
        self.widget = W.VBox([W.HBox([self.layer, self.head, self.query]), self.image])
        self._update()

    def _update(self, _change=None) -> None:
        render_attention(self.weights, self.layer.value, self.head.value, self.query.value,
                         self.q_tokens, self.k_tokens, fig=self._figure)
        self.image.value = _figure_png(self._figure)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def attention_explorer(weights, q_tokens=None, k_tokens=None, *, static: bool | None = None):
    """Explore attention weights (heads, T, S) or (layers, heads, T, S) with sliders.

    Returns an :class:`AttentionExplorer` in a running kernel with ipywidgets; otherwise (or
    with ``static=True``) the static figure of layer 0, head 0, query 0.
    """
    if static is None:
        static = not widgets_available()
    if static:
        return render_attention(weights, 0, 0, 0, q_tokens, k_tokens)
    return AttentionExplorer(weights, q_tokens, k_tokens)
