"""Pre-LN against post-LN (notebooks 04 and 08b): where a residual block puts its norm decides how
gradients flow through a deep stack and whether training needs a warmup.

Two probes, on encoder stacks of this course:

* **gradient norms at initialisation**, layer by layer, of matched pre-LN and post-LN stacks
  (the same weights in both; :func:`norm_order_gradients`): in a post-LN stack the last
  layers' gradients are the largest (Xiong et al., 2020, "On Layer Normalization in the
  Transformer Architecture");
* **a warmup sweep** (:func:`warmup_sweep`): short training runs of both orders, with and
  without warmup, at several learning rates; which ones fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .checks import check_count
from .config import ModelConfig
from .layers import RMSNorm, init_weights
from .positions import sinusoidal_table
from .train import History, NonFiniteError, constant_schedule, default_loss, make_optimizer, train
from .transformer import Encoder

NORM_ORDERS = ("pre", "post")
INITS = ("xavier", "config")

# ---- the first probe: gradient norms at initialisation --------------------------------------------


def xavier_init(model: nn.Module) -> nn.Module:
    """Re-initialise ``model`` in place with Xavier-uniform matrices, and return it.

    Every Linear weight Xavier-uniform (Glorot & Bengio, 2010): U(-a, a) with
    a = sqrt(6 / (fan_in + fan_out)), as ``torch.nn.Transformer._reset_parameters`` does for
    every matrix. Unlike ``nn.Transformer``, every bias is set to 0: PyTorch zeroes the
    attention biases (``nn.MultiheadAttention``) but leaves the FFN's ``nn.Linear`` biases at
    their default U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Norm scales 1, shifts 0. Embedding tables,
    which ``nn.Transformer`` does not have, N(0, 1/d): the scale fairseq pairs with multiplying
    embeddings by sqrt(d). A Linear that shares its weight with an embedding table (tied
    weights) keeps the table's.
    """
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                if id(module.weight) not in tables:
                    nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
    return model


def _initialise(model: nn.Module, cfg: ModelConfig, init: str) -> None:
    if init == "xavier":
        xavier_init(model)
    elif init == "config":
        init_weights(model, cfg)  # N(0, init_std^2) and the config's options (GPT-2's scheme)
    else:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")


def matched_stacks(cfg: ModelConfig, *, init: str = "xavier") -> tuple[Encoder, Encoder]:
    """A pre-LN and a post-LN encoder of ``cfg.n_layers`` layers with identical layer weights.

    The two orders have the same parameter names, so the post-LN stack loads the pre-LN
    stack's layers. The pre-LN stack also has its final norm (scale 1, shift 0); the post-LN
    stack needs none, its last sublayer already ends in a norm. Both are in eval mode
    (dropout off). ``init``: "xavier" (:func:`xavier_init`) or "config" (``init_weights``).
    """
    pre = Encoder(replace(cfg, norm_order="pre", final_norm=None))
    _initialise(pre, cfg, init)
    post = Encoder(replace(cfg, norm_order="post", final_norm=None))
    post.layers.load_state_dict(pre.layers.state_dict())
    return pre.eval(), post.eval()


def layer_gradient_norms(encoder: Encoder, x: Tensor, readout: Tensor | str, *,
                         parameter: str | None = "ffn.down.weight") -> Tensor:
    """The gradient norm, layer by layer, of a scalar read out of ``encoder(x)``.

    x: (B, T, d) input vectors. ``readout``: a tensor R of x's shape gives the linear readout
    loss = sum(y * R) / (B T), whose gradient with respect to the output y is R / (B T)
    whatever y is; the string "squared_norm" gives loss = sum(y^2) / (B T), which after a
    final LayerNorm is nearly constant (about d), so its gradients are nearly zero.
    ``parameter``: the name of one parameter inside a layer (default the FFN's second matrix,
    the W^2 of Xiong et al., 2020), or None for the norm over all of a layer's parameters.
    Returns (n_layers,) float64 norms, first layer first.
    """
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be float input vectors (B, T, d), got {got}")
    if isinstance(readout, Tensor):
        if readout.shape != x.shape:
            raise ValueError(f"a linear readout needs one direction per output vector, shape {tuple(x.shape)}, "
                             f"got {tuple(readout.shape)}")
    elif readout != "squared_norm":
        raise ValueError(f"readout must be a tensor of directions (linear) or 'squared_norm', got {readout!r}")
    names = dict(encoder.layers[0].named_parameters())
    if parameter is not None and parameter not in names:
        raise ValueError(f"no parameter {parameter!r} in a layer; a layer has {sorted(names)}")
    encoder.zero_grad(set_to_none=True)
    y = encoder(x).x  # (B, T, d)
    n = x.size(0) * x.size(1)
    loss = (y.pow(2) if isinstance(readout, str) else y * readout).sum() / n
    loss.backward()
    norms = []
    for layer in encoder.layers:
        params = [layer.get_parameter(parameter)] if parameter is not None else list(layer.parameters())
        grads = [p.grad.detach().double().flatten() for p in params if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.cat(grads)) if grads else torch.zeros((), dtype=torch.float64))
    encoder.zero_grad(set_to_none=True)
    return torch.stack(norms).cpu()


def probe_inputs(batch_size: int, seq_len: int, d_model: int, *, vocab_size: int = 64,
                 generator: torch.Generator | None = None) -> Tensor:
    """Input vectors like a freshly initialised model's: random token ids looked up in a table
    of unit-variance vectors, plus sinusoidal positions (Vaswani et al., 2017, section 3.4-3.5:
    embeddings multiplied by sqrt(d), then positions added). Shape (B, T, d)."""
    table = torch.randn(vocab_size, d_model, generator=generator)  # (V, d)
    ids = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    return table[ids] + sinusoidal_table(seq_len, d_model)  # (B, T, d)


@dataclass(frozen=True)
class GradientProfile:
    """Per-layer gradient norms of one stack (one norm order, one depth), for several trials."""

    order: str
    depth: int
    parameter: str | None
    readout: str
    per_trial: Tensor  # (trials, depth)

    @property
    def mean(self) -> Tensor:
        """(depth,) the mean over trials."""
        return self.per_trial.mean(dim=0)

    @property
    def last_over_first(self) -> float:
        return float(self.mean[-1] / self.mean[0])


def norm_order_gradients(cfg: ModelConfig, depths: tuple[int, ...] = (6, 12, 24), *, trials: int = 4,
                         batch_size: int = 8, seq_len: int = 16, readout: str = "linear",
                         parameter: str | None = "ffn.down.weight", init: str = "xavier",
                         seed: int = 0) -> list[GradientProfile]:
    """Per-layer gradient norms at initialisation of matched pre-LN and post-LN stacks.

    For every depth and trial: one set of weights (:func:`matched_stacks`, seeded by
    ``seed + trial``; the global generator is restored afterwards), one input from
    :func:`probe_inputs` and one readout, shared by the two orders.
    ``readout``: "linear" (random N(0, 1) directions) or "squared_norm" (see
    :func:`layer_gradient_norms`). Returns one :class:`GradientProfile` per (order, depth),
    pre-LN first, in the order of ``depths``.
    """
    if not depths:
        raise ValueError(f"depths must be a non-empty sequence of positive ints (numbers of layers), got {depths!r}")
    for i, L in enumerate(depths):
        check_count(f"depths[{i}]", L)
    check_count("trials", trials)
    if readout not in ("linear", "squared_norm"):
        raise ValueError(f"readout must be 'linear' or 'squared_norm', got {readout!r}")
    norms: dict[tuple[str, int], list[Tensor]] = {(o, L): [] for o in NORM_ORDERS for L in depths}
    for L in depths:
        for trial in range(trials):
            generator = torch.Generator().manual_seed(seed + trial)
            x = probe_inputs(batch_size, seq_len, cfg.d_model, generator=generator)
            directions = torch.randn(x.shape, generator=generator) if readout == "linear" else readout
            with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
                torch.manual_seed(seed + trial)
                stacks = matched_stacks(replace(cfg, n_layers=L, dropout=0.0), init=init)
            for order, stack in zip(NORM_ORDERS, stacks):
                norms[order, L].append(layer_gradient_norms(stack, x, directions, parameter=parameter))
    return [GradientProfile(order, L, parameter, readout, torch.stack(norms[order, L]))
            for order in NORM_ORDERS for L in depths]


# ---- the second probe: short training runs with and without warmup ------------------------------


@dataclass(frozen=True)
class TrainingRun:
    """One short training run of the warmup sweep."""

    order: str
    warmup_steps: int
    lr: float
    history: History = field(repr=False)  # what the loop measured, up to where it stopped
    final_loss: float  # mean of the last few losses; inf when the loss or a gradient blew up
    failed: bool  # not finite, or final_loss >= the sweep's fail_loss
    blew_up: bool  # stopped by a NaN or an infinity


@dataclass(frozen=True)
class WarmupSweep:
    runs: list[TrainingRun]
    fail_loss: float

    def run(self, order: str, warmup_steps: int, lr: float) -> TrainingRun:
        for r in self.runs:
            if (r.order, r.warmup_steps, r.lr) == (order, warmup_steps, lr):
                return r
        raise ValueError(f"no run with order={order!r}, warmup_steps={warmup_steps}, lr={lr}")

    def first_failure(self, order: str, warmup_steps: int) -> float | None:
        """The smallest learning rate at which this (order, warmup) failed; None if none did."""
        failed = [r.lr for r in self.runs if (r.order, r.warmup_steps) == (order, warmup_steps) and r.failed]
        return min(failed) if failed else None

    def summary(self) -> str:
        """One line per (order, warmup): the final loss at every learning rate, failures marked."""
        lines = []
        for order, warmup in dict.fromkeys((r.order, r.warmup_steps) for r in self.runs):
            cells = []
            for r in sorted((r for r in self.runs if (r.order, r.warmup_steps) == (order, warmup)), key=lambda r: r.lr):
                value = "blew up" if r.blew_up else f"{r.final_loss:.3f}"
                cells.append(f"lr {r.lr:.0e}: {value}{' FAILED' if r.failed else ''}")
            label = f"{order}-LN, {'no warmup' if warmup == 0 else f'warmup {warmup}'}"
            lines.append(f"{label:<22} " + " | ".join(cells))
        return "\n".join(lines)


def warmup_sweep(make_model, get_batch, *, steps: int, lrs, warmup_steps: int, fail_loss: float,
                 orders: tuple[str, ...] = NORM_ORDERS, compute_loss=default_loss, seed: int = 0,
                 clip_norm: float | None = None, tail: int = 10) -> WarmupSweep:
    """Short training runs of both norm orders, without warmup and with ``warmup_steps`` of
    linear warmup (then a constant rate), at each learning rate in ``lrs``.

    ``make_model(order)`` builds and initialises a model with that norm order; it is called
    with the CPU generator seeded by ``seed`` (and restored afterwards), so every run starts
    from the same weights.
    ``get_batch(i)`` and ``compute_loss(model, batch)`` are those of
    :func:`tutorial_lib.train.train`, which runs each of them with AdamW (``make_optimizer``);
    every run sees the same batches. ``clip_norm`` defaults to None: clipping would hide part of
    what the probe looks for. A run *fails* when its loss or a gradient becomes NaN or infinite,
    or when the mean of its last ``tail`` losses is still at or above ``fail_loss`` (for
    example the loss of a uniform guess, log V).
    """
    check_count("steps", steps)
    check_count("warmup_steps", warmup_steps, maximum=steps, bound_name="steps")
    lrs = [float(lr) for lr in lrs]
    if not lrs or any(lr <= 0 for lr in lrs):
        raise ValueError(f"lrs must be positive learning rates, got {lrs}")
    if any(o not in NORM_ORDERS for o in orders):
        raise ValueError(f"orders must be among {NORM_ORDERS}, got {orders}")
    check_count("tail", tail, maximum=steps, bound_name="steps")
    runs = []
    for order in orders:
        for warmup in (0, warmup_steps):
            for lr in lrs:
                with torch.random.fork_rng(devices=[]):  # the same weights every run; the caller's RNG untouched
                    torch.manual_seed(seed)
                    model = make_model(order)
                history = History()
                blew_up = False
                try:
                    train(model, get_batch, steps, optimizer=make_optimizer(model, lr),
                          schedule=constant_schedule(warmup), compute_loss=compute_loss, clip_norm=clip_norm,
                          history=history, progress=False)
                except NonFiniteError:
                    blew_up = True
                final = float("inf") if blew_up or not history.loss else sum(history.loss[-tail:]) / len(
                    history.loss[-tail:])
                failed = blew_up or not final < fail_loss
                runs.append(TrainingRun(order, warmup, lr, history, final, failed, blew_up))
    return WarmupSweep(runs, float(fail_loss))
