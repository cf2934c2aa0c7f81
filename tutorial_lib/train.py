"""Training: learning-rate schedules, AdamW with parameter groups, label-smoothed loss, and
one small training loop (progress bar, gradient clipping with the norm logged, gradient
accumulation, mixed precision, callbacks, a stop on non-finite values)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---- schedules: plain functions of the step, for torch.optim.lr_scheduler.LambdaLR ------------


def inverse_sqrt_schedule(warmup_steps: int) -> Callable[[int], float]:
    """The schedule of Vaswani et al. (2017), eq. 3, as a multiplier of the peak rate:
    linear warmup to 1 over ``warmup_steps``, then decay like sqrt(warmup / step).

    The paper's lrate = d^-0.5 * min(step^-0.5, step * warmup^-1.5) is this multiplier times
    the peak d^-0.5 * warmup^-0.5 (steps counted from 1).
    """
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")

    def multiplier(step: int) -> float:
        s = step + 1  # LambdaLR counts from 0
        return min(s / warmup_steps, math.sqrt(warmup_steps / s))

    return multiplier


def warmup_cosine_schedule(warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup to 1, then a cosine decay to ``min_ratio`` at ``total_steps`` (held after)."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio}")

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def constant_schedule(warmup_steps: int = 0) -> Callable[[int], float]:
    """Linear warmup (if any) to 1, then constant."""
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


# ---- optimiser --------------------------------------------------------------------------------


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices (Linear weights), none on norms, biases and
    embeddings. Tied parameters appear once."""
    decay, no_decay, seen = [], [], set()
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_weights else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, *, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-9) -> torch.optim.AdamW:
    """AdamW with :func:`param_groups`; betas (0.9, 0.98) and eps 1e-9 as in the original paper."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


# ---- loss ---------------------------------------------------------------------------------------


def label_smoothed_loss(logits: Tensor, targets: Tensor, smoothing: float = 0.0,
                        ignore_index: int = -100) -> Tensor:
    """Cross-entropy against (1 - smoothing) on the target plus smoothing spread uniformly over
    all V classes, averaged over positions whose target is not ``ignore_index``.

    logits: (..., V); targets: (...). Equal to ``F.cross_entropy(..., label_smoothing=...)``.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    logp = F.log_softmax(logits.float(), dim=-1).flatten(0, -2)  # (N, V)
    flat = targets.flatten()
    keep = flat != ignore_index
    if not keep.any():
        raise ValueError("every target equals ignore_index: there is nothing to learn from")
    logp, flat = logp[keep], flat[keep]
    nll = -logp.gather(1, flat[:, None]).squeeze(1)  # (N,)
    uniform = -logp.mean(dim=-1)  # (N,)
    return ((1 - smoothing) * nll + smoothing * uniform).mean()


# ---- precision ---------------------------------------------------------------------------------


def autocast_context(precision: str, device: torch.device):
    """Context manager for the forward pass: fp32 (nothing), bf16 (CPU or CUDA), or fp16 (CUDA
    only). Raises ValueError, saying why, where the device cannot do it."""
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


# ---- the loop ---------------------------------------------------------------------------------


class NonFiniteError(RuntimeError):
    """Training produced a NaN or infinity; the message says where and what to check."""


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
    grad_norm: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_value: list[float] = field(default_factory=list)
    stopped_early: bool = False


def _first_non_finite_grad(model: nn.Module) -> str | None:
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return name
    return None


def default_loss(model: nn.Module, batch) -> Tensor:
    """model(*batch).loss: the batch holds the model's inputs and targets."""
    return model(*batch).loss


def train(model: nn.Module, get_batch: Callable[[int], tuple], steps: int, *,
          optimizer: torch.optim.Optimizer, schedule: Callable[[int], float] | None = None,
          compute_loss: Callable[[nn.Module, tuple], Tensor] = default_loss, clip_norm: float | None = 1.0,
          accumulation_steps: int = 1, precision: str = "fp32",
          callbacks: Iterable[Callable[[StepInfo], None]] = (),
          evaluate: Callable[[nn.Module], float] | None = None, eval_every: int | None = None,
          time_budget: float | None = None, history: History | None = None, start_step: int = 0,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          progress: bool = True, desc: str = "training") -> History:
    """Train ``model`` for ``steps`` optimiser steps (or until ``time_budget`` seconds).

    get_batch(i) returns the i-th micro-batch (a tuple on the model's device);
    compute_loss(model, batch) returns the loss (default: ``model(*batch).loss``). Each
    optimiser step averages ``accumulation_steps`` micro-batches, clips the global gradient
    norm to ``clip_norm`` (the norm before clipping is logged), and advances the schedule
    (``schedule`` as a LambdaLR multiplier, or a ready ``scheduler``). A NaN or infinite loss or
    gradient stops training with :class:`NonFiniteError`. ``evaluate(model)`` runs every
    ``eval_every`` steps and at the end, in eval mode. Resume with ``history`` and ``start_step``.
    """
    from tqdm.auto import tqdm

    if steps < 0 or accumulation_steps < 1:
        raise ValueError(f"need steps >= 0 and accumulation_steps >= 1, got {steps}, {accumulation_steps}")
    if schedule is not None and scheduler is not None:
        raise ValueError("give a schedule function or a scheduler, not both")
    device = next(model.parameters()).device
    autocast_context(precision, device)  # raises now, not mid-run, if the device cannot do it
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    if schedule is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    history = History() if history is None else history
    callbacks = list(callbacks)
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc=desc, disable=not progress, leave=False)
    step = start_step
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accumulation_steps):
            batch = get_batch(step * accumulation_steps + micro)
            with autocast_context(precision, device):
                loss = compute_loss(model, batch)
            if not torch.isfinite(loss):
                raise NonFiniteError(
                    f"the loss is {loss.item()} at step {step + 1} (micro-batch {micro}). Check the learning "
                    "rate (too high?), the inputs (NaN in the data?), masks that leave a row with no key, "
                    "and, with fp16, overflow (use bf16 or a gradient scaler)")
            loss_to_backprop = loss / accumulation_steps
            (scaler.scale(loss_to_backprop) if scaler else loss_to_backprop).backward()
            total += loss.item() / accumulation_steps
        if scaler:
            scaler.unscale_(optimizer)
        bad = _first_non_finite_grad(model)
        if bad is not None and scaler is None:
            raise NonFiniteError(
                f"the gradient of {bad!r} is not finite at step {step + 1} (the loss was {total:.4g}). "
                "Check the learning rate, gradient clipping, and operations that can overflow "
                "(exp, division by a norm close to 0)")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if clip_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
        else:
            grad_norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.detach().norm() for p in params if p.grad is not None])))
        lr = optimizer.param_groups[0]["lr"]
        if scaler:
            scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
            scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        seconds = time.perf_counter() - start
        history.step.append(step + 1)
        history.loss.append(total)
        history.lr.append(lr)
        history.grad_norm.append(grad_norm)
        history.seconds.append(seconds)
        bar.set_postfix(loss=f"{total:.3f}", lr=f"{lr:.2e}")
        if evaluate is not None and eval_every and (step + 1) % eval_every == 0:
            _evaluate(model, evaluate, history, step + 1)
        info = StepInfo(step + 1, total, lr, grad_norm, seconds, model, history)
        for callback in callbacks:
            callback(info)
        if time_budget is not None and seconds >= time_budget:
            history.stopped_early = step + 1 < steps
            break
    bar.close()
    last = history.step[-1] if history.step else 0
    if evaluate is not None and (not history.eval_step or history.eval_step[-1] != last):
        _evaluate(model, evaluate, history, last)
    return history


def _evaluate(model: nn.Module, evaluate: Callable[[nn.Module], float], history: History, step: int) -> None:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        value = float(evaluate(model))
    model.train(was_training)
    history.eval_step.append(step)
    history.eval_value.append(value)
