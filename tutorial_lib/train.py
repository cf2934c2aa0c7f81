"""Training: learning-rate schedules, AdamW with parameter groups, label-smoothed loss, and
one small training loop (progress bar, gradient clipping with the norm logged, gradient
accumulation, mixed precision, callbacks, a stop on non-finite values that says where).

On a CUDA GPU the loop does not wait for the GPU at every step: its steps there are
:mod:`tutorial_lib.gpu_loop`'s. Checkpoints that resume a run exactly live in
:mod:`tutorial_lib.checkpoint`; data-parallel training in :mod:`tutorial_lib.ddp`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import gpu_loop
from .checks import IdRange, check_count, check_id_values, check_ignore_index, check_number

# ---- schedules: plain functions of the step, for torch.optim.lr_scheduler.LambdaLR ------------


def inverse_sqrt_schedule(warmup_steps: int) -> Callable[[int], float]:
    """The schedule of Vaswani et al. (2017), eq. 3, as a multiplier of the peak rate:
    linear warmup to 1 over ``warmup_steps``, then decay like sqrt(warmup / step).

    The paper's lrate = d^-0.5 * min(step^-0.5, step * warmup^-1.5) is this multiplier times
    the peak d^-0.5 * warmup^-0.5 (steps counted from 1).
    """
    check_count("warmup_steps", warmup_steps)

    def multiplier(step: int) -> float:
        s = step + 1  # LambdaLR counts from 0
        return min(s / warmup_steps, math.sqrt(warmup_steps / s))

    return multiplier


def warmup_cosine_schedule(warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup to 1, then a cosine decay to ``min_ratio`` at ``total_steps`` (held after)."""
    check_count("warmup_steps", warmup_steps, 0)
    check_count("total_steps", total_steps)
    if not warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}")
    check_number("min_ratio", min_ratio, low=0.0, high=1.0)

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def constant_schedule(warmup_steps: int = 0) -> Callable[[int], float]:
    """Linear warmup (if any) to 1, then constant."""
    check_count("warmup_steps", warmup_steps, 0)
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


# ---- optimiser --------------------------------------------------------------------------------


def param_group_names(model: nn.Module) -> dict[str, list[str]]:
    """Which parameters get weight decay: ``{"decay": [...], "no_decay": [...]}`` by name.

    Decay: matrices (every parameter with 2 or more dimensions) except embedding tables.
    No decay: norms' scales and shifts, biases (1-D), and embeddings. A tied parameter (one
    tensor under two names, e.g. the token table and the output head) is listed once, under
    the first name ``named_parameters`` gives it. Frozen parameters are left out.
    """
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names: dict[str, list[str]] = {"decay": [], "no_decay": []}
    for name, p in model.named_parameters():  # yields a shared tensor once
        if not p.requires_grad:
            continue
        decays = p.dim() >= 2 and id(p) not in embedding_weights
        names["decay" if decays else "no_decay"].append(name)
    return names


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices (Linear weights), none on norms, biases and
    embeddings (see :func:`param_group_names`). Tied parameters appear once."""
    check_number("weight_decay", weight_decay, low=0.0)
    params = dict(model.named_parameters())
    names = param_group_names(model)
    return [{"params": [params[n] for n in names["decay"]], "weight_decay": weight_decay},
            {"params": [params[n] for n in names["no_decay"]], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, *, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-9) -> torch.optim.AdamW:
    """AdamW with :func:`param_groups`; betas (0.9, 0.98) and eps 1e-9 as in the original paper.

    On a CUDA GPU it is torch's fused AdamW (one kernel for all parameters), which can also skip
    an update on the GPU without asking the host: :func:`train` uses that to check for NaN only
    every ``sync_every`` steps. On a CPU it is the default implementation (the committed
    notebooks' numbers)."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be positive, got {lr!r}")
    fused = True if next(model.parameters()).device.type == "cuda" else None
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)


# ---- loss ---------------------------------------------------------------------------------------


def label_smoothed_loss(logits: Tensor, targets: Tensor, smoothing: float = 0.0,
                        ignore_index: int = -100) -> Tensor:
    """Cross-entropy against (1 - smoothing) on the target plus smoothing spread uniformly over
    all V classes, averaged over positions whose target is not ``ignore_index``.

    logits: (..., V); targets: (...). Equal to ``F.cross_entropy(..., label_smoothing=...)``.
    """
    check_number("smoothing", smoothing, low=0.0, high=1.0, high_open=True)
    if not isinstance(logits, Tensor) or logits.dim() < 2 or not logits.is_floating_point():
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a float tensor (..., V), got {got}")
    if not isinstance(targets, Tensor) or logits.shape[:-1] != targets.shape:
        got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"logits {tuple(logits.shape)} and targets {got} do not match: targets must have the "
                         "logits' shape without the last (class) axis")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got dtype {targets.dtype}")
    check_id_values(IdRange("targets", targets, logits.size(-1), check_ignore_index(ignore_index)))
    logp = F.log_softmax(logits.float(), dim=-1).flatten(0, -2)  # (N, V)
    flat = targets.flatten()
    keep = flat != ignore_index
    logp, flat = logp[keep], flat[keep]
    nll = -logp.gather(1, flat[:, None]).squeeze(1)  # (N,)
    uniform = -logp.mean(dim=-1)  # (N,)
    return ((1 - smoothing) * nll + smoothing * uniform).mean()


# ---- precision ---------------------------------------------------------------------------------


def autocast_context(precision: str, device: torch.device):
    """Context manager for the forward pass: fp32 (nothing), bf16 (CPU or CUDA), or fp16 (CUDA
    only). Raises ValueError, saying why, where the device cannot do it."""
    device = torch.device(device)
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("bf16 was asked for, but this GPU does not support it; use fp16 or fp32")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"bf16 autocast is supported here on cpu and cuda, not {device.type}")
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type != "cuda":
            raise ValueError(f"fp16 training needs a CUDA GPU (with a gradient scaler); this is {device.type}. "
                             "Use bf16 or fp32 on the CPU")
        return torch.autocast("cuda", dtype=torch.float16)
    raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")


def _gradient_scaler(precision: str, scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
    """The loss scaler fp16 training needs (``scaler`` if one is passed in), None otherwise."""
    if scaler is not None and precision != "fp16":
        raise ValueError(f"a gradient scaler belongs to fp16 training; precision is {precision!r}")
    if precision == "fp16" and scaler is None:
        scaler = torch.amp.GradScaler("cuda")
    return scaler


# ---- the loop ---------------------------------------------------------------------------------


class NonFiniteError(RuntimeError):
    """Training produced a NaN or infinity. The message says where and what to check; the same
    facts are attributes: ``step`` (1-based), ``kind`` ("loss" or "gradient") and ``where``
    (the module whose output, or the parameter whose gradient, first went non-finite; None when
    no single place could be named)."""

    def __init__(self, message: str, *, step: int | None = None, kind: str | None = None,
                 where: str | None = None):
        super().__init__(message)
        self.step, self.kind, self.where = step, kind, where


@dataclass
class StepInfo:
    """What a callback sees after every optimiser step."""

    step: int  # 1-based, counts optimiser steps
    loss: float
    lr: float
    grad_norm: float
    seconds: float  # since the start of training
    model: nn.Module
    history: History


@dataclass
class History:
    """Everything the loop measured, one entry per optimiser step (evaluations when made)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)  # global norm before clipping
    seconds: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_value: list[float] = field(default_factory=list)
    stopped_early: bool = False

    def as_dict(self) -> dict:
        """Plain lists and a bool (for a checkpoint or JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> History:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown History fields {unknown}; known fields are {sorted(known)}")
        return cls(**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()})


def default_loss(model: nn.Module, batch) -> Tensor:
    """model(*batch).loss: the batch holds the model's inputs and targets."""
    return model(*batch).loss


def loss_with_aux(coefficient: float) -> Callable[[nn.Module, tuple], Tensor]:
    """A ``compute_loss`` for :func:`train`: the model's loss plus ``coefficient`` times its
    ``aux_loss`` (a mixture of experts' load-balancing loss; Switch Transformer used 0.01,
    Mixtral's config.json says 0.02). A model whose aux_loss is None trains on its loss alone."""
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or coefficient < 0:
        raise ValueError(f"coefficient must be a number >= 0, got {coefficient!r}")

    def compute_loss(model: nn.Module, batch) -> Tensor:
        out = model(*batch)
        return out.loss if out.aux_loss is None else out.loss + coefficient * out.aux_loss

    return compute_loss


# ---- finding where a NaN or infinity appeared ----------------------------------------------------

_LOSS_CHECKS = ("Check, in this order: the data (a NaN or infinity in the inputs?), the targets (a batch whose "
                "targets all equal ignore_index gives 0/0 = NaN), masks (a query row with no allowed key), "
                "the learning rate (too high, or no warmup: look at history.grad_norm before this step), "
                "and with fp16 an overflow past 65504 (use bf16, or fp16 with the gradient scaler)")
_GRAD_CHECKS = ("The loss was finite, so the backward pass overflowed. Check the learning rate and warmup "
                "(history.grad_norm shows whether the norm was growing), gradient clipping (clip_norm), and "
                "operations whose gradient blows up near a point: division by a norm close to 0, sqrt or log "
                "near 0, exp of a large number")


def _tensors_in(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _is_finite(value) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors_in(value) if t.is_floating_point())


def _first_non_finite_grad(model: nn.Module) -> str | None:
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return name
    return None


def _first_non_finite_output(model: nn.Module, compute_loss, batch, precision: str, device) -> str | None:
    """Run the forward pass again with a hook on every module; return the name of the first
    module (in the order they finish) whose output holds a NaN or infinity. Hooks are removed
    and the random state restored before returning."""
    found: list[str] = []

    def hook(name):
        def check(module, inputs, output):
            if not found and not _is_finite(output):
                found.append(name)
        return check

    # the model itself is left out when it has parts: its output holds the loss, which tells nothing new
    modules = [(n, m) for n, m in model.named_modules() if n or not any(True for _ in model.children())]
    handles = [m.register_forward_hook(hook(name or "(the whole model)")) for name, m in modules]
    try:
        gpus = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus), torch.no_grad(), autocast_context(precision, device):
            compute_loss(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _diagnose_loss(model, compute_loss, batch, precision, device) -> tuple[str | None, str]:
    """Where a non-finite loss came from: (module name or None, a sentence saying so)."""
    bad_param = next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad_param is not None:
        return bad_param, f"The parameter {bad_param!r} itself already holds a NaN or infinity."
    if not _is_finite(batch):
        return None, "The batch itself holds a NaN or infinity: the data is broken, not the model."
    module = _first_non_finite_output(model, compute_loss, batch, precision, device)
    if module is not None:
        return module, f"The first module whose output went non-finite is {module!r}."
    return None, ("Every module's output was finite, so the loss computation itself made it (all targets "
                  "ignored? a log of 0?) or the model's own forward code outside its modules.")


def _check_loss(loss, compute_loss) -> None:
    """The loss must be one number with a gradient (metadata only: no host sync)."""
    if loss is None:
        raise ValueError("compute_loss returned None: with the default loss, model(*batch).loss is None when the "
                         "batch holds no targets; get_batch(i) must return (inputs, targets)")
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"compute_loss ({getattr(compute_loss, '__name__', compute_loss)}) must return the loss as "
                         f"a scalar tensor, got {got}; average it (.mean())")
    if not loss.requires_grad:
        raise ValueError("the loss has no gradient: it was computed without autograd (torch.no_grad? .detach()? "
                         ".item()?), so backward() cannot train the model")


# ---- the loop itself ------------------------------------------------------------------------------


def train(model: nn.Module, get_batch: Callable[[int], tuple], steps: int, *,
          optimizer: torch.optim.Optimizer, schedule: Callable[[int], float] | None = None,
          compute_loss: Callable[[nn.Module, tuple], Tensor] = default_loss, clip_norm: float | None = 1.0,
          accumulation_steps: int = 1, precision: str = "fp32",
          callbacks: Iterable[Callable[[StepInfo], None]] = (),
          evaluate: Callable[[nn.Module], float] | None = None, eval_every: int | None = None,
          time_budget: float | None = None, history: History | None = None, start_step: int = 0,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          progress: bool = True, desc: str = "training",
          scaler: torch.amp.GradScaler | None = None, sync_every: int = 50) -> History:
    """Train ``model`` up to optimiser step ``steps`` (or until ``time_budget`` seconds).

    get_batch(i) returns the i-th micro-batch (a tuple on the model's device);
    compute_loss(model, batch) returns the loss (default: ``model(*batch).loss``). Each
    optimiser step averages ``accumulation_steps`` micro-batches, clips the global gradient
    norm to ``clip_norm`` (the norm before clipping is logged), and advances the schedule
    (``schedule`` as a LambdaLR multiplier, or a ready ``scheduler``). A NaN or infinite loss or
    gradient stops training with :class:`NonFiniteError`, which names the step and the module
    or parameter. ``evaluate(model)`` runs every ``eval_every`` steps and at the end, in eval
    mode. Callbacks get a :class:`StepInfo` after every optimiser step.

    Resuming: pass ``start_step`` (steps already done; the run continues to ``steps`` in total)
    and the earlier ``history``. A ``schedule`` then continues from ``start_step``; a
    ``scheduler`` must have been restored by the caller (``tutorial_lib.checkpoint``). With
    fp16 a ``scaler`` (``torch.amp.GradScaler``) may be passed in so that its state can be saved.

    Accumulation divides each micro-batch's loss by ``accumulation_steps`` before ``backward()``.
    With a loss that is a mean over non-ignored targets (the default), the accumulated gradient
    equals the gradient of one batch of all the step's micro-batches only when every micro-batch
    has the same number of non-ignored targets: true for fixed-length language-model windows,
    not for padded batches, where a target in a sparse micro-batch weighs more. Exact in every
    case: each micro-batch's *summed* loss divided by the number of non-ignored targets of the
    whole step, i.e. a compute_loss that returns ``summed_loss * accumulation_steps / step_count``
    (notebook 08a, section 4, shows the difference and the fix).

    On a CUDA GPU, with an optimizer that can skip an update on the device (torch's fused AdamW,
    which :func:`make_optimizer` builds there) and no callbacks, the loop does not wait for the
    GPU at every step: the losses and gradient norms stay on the device and are read back every
    ``sync_every`` steps, before an evaluation and at the end (until then the history and the
    progress bar lag behind, and ``history.seconds`` is the time each step was queued). The
    first step whose loss or gradient is not finite switches every later update off on the
    device, so when the numbers are read back the model is as it was before that step, and the
    :class:`NonFiniteError` names the same step, module or parameter as the step-by-step loop
    that runs everywhere else (on a CPU a read-back costs nothing).
    """
    from tqdm.auto import tqdm

    check_count("steps", steps, 0)
    check_count("accumulation_steps", accumulation_steps)
    check_count("start_step", start_step, 0)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (e.g. make_optimizer(model, lr=3e-4)), "
                         f"got {type(optimizer).__name__}")
    if not callable(get_batch):
        raise ValueError(f"get_batch must be a function of the step, get_batch(i) -> batch, got {get_batch!r:.60}")
    if start_step > steps:
        raise ValueError(f"need start_step <= steps (steps counts every step, the resumed ones included), got "
                         f"start_step={start_step}, steps={steps}")
    if clip_norm is not None and clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive or None (no clipping), got {clip_norm}")
    if schedule is not None and scheduler is not None:
        raise ValueError("give a schedule function or a scheduler, not both")
    check_count("sync_every", sync_every, why="steps between read-backs on a GPU")
    check_count("eval_every", eval_every, optional=True)
    device = next(model.parameters()).device
    autocast_context(precision, device)  # raises now, not mid-run, if the device cannot do it
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not parameters of this model, so "
                         "training would not change the model: was it built for another copy? (copy a model and "
                         "its optimizer together: copy.deepcopy((model, optimizer)))")
    scaler = _gradient_scaler(precision, scaler)
    if schedule is not None:
        for group in optimizer.param_groups:  # the peak rate the multiplier scales
            group.setdefault("initial_lr", group["lr"])
        # last_epoch = start_step - 1: a resumed run continues the schedule where it stopped
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule, last_epoch=start_step - 1)
    history = History() if history is None else history
    callbacks = list(callbacks)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = math.inf if clip_norm is None else clip_norm  # inf: measure the norm, scale by 1
    time_offset = history.seconds[-1] if history.seconds else 0.0
    deferred = gpu_loop.reads_back_rarely(device, optimizer, callbacks)
    if deferred:
        name_of = {id(p): n for n, p in model.named_parameters()}
        named = [(name_of[id(p)], p) for p in params]  # the optimizer's order, as clip_grad_norm_ sums
        pending: list[gpu_loop.PendingStep] = []  # steps whose numbers are still on the GPU
        healthy = torch.ones((), dtype=torch.bool, device=device)  # False from the first non-finite step on
    context = _Context(model, compute_loss, precision, device, accumulation_steps, scaler, history)

    def loss_of(batch) -> Tensor:
        with autocast_context(precision, device):
            loss = compute_loss(model, batch)
        _check_loss(loss, compute_loss)  # metadata only: no host sync
        return loss

    model.train()
    start = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc=desc, disable=not progress, leave=True)
    try:
        for step in bar:
            if deferred:
                done, healthy = gpu_loop.step_on_device(loss_of, get_batch, step, optimizer, named, healthy,
                                                        accumulation_steps=accumulation_steps, clip_norm=clip_norm,
                                                        scaler=scaler)
                lr, grad_norm = optimizer.param_groups[0]["lr"], None
            else:
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for micro in range(accumulation_steps):
                    batch = get_batch(step * accumulation_steps + micro)
                    loss = loss_of(batch)
                    if not torch.isfinite(loss):
                        raise _loss_error(context, batch, loss.item(), step + 1, micro)
                    # equal to the big batch's gradient only with equal target counts per micro-batch
                    loss_to_backprop = loss / accumulation_steps
                    (scaler.scale(loss_to_backprop) if scaler else loss_to_backprop).backward()
                    total += loss.item() / accumulation_steps
                if scaler:
                    scaler.unscale_(optimizer)
                try:
                    # returns the norm before clipping; with error_if_nonfinite it raises before scaling
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm,
                                                                     error_if_nonfinite=scaler is None))
                except RuntimeError as err:
                    if "non-finite" not in str(err):
                        raise
                    raise _gradient_error(history, _first_non_finite_grad(model), total, step + 1) from None
                lr = optimizer.param_groups[0]["lr"]
                if scaler:
                    scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
                    scaler.update()
                else:
                    optimizer.step()
            if scheduler is not None:
                scheduler.step()
            seconds = time_offset + time.perf_counter() - start
            if deferred:
                pending.append(done._replace(lr=lr, seconds=seconds))
                evaluating = evaluate is not None and eval_every and (step + 1) % eval_every == 0
                out_of_time = time_budget is not None and seconds - time_offset >= time_budget
                if evaluating or out_of_time or len(pending) >= sync_every:
                    _settle(context, pending, bar)
            else:
                history.step.append(step + 1)
                history.loss.append(total)
                history.lr.append(lr)
                history.grad_norm.append(grad_norm)
                history.seconds.append(seconds)
                bar.set_postfix(loss=f"{total:.3f}", lr=f"{lr:.2e}")
            if evaluate is not None and eval_every and (step + 1) % eval_every == 0:
                _evaluate(model, evaluate, history, step + 1)
            if callbacks:
                info = StepInfo(step + 1, total, lr, grad_norm, seconds, model, history)
                for callback in callbacks:
                    callback(info)
            if time_budget is not None and seconds - time_offset >= time_budget:
                history.stopped_early = step + 1 < steps
                break
        if deferred:
            _settle(context, pending, bar)
    except BaseException:
        if deferred and pending:  # stopped by something else (an interrupt?): keep the finite steps
            with contextlib.suppress(Exception):
                _settle(context, pending, bar, quiet=True)
        raise
    finally:
        bar.close()
    last = history.step[-1] if history.step else 0
    if evaluate is not None and (not history.eval_step or history.eval_step[-1] != last):
        _evaluate(model, evaluate, history, last)
    return history


# ---- what the two loops share: the run's context, and what the GPU loop read back -----------------


class _Context(NamedTuple):
    """What the error messages and the read-back of the GPU loop need from one call of :func:`train`."""

    model: nn.Module
    compute_loss: Callable
    precision: str
    device: torch.device
    accumulation_steps: int
    scaler: torch.amp.GradScaler | None
    history: History


def _settle(ctx: _Context, pending: list[gpu_loop.PendingStep], bar, *, quiet: bool = False) -> None:
    """Read the GPU loop's pending steps back (one host sync) into the history, in order, and raise
    :class:`NonFiniteError` at the first step that went non-finite (``quiet``: stop there instead)."""
    settled, failure = gpu_loop.read_back(pending, ctx.model, scaled=ctx.scaler is not None)
    history = ctx.history
    for done in settled:
        history.step.append(done.step)
        history.loss.append(done.loss)
        history.lr.append(done.lr)
        history.grad_norm.append(done.grad_norm)
        history.seconds.append(done.seconds)
        bar.set_postfix(loss=f"{done.loss:.3f}", lr=f"{done.lr:.2e}")
    if failure is None or quiet:
        return
    if failure.kind == "loss":
        raise _loss_error(ctx, failure.batch, failure.loss, failure.step, failure.micro)
    raise _gradient_error(history, failure.parameter, failure.loss, failure.step)


def _loss_error(ctx: _Context, batch, value: float, step: int, micro: int) -> NonFiniteError:
    where, finding = _diagnose_loss(ctx.model, ctx.compute_loss, batch, ctx.precision, ctx.device)
    return NonFiniteError(f"the loss is {value} at step {step} (micro-batch {micro}). {finding} {_LOSS_CHECKS}",
                          step=step, kind="loss", where=where)


def _gradient_error(history: History, bad: str | None, total: float, step: int) -> NonFiniteError:
    place = (f"the gradient of {bad!r} is the first (in model order) that holds a NaN or infinity"
             if bad else "every gradient is finite but their global norm overflowed float32")
    recent = ", ".join(f"{g:.3g}" for g in history.grad_norm[-5:]) or "none yet"
    return NonFiniteError(f"a gradient is not finite at step {step}: {place}. The loss was {total:.4g}; the "
                          f"last gradient norms were [{recent}]. {_GRAD_CHECKS}", step=step, kind="gradient", where=bad)


def _evaluate(model: nn.Module, evaluate: Callable[[nn.Module], float], history: History, step: int) -> None:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        value = float(evaluate(model))
    model.train(was_training)
    history.eval_step.append(step)
    history.eval_value.append(value)
