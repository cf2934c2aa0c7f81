"""Interactive explorers. Each wraps a pure ``render_*`` function that returns a matplotlib
figure, so tests need no browser; where widgets cannot run, the static figure is returned."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from .checks import check_count
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


def show_with_picture(widget, png: bytes) -> None:
    """Display ``widget`` with a PNG of its starting position in the same output.

    A live notebook draws the widget (its renderer ranks first); a static view of the saved
    notebook (GitHub, nbconvert, the course's site) has no kernel to draw it and shows the
    picture instead of the text ``VBox(children=...)``.
    """
    import base64

    from IPython.display import display

    png = bytes(png) if isinstance(png, (bytes, memoryview)) else png  # an Image widget holds a memoryview
    if not isinstance(png, bytes) or not png.startswith(b"\x89PNG"):
        raise ValueError(f"expected the PNG bytes of the widget's picture, got {type(png).__name__}")
    bundle = dict(widget._repr_mimebundle_())
    bundle["image/png"] = base64.b64encode(png).decode("ascii")
    bundle["text/plain"] = "an interactive explorer: run the notebook to move its controls"
    display(bundle, raw=True)


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
        show_with_picture(self.widget, self.image.value)


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


# ---- sampling playground (notebook 06) ---------------------------------------------------------


def token_label(token: str) -> str:
    """A character token as a readable tick label: newline, tab and space made visible."""
    return {"\n": "\\n", "\t": "\\t", " ": "␣"}.get(token, token)


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def render_sampling(logits, labels: Sequence[str], *, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, n_show: int = 20, samples: Sequence[str] = (),
                    fig: Figure | None = None) -> Figure:
    """The figure the playground shows: for one next-token distribution ``logits`` (V,), the
    ``n_show`` most likely tokens, with the model's probabilities (temperature 1, nothing
    filtered) next to the distribution the sampler actually draws from after temperature,
    top-k and top-p; below it, ``samples`` drawn with those settings, if given."""
    import torch

    from .sampling import Sampler

    logits = torch.as_tensor(logits).detach().float().cpu()
    if logits.dim() != 1:
        raise ValueError(f"expected the logits of one position, shape (V,), got {tuple(logits.shape)}")
    V = logits.numel()
    if len(labels) != V:
        raise ValueError(f"got {len(labels)} labels for a vocabulary of {V}")
    check_count("n_show", n_show)
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)  # validates the settings
    raw = logits.softmax(-1).numpy()
    drawn = sampler.probabilities(logits[None])[0].numpy()
    order = np.argsort(-raw, kind="stable")[: min(n_show, V)]  # the most likely under the model

    if fig is None:
        fig = plt.figure(figsize=(10, 5.2 if samples else 3.8))
    fig.clear()
    if samples:
        ax, ax_text = fig.subplots(2, 1, gridspec_kw={"height_ratios": [2.2, 1]})
    else:
        ax, ax_text = fig.subplots(1, 1), None
    x = np.arange(len(order))
    ax.bar(x - 0.2, raw[order], width=0.4, color="0.7", label="model (temperature 1, unfiltered)")
    ax.bar(x + 0.2, drawn[order], width=0.4, color="tab:blue", label="what the sampler draws from")
    ax.set_xticks(x, [token_label(labels[i]) for i in order])
    ax.set_xlabel(f"next token (the {len(order)} most likely of {V})")
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1.05 * max(raw[order].max(), drawn[order].max()))
    settings = [f"temperature {temperature:g}"] + ([f"top-k {top_k}"] if top_k else []) + (
        [f"top-p {top_p:g}"] if top_p is not None and top_p < 1 else [])
    ax.set_title(f"{', '.join(settings)}: {int((drawn > 0).sum())} of {V} tokens can be drawn, "
                 f"entropy {_entropy_bits(drawn):.2f} bits (model: {_entropy_bits(raw):.2f})")
    ax.legend(loc="upper right")
    if ax_text is not None:
        ax_text.set_axis_off()
        ax_text.set_title("samples with these settings (same random seed)")
        shown = "\n".join(f"{i + 1}: " + s.replace("\n", "⏎")[:110] for i, s in enumerate(samples))
        ax_text.text(0.0, 1.0, shown, family="monospace", fontsize=9, va="top", ha="left",
                     transform=ax_text.transAxes)
    fig.set_layout_engine("constrained")
    return fig


def _next_token_logits(model, ids):
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(ids[:, -model.cfg.max_len:]).logits[0, -1]  # (V,)
    model.train(was_training)
    return logits


def _sample_texts(model, ids, sampler, n: int, length: int, seed: int, decode) -> list[str]:
    import torch

    from .sampling import generate

    prompts = ids.expand(n, -1)  # (n, T): n continuations of one prompt
    out = generate(model, prompts, length, sampler=sampler, generator=torch.Generator().manual_seed(seed))
    return [decode(row[ids.size(1):]) for row in out]


class SamplingPlayground:
    """Temperature, top-k and top-p sliders over a language model's next-token distribution
    after ``prompt``, with ``n_samples`` continuations of ``length`` tokens drawn with the
    current settings (from the same seed every time, so only the settings change them).

    top-k = 0 and top-p = 1 mean "off". ``.widget`` is what the notebook displays and
    ``.image.value`` holds the current picture as PNG bytes.
    """

    def __init__(self, model, tokenizer, prompt: str, *, n_samples: int = 3, length: int = 80,
                 seed: int = 0, n_show: int = 20):
        import ipywidgets as W
        import torch

        self.model, self.tokenizer = model, tokenizer
        device = next(model.parameters()).device
        self.ids = torch.tensor([tokenizer.encode(prompt)], device=device)  # (1, T)
        self.logits = _next_token_logits(model, self.ids)
        self.labels = [tokenizer.decode([i], skip_specials=False) for i in range(self.logits.numel())]
        self.n_samples, self.length, self.seed, self.n_show = n_samples, length, seed, n_show
        self.temperature = W.FloatLogSlider(value=1.0, base=10, min=-1, max=0.7, step=0.05,
                                            description="temperature", continuous_update=False)
        self.top_k = W.IntSlider(value=0, min=0, max=self.logits.numel(), description="top-k (0: off)",
                                 continuous_update=False)
        self.top_p = W.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top-p (1: off)",
                                   continuous_update=False)
        self.image = W.Image(format="png")
        self._figure = plt.figure(figsize=(10, 5.2))
        plt.close(self._figure)  # drawn into the Image widget only
        for slider in (self.temperature, self.top_k, self.top_p):
            slider.observe(self._update, names="value")
        self.widget = W.VBox([W.HBox([self.temperature, self.top_k, self.top_p]), self.image])
        self._update()

    def settings(self) -> dict:
        return {"temperature": float(self.temperature.value), "top_k": self.top_k.value or None,
                "top_p": None if self.top_p.value >= 1.0 else float(self.top_p.value)}

    def samples(self) -> list[str]:
        from .sampling import Sampler

        return _sample_texts(self.model, self.ids, Sampler(**self.settings()), self.n_samples, self.length,
                             self.seed, self.tokenizer.decode)

    def _update(self, _change=None) -> None:
        render_sampling(self.logits, self.labels, **self.settings(), n_show=self.n_show,
                        samples=self.samples(), fig=self._figure)
        self.image.value = _figure_png(self._figure)

    def _ipython_display_(self):
        show_with_picture(self.widget, self.image.value)


def sampling_playground(model, tokenizer, prompt: str, *, static: bool | None = None, n_samples: int = 3,
                        length: int = 80, seed: int = 0, n_show: int = 20):
    """Explore temperature, top-k and top-p on ``model``'s next token after ``prompt``.

    Returns a :class:`SamplingPlayground` in a running kernel with ipywidgets; otherwise (or
    with ``static=True``) the static figure at temperature 1 with nothing filtered.
    """
    if static is None:
        static = not widgets_available()
    if not static:
        return SamplingPlayground(model, tokenizer, prompt, n_samples=n_samples, length=length, seed=seed,
                                  n_show=n_show)
    import torch

    from .sampling import Sampler

    ids = torch.tensor([tokenizer.encode(prompt)], device=next(model.parameters()).device)
    logits = _next_token_logits(model, ids)
    labels = [tokenizer.decode([i], skip_specials=False) for i in range(logits.numel())]
    samples = _sample_texts(model, ids, Sampler(), n_samples, length, seed, tokenizer.decode)
    return render_sampling(logits, labels, n_show=n_show, samples=samples)


# ---- memory and FLOPs calculator (notebook 07) -------------------------------------------------


def render_memory_calculator(cfg, *, name: str = "model", batch: int = 1, seq_len: int | None = None,
                             dtype: str = "bf16", device_gib: float | None = None,
                             fig: Figure | None = None) -> Figure:
    """The calculator's figure for one config: memory in GiB (the weights in ``dtype``; training
    with AdamW in mixed precision, without activations; the KV cache of ``batch`` sequences of
    ``seq_len`` positions in ``dtype``, plus as many source positions for an encoder-decoder;
    weights plus cache for inference), with a line at ``device_gib`` when given, and the FLOPs
    per token at a context of ``seq_len`` (decoder-only and encoder models).

    For a mixture of experts the title gives both sizes: memory holds every expert (the
    total), while the FLOPs per token follow the parameters a token uses (the active ones)."""
    from .params import GiB, expected_parameters, flops_per_token, kv_cache_bytes, training_bytes, weight_bytes

    seq_len = cfg.max_len if seq_len is None else seq_len
    counts = expected_parameters(cfg)
    n = counts["total"]
    weights = weight_bytes(n, dtype)
    kv, source = 0, seq_len if cfg.family == "encoder-decoder" else None  # as many source as target positions
    if cfg.family != "encoder":
        kv = kv_cache_bytes(cfg, batch, seq_len, dtype, source_len=source)
    positions = f"{seq_len} + {source} source" if source else f"{seq_len}"
    every = f", all {cfg.n_experts} experts" if cfg.n_experts else ""
    bars = {f"weights ({dtype}{every})": weights,
            f"KV cache ({batch} x {positions} positions, {dtype})": kv,
            "inference: weights + KV cache": weights + kv,
            "training: weights, gradients, AdamW": training_bytes(n)["total"]}
    if fig is None:
        fig = plt.figure(figsize=(11, 3.8))
    fig.clear()
    ax_mem, ax_flops = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    labels = list(bars)
    values = np.array([bars[label] / GiB for label in labels])
    ax_mem.barh(labels, values, color=["tab:blue", "tab:orange", "tab:cyan", "tab:red"])
    ax_mem.set_xscale("log")
    smallest = max(values[values > 0].min() / 3, 1e-4)
    ax_mem.set_xlim(smallest, max(values.max(), device_gib or 0) * 8)
    for i, value in enumerate(values):
        text = "none (an encoder keeps no cache)" if value == 0 else (
            f"{value:,.2f} GiB" if value >= 1 else f"{value * 1024:,.1f} MiB")
        ax_mem.text(max(value, smallest) * 1.1, i, text, va="center", fontsize=9)
    if device_gib:
        ax_mem.axvline(device_gib, color="black", ls="--", lw=1, label=f"one device: {device_gib:g} GiB")
        ax_mem.legend(loc="upper right", fontsize=8)
    ax_mem.invert_yaxis()
    ax_mem.set_xlabel("memory (GiB, log scale)")
    ax_mem.set_ylabel("what is held")
    ax_mem.set_title("memory")
    ax_flops.set_xlabel("pass")
    ax_flops.set_ylabel("GFLOP per token")
    if cfg.family == "encoder-decoder":
        ax_flops.text(0.5, 0.5, "per-token FLOPs are not defined\nfor encoder-decoder models here",
                      ha="center", va="center", transform=ax_flops.transAxes)
        ax_flops.set_title("FLOPs per token")
    else:
        flops = flops_per_token(cfg, seq_len)
        matmul = np.array([flops["matmul"], 3 * flops["matmul"]]) / 1e9
        attention = np.array([flops["attention"], 3 * flops["attention"]]) / 1e9
        ax_flops.bar(["forward", "training"], matmul, color="tab:green", label="weight matrices")
        ax_flops.bar(["forward", "training"], attention, bottom=matmul, color="tab:purple",
                     label=f"attention over {seq_len} keys")
        for x, top in enumerate(matmul + attention):
            ax_flops.text(x, top, f"{top:,.3g} G", ha="center", va="bottom", fontsize=9)
        ax_flops.set_ylim(0, 1.5 * (matmul + attention).max())  # room for the legend
        ax_flops.legend(loc="upper left", fontsize=8)
        ax_flops.set_title("FLOPs per token" + (" (active parameters)" if cfg.n_experts else ""))
    title = f"{name}: {n:,} parameters"
    if "active" in counts:
        title += f", {counts['active']:,} active per token ({cfg.experts_per_token} of {cfg.n_experts} experts)"
    fig.suptitle(title)
    fig.set_layout_engine("constrained")
    return fig


class MemoryCalculator:
    """Pick a config, batch, sequence length and dtype; see weights, training memory, KV cache
    and FLOPs per token (through :func:`render_memory_calculator`).

    ``configs``: name -> ModelConfig. ``.widget`` is what the notebook displays and
    ``.image.value`` holds the current picture as PNG bytes.
    """

    def __init__(self, configs: dict, *, device_gib: float | None = None, batch: int = 1,
                 dtype: str = "bf16"):
        import ipywidgets as W

        if not configs:
            raise ValueError("no configs to choose from")
        self.configs, self.device_gib = dict(configs), device_gib
        first = next(iter(self.configs.values()))
        self.config = W.Dropdown(options=list(self.configs), description="model")
        self.batch = W.IntSlider(value=batch, min=1, max=64, description="batch", continuous_update=False)
        self.seq_len = W.IntSlider(value=first.max_len, min=1, max=first.max_len, description="positions",
                                   continuous_update=False)
        self.dtype = W.Dropdown(options=["fp32", "bf16", "int8"], value=dtype, description="dtype")
        self.image = W.Image(format="png")
        self._figure = plt.figure(figsize=(11, 3.8))
        plt.close(self._figure)  # drawn into the Image widget only
        self.config.observe(self._new_config, names="value")
        for control in (self.batch, self.seq_len, self.dtype):
            control.observe(self._update, names="value")
        self.widget = W.VBox([W.HBox([self.config, self.dtype]), W.HBox([self.batch, self.seq_len]), self.image])
        self._update()

    def _new_config(self, _change=None) -> None:
        max_len = self.configs[self.config.value].max_len
        with self.seq_len.hold_trait_notifications():
            self.seq_len.max = max_len
            self.seq_len.value = min(self.seq_len.value, max_len)
        self._update()

    def _update(self, _change=None) -> None:
        render_memory_calculator(self.configs[self.config.value], name=self.config.value, batch=self.batch.value,
                                 seq_len=self.seq_len.value, dtype=self.dtype.value, device_gib=self.device_gib,
                                 fig=self._figure)
        self.image.value = _figure_png(self._figure)

    def _ipython_display_(self):
        show_with_picture(self.widget, self.image.value)


def memory_calculator(configs: dict, *, static: bool | None = None, device_gib: float | None = None,
                      batch: int = 1, dtype: str = "bf16"):
    """The memory and FLOPs calculator over ``configs`` (name -> ModelConfig).

    Returns a :class:`MemoryCalculator` in a running kernel with ipywidgets; otherwise (or
    with ``static=True``) the static figure of the first config at its full context.
    """
    if static is None:
        static = not widgets_available()
    if not static:
        return MemoryCalculator(configs, device_gib=device_gib, batch=batch, dtype=dtype)
    if not configs:
        raise ValueError("no configs to choose from")
    name, cfg = next(iter(configs.items()))
    return render_memory_calculator(cfg, name=name, batch=batch, dtype=dtype, device_gib=device_gib)
