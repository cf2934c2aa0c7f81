"""Figures for the notebooks. Every function draws on the axes it is given (or makes them),
returns them, and never prints."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch


def to_numpy(x) -> np.ndarray:
    """A tensor (any device, with or without grad) or array-like as a NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def _labels(tokens: Sequence[str] | None, n: int, what: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"got {len(tokens)} {what} tokens for {n} {what} positions")
    return tokens


def plot_attention(weights, q_tokens: Sequence[str] | None = None,
                   k_tokens: Sequence[str] | None = None, *, ax=None, title: str | None = None,
                   annotate: bool | None = None, cmap: str = "viridis", colorbar: bool = True,
                   vmax: float | None = None):
    """Heatmap of attention weights: rows are queries, columns are keys.

    ``weights`` of shape (T, S) draws one heatmap on ``ax`` and returns it. Shape (h, T, S)
    draws a grid with one heatmap per head on ``ax`` (a sequence of h axes, or None to make
    a figure), all on one colour scale, and returns the array of axes. The colour scale runs
    from 0 to ``vmax`` (default: the largest weight).
    """
    w = to_numpy(weights)
    if w.ndim == 3:
        return _plot_heads(w, q_tokens, k_tokens, axes=ax, title=title, annotate=annotate, cmap=cmap)
    if w.ndim != 2:
        raise ValueError(f"expected weights of shape (T, S) or (heads, T, S), got shape {w.shape}")
    T, S = w.shape
    rows, cols = _labels(q_tokens, T, "query"), _labels(k_tokens if k_tokens is not None else
                                                         (q_tokens if S == T else None), S, "key")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.45 * S, 0.8 + 0.45 * T))
    vmax = max(1e-9, float(w.max())) if vmax is None else vmax
    image = ax.imshow(w, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(S), cols, rotation=90 if max(map(len, cols), default=0) > 2 else 0)
    ax.set_yticks(range(T), rows)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title if title is not None else "attention weights")
    if annotate is None:
        annotate = T * S <= 64
    if annotate:
        for i in range(T):
            for j in range(S):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if w[i, j] < 0.6 * vmax else "black")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    return ax


def _grid_axes(n: int, axes, *, ncols: int, panel: tuple[float, float], title: str | None):
    """n axes: the given ones (checked), or a new figure with a grid of them (extras hidden)."""
    if axes is None:
        ncols = min(n, ncols)
        nrows = -(-n // ncols)
        fig, axes = plt.subplots(nrows, ncols, squeeze=False,
                                 figsize=(ncols * panel[0], nrows * panel[1]))
        for extra in axes.flat[n:]:
            extra.set_visible(False)
        if title:
            fig.suptitle(title)
        fig.set_layout_engine("constrained")
    flat = np.asarray(axes, dtype=object).reshape(-1)
    if len(flat) < n:
        raise ValueError(f"need {n} axes, got {len(flat)}")
    return axes, flat


def _plot_heads(w: np.ndarray, q_tokens, k_tokens, *, axes, title, annotate, cmap):
    h, T, S = w.shape
    axes, flat = _grid_axes(h, axes, ncols=4, panel=(1.2 + 0.3 * S, 1.0 + 0.3 * T), title=title)
    for i in range(h):
        plot_attention(w[i], q_tokens, k_tokens, ax=flat[i], title=f"head {i}",
                       annotate=annotate, cmap=cmap, colorbar=False, vmax=float(w.max()))
    return axes


# ---- masks, positions and probes (notebooks 02 and 03) ----------------------------------------

_ALLOWED_COLOUR, _BLOCKED_COLOUR = "#2f6db3", "#e6e6e6"


def plot_mask(mask, q_tokens: Sequence[str] | None = None, k_tokens: Sequence[str] | None = None, *,
              ax=None, title: str | None = None, legend: bool = True):
    """Draw a boolean (T, S) mask: a filled square where query i may attend to key j."""
    m = to_numpy(mask)
    if m.ndim != 2:
        raise ValueError(f"expected a mask of shape (T, S), got shape {m.shape}; "
                         "pick one example and head first, e.g. mask[0, 0]")
    if not np.isin(m, (0.0, 1.0)).all():
        raise ValueError("expected a boolean mask (True = may attend), got values other than 0 and 1")
    T, S = m.shape
    rows = _labels(q_tokens, T, "query")
    cols = _labels(k_tokens if k_tokens is not None else (q_tokens if S == T else None), S, "key")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.4 * S, 0.9 + 0.4 * T))
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cmap = ListedColormap([_BLOCKED_COLOUR, _ALLOWED_COLOUR])
    ax.imshow(m, cmap=cmap, vmin=0, vmax=1, aspect="equal")
    ax.set_xticks(range(S), cols, rotation=90 if max(map(len, cols), default=0) > 2 else 0)
    ax.set_yticks(range(T), rows)
    ax.set_xticks(np.arange(-0.5, S, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, T, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title if title is not None else "mask")
    if legend:
        handles = [Patch(color=_ALLOWED_COLOUR, label="may attend"),
                   Patch(color=_BLOCKED_COLOUR, label="blocked")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=8)
    return ax


def plot_mask_grid(masks: dict[str, object], q_tokens: Sequence[str] | None = None,
                   k_tokens: Sequence[str] | None = None, *, axes=None, ncols: int = 3,
                   title: str | None = None):
    """One :func:`plot_mask` panel per entry of ``masks`` (panel title -> (T, S) mask).

    ``q_tokens`` / ``k_tokens`` label every panel; the legend is drawn on the last panel.
    Returns the axes.
    """
    if not masks:
        raise ValueError("masks is empty: give at least one title -> mask entry")
    shapes = [to_numpy(m).shape for m in masks.values()]
    T, S = max(s[0] for s in shapes), max(s[-1] for s in shapes)
    axes, flat = _grid_axes(len(masks), axes, ncols=ncols, panel=(1.4 + 0.3 * S, 1.0 + 0.3 * T), title=title)
    for i, (name, m) in enumerate(masks.items()):
        plot_mask(m, q_tokens, k_tokens, ax=flat[i], title=name, legend=i == len(masks) - 1)
    return axes


def plot_positions(table, *, ax=None, title: str | None = None, colorbar: bool = True):
    """Heatmap of position vectors (T, d): one row per position, one column per dimension."""
    t = to_numpy(table)
    if t.ndim != 2:
        raise ValueError(f"expected a table of shape (T, d), got shape {t.shape}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    limit = max(1e-9, float(np.abs(t).max()))
    image = ax.imshow(t, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    ax.set_title(title if title is not None else "position vectors")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="value")
    return ax


def plot_position_bias(bias, *, axes=None, ncols: int = 4, title: str | None = None):
    """Per-head additive score biases (h, T, S), e.g. ALiBi: one heatmap per head on one
    colour scale (0 is yellow, more negative is darker). NaN entries (e.g. the masked upper
    triangle of a causal model) are drawn in the light grey of a blocked cell of
    :func:`plot_mask`, so that a bias near 0 never looks like a masked entry. Returns the axes."""
    b = to_numpy(bias)
    if b.ndim != 3:
        raise ValueError(f"expected a bias of shape (heads, T, S), got shape {b.shape}")
    h = b.shape[0]
    axes, flat = _grid_axes(h, axes, ncols=ncols, panel=(2.6, 2.4), title=title)
    low = min(-1e-9, float(np.nanmin(b)))
    cmap = plt.get_cmap("viridis").with_extremes(bad=_BLOCKED_COLOUR)
    for i in range(h):
        image = flat[i].imshow(b[i], cmap=cmap, vmin=low, vmax=0.0, aspect="equal")
        flat[i].set_title(f"head {i}")
        flat[i].set_xlabel("key position")
        flat[i].set_ylabel("query position")
    flat[0].figure.colorbar(image, ax=list(flat[:h]), fraction=0.02, pad=0.02, label="added to the score")
    return axes


def plot_probe(report, *, ax=None, title: str | None = None):
    """Bar chart of a probe report (``tutorial_lib.probes``): the largest change of the output
    at each position, against the tolerance. Bars above the line are failures."""
    per_position = to_numpy(report.per_position)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.8))
    positions = np.arange(len(per_position))
    colours = ["tab:red" if v > report.atol else "tab:green" for v in per_position]
    ax.bar(positions, per_position, color=colours)
    ax.axhline(report.atol, color="black", linestyle=":", label=f"tolerance {report.atol:.0e}")
    # linear near 0 (an unchanged output has no bar), logarithmic above: changes span many decades
    ax.set_yscale("symlog", linthresh=report.atol / 10)
    ax.set_ylim(0, max(100 * report.atol, 300 * float(per_position.max())))  # room for the legend
    if not per_position.any():  # nothing to draw: say so rather than leave an empty panel
        ax.text(0.5, 0.5, "all changes = 0", transform=ax.transAxes, ha="center", va="center")
    ax.set_xticks(positions)
    ax.set_xlabel("output position")
    ax.set_ylabel("largest change of the output")
    verdict = "passed" if report.passed else f"failed from position {report.first_offending_position}"
    ax.set_title(title if title is not None else f"{report.probe}: {verdict}")
    ax.legend(loc="upper left", fontsize=8)
    return ax


# ---- data-flow diagram (notebook 00) ----------------------------------------------------------


def plot_data_flow(stages: Sequence[tuple[str, str, str]], *, ax=None, title: str | None = None):
    """A left-to-right chain of boxes, one per stage of a forward pass.

    ``stages``: (name, shape, note) per stop, e.g. ("embeddings", "(1, 20, 128)", "token + position").
    """
    if not stages:
        raise ValueError("no stages to draw")
    n = len(stages)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.9 * n, 2.6))
    ax.set_xlim(-0.1, n - 0.1)
    ax.set_ylim(0, 1)
    for i, (name, shape, note) in enumerate(stages):
        ax.add_patch(plt.Rectangle((i + 0.02, 0.32), 0.76, 0.46, facecolor="#dbe9f6", edgecolor="#2b5d8a", lw=1.5))
        ax.text(i + 0.4, 0.64, name, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(i + 0.4, 0.47, shape, ha="center", va="center", fontsize=9, family="monospace")
        ax.text(i + 0.4, 0.18, note, ha="center", va="center", fontsize=8, color="#444", wrap=True)
        if i < n - 1:
            ax.annotate("", xy=(i + 1.02, 0.55), xytext=(i + 0.78, 0.55),
                        arrowprops={"arrowstyle": "->", "lw": 1.5, "color": "#2b5d8a"})
    ax.set_axis_off()
    ax.set_title(title if title is not None else "one forward pass, with the shape at every stop")
    return ax


# ---- parameter counts (notebook 07) -----------------------------------------------------------

_GROUP_COLOURS = {"embeddings": "tab:orange", "attention": "tab:blue", "feed-forward": "tab:green",
                  "norms": "tab:purple", "head": "tab:red"}


def _short_count(n: float) -> str:
    """A parameter count in a few characters, for a bar label: 512, 43.4 k, 124.4 M, 6.74 B
    (``tutorial_lib.params.format_count`` writes the full number too)."""
    if n < 1e3:
        return f"{n:,.0f}"
    for size, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "k", 1)):
        if round(n / size, digits) >= 1:  # 999,960 is "1.0 M", not "1,000.0 k"
            return f"{n / size:,.{digits}f} {unit}"


def plot_parameter_breakdown(breakdowns: dict[str, dict[str, int]], *, ax=None, share: bool = True,
                             title: str | None = None):
    """One horizontal bar per model, split into embeddings, attention, feed-forward, norms and
    head (the groups of ``tutorial_lib.params.grouped``). ``breakdowns``: model name ->
    ``expected_parameters(cfg)`` or ``count_parameters(model)``. ``share=True`` draws percent
    of each model's total, with the total written at the end of the bar (43.4 k, 124.4 M, 6.74 B);
    otherwise millions."""
    from .params import GROUPS, grouped

    if not breakdowns:
        raise ValueError("no breakdowns to draw")
    names = list(breakdowns)
    totals = np.array([breakdowns[name]["total"] for name in names], dtype=float)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * len(names)))
    left = np.zeros(len(names))
    for group in GROUPS:
        values = np.array([grouped(breakdowns[name])[group] for name in names], dtype=float)
        values = 100 * values / totals if share else values / 1e6
        ax.barh(names, values, left=left, color=_GROUP_COLOURS[group], label=group)
        left += values
    if share:
        for i, total in enumerate(totals):
            ax.text(101, i, _short_count(total), va="center")
        ax.set_xlim(0, 118)
    ax.invert_yaxis()  # the first model on top
    ax.set_xlabel("share of the model's parameters (%)" if share else "parameters (millions)")
    ax.set_ylabel("model")
    ax.set_title(title if title is not None else "where the parameters live")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15 - 0.3 / len(names)), ncol=len(GROUPS), fontsize=8)
    return ax


def plot_parameter_growth(xs: Sequence[float], breakdowns: Sequence[dict[str, int]], *, xlabel: str,
                          ax=None, title: str | None = None):
    """Stacked areas of the parameter groups (embeddings, attention, feed-forward, norms, head),
    in millions, for a sequence of configs that differ in one setting ``xs`` (width, depth)."""
    from .params import GROUPS, grouped

    if len(xs) != len(breakdowns) or not xs:
        raise ValueError(f"need one breakdown per x value, got {len(breakdowns)} for {len(xs)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    per_group = [[grouped(b)[group] / 1e6 for b in breakdowns] for group in GROUPS]
    ax.stackplot(xs, per_group, labels=GROUPS, colors=[_GROUP_COLOURS[g] for g in GROUPS], alpha=0.85)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("parameters (millions)")
    ax.set_title(title if title is not None else f"parameters as {xlabel} grows")
    ax.legend(loc="upper left", fontsize=8)
    return ax


# ---- norm orders and gradient probes (notebooks 04 and 08b) -----------------------------------

_ORDER_COLOURS = {"pre": "tab:blue", "post": "tab:orange"}


def _plain_log_labels(axis) -> None:
    """Tick labels like 0.5 and 2 on a log axis, instead of 5x10^-1 and 2x10^0. When the axis
    spans more than a factor 8 (most of a decade), only 1, 2 and 5 times a power of ten are
    labelled, so that the minor labels do not crowd; a narrower axis labels every tick it has."""
    from matplotlib.ticker import FuncFormatter

    def label(value: float, _) -> str:
        low, high = sorted(axis.get_view_interval())
        if value > 0 and low > 0 and high > 8 * low:
            leading = round(value / 10 ** np.floor(np.log10(value) + 1e-9), 6)  # 2.0 for 0.2, 20, ...
            if leading not in (1.0, 2.0, 5.0):
                return ""
        return f"{value:g}"

    plain = FuncFormatter(label)
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def _box(ax, x: float, y: float, text: str, colour: str) -> None:
    ax.add_patch(plt.Rectangle((x - 0.32, y - 0.07), 0.64, 0.14, facecolor=colour, edgecolor="#333", lw=1.2))
    ax.text(x, y, text, ha="center", va="center", fontsize=9)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float]) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "lw": 1.3, "color": "#333"})


def _draw_sublayer(ax, order: str) -> None:
    """One residual sublayer, drawn bottom (input x) to top (output)."""
    norm, branch, plus = "#f6e3b4", "#dbe9f6", (0.5, 0.66)
    ax.text(0.5, 0.02, "x", ha="center", va="center", fontsize=11, weight="bold")
    if order == "post":
        _box(ax, 0.5, 0.36, "sublayer f\n(attention or FFN)", branch)
        _box(ax, 0.5, 0.86, "LayerNorm", norm)
        _arrow(ax, (0.5, 0.05), (0.5, 0.29))
        _arrow(ax, (0.5, 0.43), (0.5, plus[1] - 0.04))
        _arrow(ax, (0.5, plus[1] + 0.04), (0.5, 0.79))
        _arrow(ax, (0.5, 0.93), (0.5, 1.0))
        ax.text(0.5, 1.03, "LN(x + f(x))", ha="center", va="bottom", fontsize=10)
    else:
        _box(ax, 0.5, 0.24, "LayerNorm", norm)
        _box(ax, 0.5, 0.46, "sublayer f\n(attention or FFN)", branch)
        _arrow(ax, (0.5, 0.05), (0.5, 0.17))
        _arrow(ax, (0.5, 0.31), (0.5, 0.39))
        _arrow(ax, (0.5, 0.53), (0.5, plus[1] - 0.04))
        _arrow(ax, (0.5, plus[1] + 0.04), (0.5, 1.0))
        ax.text(0.5, 1.03, "x + f(LN(x))", ha="center", va="bottom", fontsize=10)
    ax.add_patch(plt.Circle(plus, 0.04, facecolor="white", edgecolor="#333", lw=1.2))
    ax.text(*plus, "+", ha="center", va="center", fontsize=12)
    # the residual path: from x around the branch into the addition
    ax.plot([0.5, 0.12, 0.12], [0.08, 0.08, plus[1]], color="tab:green", lw=2)
    _arrow(ax, (0.12, plus[1]), (plus[0] - 0.04, plus[1]))
    ax.text(0.1, 0.38, "residual path", rotation=90, ha="right", va="center", fontsize=8, color="tab:green")


def draw_norm_orders(*, axes=None, title: str | None = None):
    """Diagram of one residual sublayer in both orders: post-LN (Vaswani et al., 2017) on the
    left, pre-LN on the right. In pre-LN the residual path from input to output passes through
    no norm; in post-LN every path does. Returns the two axes."""
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(8, 4.6))
        fig.suptitle(title if title is not None else "One residual sublayer, two places for the norm")
    if len(axes) != 2:
        raise ValueError(f"need 2 axes (post-LN, pre-LN), got {len(axes)}")
    for ax, order, name in zip(axes, ("post", "pre"), ("post-LN (original Transformer, BERT)",
                                                       "pre-LN (GPT-2 and most models since)")):
        _draw_sublayer(ax, order)
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.05, 1.15)
        ax.set_axis_off()
        ax.set_title(name, fontsize=10)
    return axes


_ATTENTION_COLOURS = {"encoder": "#cfe3c8", "masked": "#dbe9f6", "cross": "#f3d3d3"}


def _block(ax, x: float, y: float, text: str, colour: str, *, width: float = 2.8, height: float = 0.9) -> None:
    ax.add_patch(plt.Rectangle((x - width / 2, y - height / 2), width, height, facecolor=colour,
                               edgecolor="#333", lw=1.1))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def draw_encoder_decoder(*, ax=None, title: str | None = None):
    """Diagram of the encoder-decoder Transformer (Vaswani et al., 2017, Figure 1) with its three
    attentions, each labelled with where its queries, keys and values come from and which mask
    it uses. Residual connections and norms are left out. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9.5, 7.2))
    enc, dec = 2.6, 7.4  # column centres
    for x, top, name in ((enc, 6.1, "encoder layer, × N"), (dec, 8.0, "decoder layer, × N")):
        ax.add_patch(plt.Rectangle((x - 1.85, 2.45), 3.7, top - 2.45, fill=False, ls="--", lw=1, edgecolor="#777"))
        ax.text(x - 1.75, top - 0.12, name, ha="left", va="top", fontsize=8, color="#555")
    _block(ax, enc, 0.5, "source ids (B, S)", "white", height=0.6)
    _block(ax, dec, 0.5, "decoder input (B, T):\nBOS + target shifted right", "white", height=0.7)
    for x in (enc, dec):
        _block(ax, x, 1.65, "embedding + positions", "#eeeeee", height=0.6)
        _arrow(ax, (x, 0.85 if x == dec else 0.8), (x, 1.35))
        _arrow(ax, (x, 1.95), (x, 2.85))
    _block(ax, enc, 3.3, "encoder self-attention\nQ, K, V: source positions\nmask: source padding (B,1,1,S)",
           _ATTENTION_COLOURS["encoder"])
    _block(ax, enc, 5.0, "feed-forward network", "#eeeeee", height=0.6)
    _block(ax, dec, 3.3, "masked self-attention\nQ, K, V: target positions\nmask: causal AND target padding",
           _ATTENTION_COLOURS["masked"])
    _block(ax, dec, 5.15, "cross-attention\nQ: target positions\nK, V: encoder output (memory)\n"
           "mask: source padding, no causal mask", _ATTENTION_COLOURS["cross"], width=3.4, height=1.15)
    _block(ax, dec, 6.9, "feed-forward network", "#eeeeee", height=0.6)
    _arrow(ax, (enc, 3.75), (enc, 4.7))
    _arrow(ax, (dec, 3.75), (dec, 4.57))
    _arrow(ax, (dec, 5.73), (dec, 6.6))
    _block(ax, enc, 6.85, "encoder output (memory)\n(B, S, d), computed once", "white", height=0.7)
    _arrow(ax, (enc, 5.3), (enc, 6.5))
    ax.annotate("", xy=(dec - 1.7, 5.15), xytext=(enc + 1.4, 6.85),
                arrowprops={"arrowstyle": "->", "lw": 1.6, "color": "tab:red"})
    ax.text(5.0, 6.3, "K, V of every\ndecoder layer", ha="center", va="center", fontsize=8, color="tab:red")
    _block(ax, dec, 8.75, "linear head + softmax:\nnext-token probabilities (B, T, V)", "white", height=0.7)
    _arrow(ax, (dec, 7.2), (dec, 8.4))
    ax.set_xlim(0.5, 9.5)
    ax.set_ylim(0, 9.3)
    ax.set_axis_off()
    ax.set_title(title if title is not None else
                 "The encoder-decoder Transformer: three attentions, and where Q, K and V come from\n"
                 "(residual connections and norms left out)", fontsize=10)
    return ax


def _by_depth(profiles) -> dict[int, dict[str, object]]:
    if not profiles:
        raise ValueError("no gradient profiles to draw")
    grouped: dict[int, dict[str, object]] = {}
    for p in profiles:
        grouped.setdefault(p.depth, {})[p.order] = p
    return dict(sorted(grouped.items()))


def plot_gradient_profiles(profiles, *, axes=None, title: str | None = None):
    """Per-layer gradient norms at initialisation (``tutorial_lib.norm_order.norm_order_gradients``):
    one panel per depth, pre-LN and post-LN on each, the mean over trials as a line and the
    range over trials as a band, on a log scale shared by the panels. Returns the axes."""
    grouped = _by_depth(profiles)
    if axes is None:
        fig, axes = plt.subplots(1, len(grouped), figsize=(4.2 * len(grouped), 3.4), sharey=True, squeeze=False)
        axes = axes[0]
        fig.suptitle(title if title is not None else "Gradient norm per layer at initialisation, same weights")
        fig.set_layout_engine("constrained")
    flat = np.asarray(axes, dtype=object).reshape(-1)
    if len(flat) < len(grouped):
        raise ValueError(f"need {len(grouped)} axes, one per depth, got {len(flat)}")
    for ax, (depth, by_order) in zip(flat, grouped.items()):
        for order, p in by_order.items():
            trials = to_numpy(p.per_trial)
            layers = np.arange(1, depth + 1)
            ax.plot(layers, trials.mean(0), "o-", ms=3, color=_ORDER_COLOURS.get(order), label=f"{order}-LN")
            ax.fill_between(layers, trials.min(0), trials.max(0), color=_ORDER_COLOURS.get(order), alpha=0.2)
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        ax.set_xlabel("layer (1 = next to the input)")
        ax.set_title(f"{depth} layers")
        ax.legend(fontsize=8)
    what = next(iter(profiles)).parameter or "all parameters of the layer"
    flat[0].set_ylabel(f"‖gradient of {what}‖")
    return axes


def plot_last_layer_vs_depth(profiles, *, ax=None, title: str | None = None):
    """The last layer's gradient norm against the depth of the stack, for both orders, with a
    1/sqrt(L) reference line through the shallowest pre-LN point (the scaling Xiong et al.,
    2020, Theorem 1, derive for pre-LN; for post-LN their bound does not depend on L)."""
    grouped = _by_depth(profiles)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4))
    depths = np.array(list(grouped))
    for order in ("pre", "post"):
        points = [(d, float(to_numpy(g[order].per_trial)[:, -1].mean())) for d, g in grouped.items() if order in g]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", color=_ORDER_COLOURS[order], label=f"{order}-LN")
    if "pre" in grouped[depths[0]]:
        start = float(to_numpy(grouped[depths[0]]["pre"].per_trial)[:, -1].mean())
        ax.plot(depths, start * np.sqrt(depths[0] / depths), "k:", label="∝ 1/√L")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("depth L (layers)")
    ax.set_ylabel("‖gradient‖ in the last layer")
    ax.set_title(title if title is not None else "The last layer's gradient as the stack deepens")
    ax.legend(fontsize=8)
    return ax


def plot_warmup_sweep(sweep, *, ax=None, title: str | None = None):
    """Final training loss against the learning rate (``tutorial_lib.norm_order.warmup_sweep``): one
    line per norm order, solid with filled circles without warmup, dashed with open squares with
    it; runs that blew up (NaN or inf) are crosses at the top; the dotted line is the sweep's
    failure threshold."""
    if not sweep.runs:
        raise ValueError("the sweep holds no runs")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.8))
    finite = [r.final_loss for r in sweep.runs if not r.blew_up]
    top = max(finite + [sweep.fail_loss]) * 1.15
    for order, warmup in dict.fromkeys((r.order, r.warmup_steps) for r in sweep.runs):
        runs = sorted((r for r in sweep.runs if (r.order, r.warmup_steps) == (order, warmup)), key=lambda r: r.lr)
        label = f"{order}-LN, " + ("no warmup" if warmup == 0 else f"{warmup} warmup steps")
        style = dict(linestyle="-", marker="o") if warmup == 0 else dict(linestyle="--", marker="s",
                                                                          markerfacecolor="white")
        colour = _ORDER_COLOURS.get(order)
        ax.plot([r.lr for r in runs], [top if r.blew_up else r.final_loss for r in runs], color=colour,
                label=label, **style)
        blown = [r.lr for r in runs if r.blew_up]
        if blown:
            ax.plot(blown, [top] * len(blown), "x", color=colour, ms=10, mew=2)
    ax.axhline(sweep.fail_loss, color="black", linestyle=":", label=f"failed at or above {sweep.fail_loss:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final training loss")
    ax.set_title(title if title is not None else "Which runs train: norm order × warmup × learning rate")
    ax.legend(fontsize=8, handlelength=4)  # long handles, so that solid and dashed can be told apart
    return ax


def plot_sweep_curves(sweep, *, axes=None, title: str | None = None):
    """The loss curves of a warmup sweep: one panel per (norm order, warmup), one line per
    learning rate (darker = larger). Returns the axes."""
    combos = list(dict.fromkeys((r.order, r.warmup_steps) for r in sweep.runs))
    if not combos:
        raise ValueError("the sweep holds no runs")
    axes, flat = _grid_axes(len(combos), axes, ncols=2, panel=(4.2, 2.8),
                            title=title if title is not None else "Training loss of every run")
    lrs = sorted({r.lr for r in sweep.runs})
    shades = plt.cm.viridis_r(np.linspace(0.15, 0.9, len(lrs)))
    for ax, (order, warmup) in zip(flat, combos):
        for r in (r for r in sweep.runs if (r.order, r.warmup_steps) == (order, warmup)):
            ax.plot(r.history.step, r.history.loss, color=shades[lrs.index(r.lr)], lw=1.2,
                    label=f"lr {r.lr:.0e}" + (" (blew up)" if r.blew_up else ""))
        ax.axhline(sweep.fail_loss, color="black", linestyle=":", lw=1)
        ax.set_title(f"{order}-LN, " + ("no warmup" if warmup == 0 else f"{warmup} warmup steps"))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    return axes


# ---- training recipes (notebook 08) -------------------------------------------------------------


def plot_schedules(schedules: dict[str, object], steps: int, *, peak: float = 1.0, ax=None,
                   title: str | None = None):
    """Learning rate against the step for LambdaLR multipliers (``tutorial_lib.train``'s
    schedules): ``schedules`` maps a label to a function step -> multiplier, and ``peak``
    scales them all. Steps are counted from 1, as the loop's history counts them."""
    if not schedules:
        raise ValueError("give at least one schedule")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    k = np.arange(steps)
    for label, multiplier in schedules.items():
        ax.plot(k + 1, [peak * multiplier(int(i)) for i in k], label=label)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("learning rate" if peak != 1.0 else "multiplier of the peak rate")
    ax.set_title(title if title is not None else "Learning-rate schedules")
    ax.legend(fontsize=8)
    return ax


def _curve(values) -> tuple[np.ndarray, np.ndarray]:
    """(steps, losses) from a History (``.step``, ``.loss``) or a plain sequence of losses."""
    if hasattr(values, "loss") and hasattr(values, "step"):
        return np.asarray(values.step), np.asarray(values.loss, dtype=float)
    losses = np.asarray(values, dtype=float)
    return np.arange(1, len(losses) + 1), losses


def plot_training_curves(curves: dict[str, object], *, ax=None, title: str | None = None,
                         ylabel: str = "training loss", logy: bool = False, styles: dict[str, str] | None = None):
    """Loss against the step, one line per entry of ``curves`` (label -> a ``History`` or a
    sequence of losses, step 1 first). A run that stopped early simply ends early; a NaN or an
    infinity is not drawn. ``styles`` maps a label to a matplotlib format string ("--", ":")."""
    if not curves:
        raise ValueError("give at least one curve")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for label, values in curves.items():
        steps, losses = _curve(values)
        losses = np.where(np.isfinite(losses), losses, np.nan)
        ax.plot(steps, losses, (styles or {}).get(label, "-"), label=label, lw=1.4)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel(ylabel)
    ax.set_title(title if title is not None else "Training curves")
    ax.legend(fontsize=8)
    return ax


def plot_grad_norms(history, *, clip_norm: float | None = None, ax=None, title: str | None = None,
                    label: str | None = None):
    """The global gradient norm before clipping, step by step (``History.grad_norm``), on a log
    axis, with the clipping threshold as a dotted line and the clipped steps marked."""
    steps, norms = np.asarray(history.step), np.asarray(history.grad_norm, dtype=float)
    if len(steps) == 0:
        raise ValueError("the history holds no steps")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    line, = ax.plot(steps, norms, lw=1.2, label=label or "gradient norm before clipping")
    if clip_norm is not None:
        clipped = norms > clip_norm
        ax.axhline(clip_norm, color="black", linestyle=":", label=f"clip_norm = {clip_norm:g}")
        if clipped.any():
            ax.plot(steps[clipped], norms[clipped], "o", color=line.get_color(), ms=4, mfc="none",
                    label=f"clipped ({int(clipped.sum())} steps)")
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("global gradient norm")
    ax.set_title(title if title is not None else "Gradient norm, step by step")
    ax.legend(fontsize=8)
    return ax


# ---- attention of every layer and head (notebook 05) ---------------------------------------------


def plot_attention_layers(weights, q_tokens: Sequence[str] | None = None,
                          k_tokens: Sequence[str] | None = None, *, axes=None, title: str | None = None,
                          cmap: str = "viridis"):
    """One heatmap per (layer, head) of weights (L, h, T, S): a row of panels per layer, all on
    one colour scale from 0 to the largest weight. Queries are labelled on the first column,
    keys under every panel. Returns the (L, h) array of axes."""
    w = to_numpy(weights)
    if w.ndim != 4:
        raise ValueError(f"expected weights of shape (layers, heads, T, S), got shape {w.shape}; "
                         "pick one example first, e.g. cross_weights[:, 0]")
    L, h, T, S = w.shape
    rows, cols = _labels(q_tokens, T, "query"), _labels(k_tokens, S, "key")
    if axes is None:
        fig, axes = plt.subplots(L, h, squeeze=False, figsize=(h * (0.6 + 0.17 * S), L * (0.9 + 0.17 * T)))
        if title:
            fig.suptitle(title)
        fig.set_layout_engine("constrained")
    axes = np.asarray(axes, dtype=object).reshape(L, h)
    vmax = max(1e-9, float(w.max()))
    for layer in range(L):
        for head in range(h):
            ax = axes[layer, head]
            image = ax.imshow(w[layer, head], cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
            ax.set_title(f"layer {layer}, head {head}", fontsize=9)
            ax.set_xticks(range(S), cols, fontsize=7)
            ax.set_yticks(range(T), rows if head == 0 else [], fontsize=7)
            ax.set_xlabel("key (attended to)", fontsize=8)
            if head == 0:
                ax.set_ylabel("query (attending)", fontsize=8)
    axes[0, 0].figure.colorbar(image, ax=list(axes.flat), fraction=0.02, pad=0.01, label="weight")
    return axes
