"""Probes that check a model's behaviour from the outside, on any callable.

A model here is any function ``model_fn(ids) -> outputs`` with ids (B, T) and outputs
(B, T, ...): a bare ``nn.Module``, a lambda around one that fixes a mask, a whole language
model. Models of this course return a named tuple ``(logits, loss, attn)``; when the output
is a tuple its first element is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# ---- leakage and padding isolation -------------------------------------------------------------


@dataclass(frozen=True)
class ProbeReport:
    """What a probe found.

    ``per_position[t]`` is the largest change of the output at position t over every
    perturbation that should have left it alone; ``first_offending_position`` is the first
    t where that change exceeds the tolerance (None when the probe passed).
    """

    probe: str
    passed: bool
    max_difference: float
    first_offending_position: int | None
    per_position: Tensor  # (T,)
    atol: float

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"FAILED at position {self.first_offending_position}"
        return f"{self.probe}: {verdict} (largest change {self.max_difference:.2e}, tolerance {self.atol:.0e})"


def _outputs(model_fn: Callable, ids: Tensor) -> Tensor:
    out = model_fn(ids)
    if isinstance(out, tuple):
        out = out[0]
    if not isinstance(out, Tensor) or out.dim() < 2 or out.shape[:2] != ids.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"model_fn must map ids {tuple(ids.shape)} to outputs (B, T, ...) = "
                         f"{tuple(ids.shape)} + (...), got {got}")
    return out.detach().double()


def _check_ids(ids: Tensor, vocab_size: int | None) -> int:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"ids must be an integer tensor of shape (B, T), got {got}")
    if ids.size(1) < 2:
        raise ValueError(f"the probes need at least 2 positions, got T={ids.size(1)}")
    if vocab_size is None:
        vocab_size = max(int(ids.max()) + 1, 2)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2 (a token must have an alternative), got {vocab_size!r}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"ids must lie in [0, vocab_size={vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    return vocab_size


def _other_tokens(ids: Tensor, vocab_size: int, generator: torch.Generator) -> Tensor:
    """Random ids that differ from ``ids`` at every position."""
    step = torch.randint(1, vocab_size, ids.shape, generator=generator).to(ids.device)
    return (ids + step) % vocab_size


def _baseline(model_fn: Callable, ids: Tensor, atol: float) -> Tensor:
    reference = _outputs(model_fn, ids)
    again = _outputs(model_fn, ids)
    noise = (again - reference).abs().max().item()
    if noise > atol:
        raise ValueError(f"model_fn gives different outputs for the same ids (by {noise:.2e}); "
                         "call model.eval() to switch off dropout before probing")
    return reference


def _report(name: str, per_position: Tensor, atol: float) -> ProbeReport:
    bad = (per_position > atol).nonzero()
    first = int(bad[0]) if len(bad) else None
    return ProbeReport(name, first is None, float(per_position.max()), first, per_position.float(), atol)


@torch.no_grad()
def causal_leakage(model_fn: Callable, ids: Tensor, *, vocab_size: int | None = None,
                   positions: list[int] | None = None, atol: float = 1e-5, seed: int = 0) -> ProbeReport:
    """Does the output at position t depend on any token after t?

    For each cut t (every position but the last, or those in ``positions``) the tokens
    t+1.. are replaced by different random tokens and the outputs at positions 0..t are
    compared with the originals. A causal model changes none of them. Costs one forward
    pass per cut. ``vocab_size`` bounds the random tokens (default: the largest id + 1).
    """
    vocab_size = _check_ids(ids, vocab_size)
    T = ids.size(1)
    cuts = list(range(T - 1)) if positions is None else positions
    for t in cuts:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < T - 1:
            raise ValueError(f"positions must be ints in [0, T-1={T - 1}) (something must come after them), got {t!r}")
    generator = torch.Generator().manual_seed(seed)
    reference = _baseline(model_fn, ids, atol)  # (B, T, ...)
    per_position = torch.zeros(T, dtype=torch.float64)
    for t in cuts:
        changed = ids.clone()
        changed[:, t + 1:] = _other_tokens(ids[:, t + 1:], vocab_size, generator)
        diff = (_outputs(model_fn, changed) - reference)[:, : t + 1].abs()  # (B, t+1, ...)
        diff = diff.flatten(2).amax(dim=(0, 2)) if diff.dim() > 2 else diff.amax(dim=0)  # (t+1,)
        per_position[: t + 1] = torch.maximum(per_position[: t + 1], diff.cpu())
    return _report("causal leakage", per_position, atol)


@torch.no_grad()
def padding_isolation(model_fn: Callable, ids: Tensor, pad_positions: Tensor, *,
                      vocab_size: int | None = None, trials: int = 3, atol: float = 1e-5,
                      seed: int = 0) -> ProbeReport:
    """Do the real (non-padding) positions ignore what the padding positions hold?

    ``pad_positions``: boolean (B, T), True where a position is padding. The tokens there
    are replaced by random other tokens ``trials`` times and the outputs at every real
    position are compared with the originals. ``model_fn`` must take its padding mask from
    something fixed (e.g. a closure over the lengths), not recompute it from the ids: the
    probe changes exactly the tokens a mask built from ``ids == pad_id`` would look at.
    """
    vocab_size = _check_ids(ids, vocab_size)
    if not isinstance(pad_positions, Tensor) or pad_positions.dtype != torch.bool or pad_positions.shape != ids.shape:
        got = (f"{pad_positions.dtype} {tuple(pad_positions.shape)}" if isinstance(pad_positions, Tensor)
               else type(pad_positions).__name__)
        raise ValueError(f"pad_positions must be a boolean tensor of the ids' shape {tuple(ids.shape)} "
                         f"(True = padding), got {got}")
    if not pad_positions.any():
        raise ValueError("pad_positions marks no padding: there is nothing to perturb")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    generator = torch.Generator().manual_seed(seed)
    reference = _baseline(model_fn, ids, atol)
    real = ~pad_positions.cpu()  # (B, T)
    per_position = torch.zeros(ids.size(1), dtype=torch.float64)
    for _ in range(trials):
        changed = torch.where(pad_positions, _other_tokens(ids, vocab_size, generator), ids)
        diff = (_outputs(model_fn, changed) - reference).abs()
        diff = diff.flatten(2).amax(dim=2) if diff.dim() > 2 else diff  # (B, T)
        diff = diff.cpu().masked_fill(~real, 0.0).amax(dim=0)  # padding positions may change
        per_position = torch.maximum(per_position, diff)
    return _report("padding isolation", per_position, atol)


# ---- teacher forcing: does a prediction see its own label? (notebook 05) --------------------


@torch.no_grad()
def label_leakage(logits_fn: Callable, labels: Tensor, *, vocab_size: int | None = None,
                  atol: float = 1e-5, seed: int = 0) -> ProbeReport:
    """Does the prediction for label t depend on label t or on a later label?

    ``logits_fn(labels)`` is a teacher-forced training pipeline: from the labels (B, T) it
    builds the decoder input (BOS, then the labels shifted right) and returns the outputs
    (B, T, ...) whose position t is scored against ``labels[:, t]``. Done right, position t
    sees labels 0..t-1 only. For each t the labels t.. are replaced by different random
    tokens and the outputs at positions 0..t are compared with the originals; a pipeline
    that forgot the shift changes position t (it reads its own answer) and fails there.
    """
    vocab_size = _check_ids(labels, vocab_size)
    T = labels.size(1)
    generator = torch.Generator().manual_seed(seed)
    reference = _baseline(logits_fn, labels, atol)  # (B, T, ...)
    per_position = torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        changed = labels.clone()
        changed[:, t:] = _other_tokens(labels[:, t:], vocab_size, generator)
        diff = (_outputs(logits_fn, changed) - reference)[:, : t + 1].abs()  # (B, t+1, ...)
        diff = diff.flatten(2).amax(dim=(0, 2)) if diff.dim() > 2 else diff.amax(dim=0)  # (t+1,)
        per_position[: t + 1] = torch.maximum(per_position[: t + 1], diff.cpu())
    return _report("label leakage", per_position, atol)


# ---- gradient probes: post-LN vs pre-LN at initialisation, and warmup (notebook 04) -------------
# The imports of this section stand here, next to the code that uses them.
from dataclasses import field, replace  # noqa: E402

from torch import nn  # noqa: E402

from .config import ModelConfig  # noqa: E402
from .layers import RMSNorm, init_weights  # noqa: E402
from .positions import sinusoidal_table  # noqa: E402
from .train import History, NonFiniteError, constant_schedule, default_loss, make_optimizer, train  # noqa: E402
from .transformer import Encoder  # noqa: E402

NORM_ORDERS = ("pre", "post")
INITS = ("xavier", "config")


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
    if not depths or any(isinstance(L, bool) or not isinstance(L, int) or L < 1 for L in depths):
        raise ValueError(f"depths must be positive ints, got {depths!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 1 <= warmup_steps <= steps:
        raise ValueError(f"warmup_steps must be an int in [1, steps={steps}], got {warmup_steps!r}")
    lrs = [float(lr) for lr in lrs]
    if not lrs or any(lr <= 0 for lr in lrs):
        raise ValueError(f"lrs must be positive learning rates, got {lrs}")
    if any(o not in NORM_ORDERS for o in orders):
        raise ValueError(f"orders must be among {NORM_ORDERS}, got {orders}")
    if isinstance(tail, bool) or not isinstance(tail, int) or not 1 <= tail <= steps:
        raise ValueError(f"tail must be an int in [1, steps={steps}], got {tail!r}")
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
