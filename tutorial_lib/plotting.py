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
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return ax


def _plot_heads(w: np.ndarray, q_tokens, k_tokens, *, axes, title, annotate, cmap):
    h = w.shape[0]
    if axes is None:
        ncols = min(h, 4)
        nrows = -(-h // ncols)
        T, S = w.shape[1:]
        fig, axes = plt.subplots(nrows, ncols, squeeze=False,
                                 figsize=(ncols * (1.2 + 0.3 * S), nrows * (1.0 + 0.3 * T)))
        for extra in axes.flat[h:]:
            extra.set_visible(False)
        if title:
            fig.suptitle(title)
        fig.set_layout_engine("constrained")
    flat = np.asarray(axes, dtype=object).reshape(-1)
    if len(flat) < h:
        raise ValueError(f"need {h} axes for {h} heads, got {len(flat)}")
    for i in range(h):
        plot_attention(w[i], q_tokens, k_tokens, ax=flat[i], title=f"head {i}",
                       annotate=annotate, cmap=cmap, colorbar=False, vmax=float(w.max()))
    return axes
