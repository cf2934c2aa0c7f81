"""The steps that :func:`tutorial_lib.train.train` takes on a CUDA GPU without waiting for it.

Reading a number back from the GPU (``loss.item()``, ``if not torch.isfinite(loss)``) makes
the CPU wait until the GPU has done everything queued before it; done at every step, the GPU
idles while Python prepares the next one. Here the losses and gradient norms of each step stay
on the device, the check for NaN and infinity too: once a step's loss (or, without a gradient
scaler, its gradient) is not finite, a flag on the device switches every later update off,
through the hook that fused optimizers have for ``torch.amp.GradScaler`` (torch's fused Adam,
AdamW and SGD). :func:`read_back` then fetches many steps' numbers in one transfer and finds the
first step that went wrong; the parameters are still those from before it. train() turns what
it finds into its history and its :class:`~tutorial_lib.train.NonFiniteError`, the same as
those of the step-by-step loop that runs everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn


class PendingStep(NamedTuple):
    """One optimiser step whose numbers have not been read back yet."""

    step: int  # 1-based
    losses: Tensor  # (accumulation_steps,) each micro-batch's loss
    grad_norm: Tensor  # () the global gradient norm before clipping
    grad_norms: Tensor  # (P,) the norm of each parameter's gradient, in the order of ``names``
    names: tuple[str, ...]  # the parameters that have a gradient, in the optimizer's order
    batches: list  # the micro-batches, kept to find where a NaN came from
    lr: float = 0.0
    seconds: float = 0.0


class SettledStep(NamedTuple):
    """A step read back whose numbers are finite: what the history records."""

    step: int
    loss: float  # the mean over the micro-batches
    lr: float
    grad_norm: float
    seconds: float


class Failure(NamedTuple):
    """The first step read back whose loss or gradient is not finite."""

    step: int  # 1-based
    kind: str  # "loss" or "gradient"
    loss: float  # the loss that is not finite; for a gradient, the step's (finite) loss
    micro: int | None  # the micro-batch of a loss
    batch: object  # that micro-batch (to look for where the NaN came from), None for a gradient
    parameter: str | None  # for a gradient: the first parameter, in model order, whose gradient is not finite


def reads_back_rarely(device: torch.device, optimizer: torch.optim.Optimizer, callbacks: Sequence) -> bool:
    """Whether train() keeps its numbers on the device between checks: on a CUDA GPU, with an
    optimizer that can skip an update on the device (torch's fused Adam, AdamW and SGD, which
    :func:`tutorial_lib.train.make_optimizer` builds there), and without callbacks (they read
    every step's numbers)."""
    return device.type == "cuda" and not callbacks and getattr(optimizer, "_step_supports_amp_scaling", False)


def step_unless(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """``optimizer.step()``, except where ``skip`` (a float 0-d tensor on the device) is 1: then
    the fused kernel leaves the parameters and the optimizer's state as they were. This is how
    torch.amp.GradScaler skips an overflowed step without a host sync."""
    optimizer.grad_scale, optimizer.found_inf = None, skip
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def step_on_device(loss_of: Callable[[object], Tensor], get_batch: Callable[[int], object], step: int,
                   optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], healthy: Tensor, *,
                   accumulation_steps: int, clip_norm: float | None,
                   scaler: torch.amp.GradScaler | None) -> tuple[PendingStep, Tensor]:
    """Optimiser step ``step`` (0-based) with no host sync. ``loss_of(batch)`` is the forward pass
    (with train()'s autocast and checks); ``named``: the optimizer's parameters with their names.
    Once a loss (or, without a gradient scaler, a gradient) has gone non-finite, ``healthy``
    stays False and every later update is skipped on the device, so the parameters stay as they
    were before that step until :func:`read_back` finds it."""
    optimizer.zero_grad(set_to_none=True)
    losses, batches = [], []
    for micro in range(accumulation_steps):
        batch = get_batch(step * accumulation_steps + micro)
        loss = loss_of(batch)
        loss_to_backprop = loss / accumulation_steps
        (scaler.scale(loss_to_backprop) if scaler else loss_to_backprop).backward()
        losses.append(loss.detach().float())
        batches.append(batch)
    if scaler:
        scaler.unscale_(optimizer)
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    grads = [p.grad for _, p in with_grad]
    device = healthy.device
    # the norm before clipping, as clip_grad_norm_ computes it: the norm of the per-parameter norms
    grad_norms = torch.stack(torch._foreach_norm(grads)) if grads else torch.zeros(0, device=device)
    grad_norm = torch.linalg.vector_norm(grad_norms)
    losses = torch.stack(losses)
    finite_grads = torch.isfinite(grad_norm)
    # with a scaler an overflowed gradient is a skipped step, not an error (fp16's normal business)
    healthy = healthy & torch.isfinite(losses).all() & (finite_grads if scaler is None else True)
    if clip_norm is not None and grads:
        torch._foreach_mul_(grads, (clip_norm / (grad_norm + 1e-6)).clamp(max=1.0))  # clip_grad_norm_'s scaling
    skip = ~healthy if scaler is None else ~(healthy & finite_grads)
    step_unless(optimizer, skip.float())
    if scaler:
        scaler.update()  # from the overflow check of unscale_
    names = tuple(n for n, _ in with_grad)
    return PendingStep(step + 1, losses, grad_norm, grad_norms, names, batches), healthy


def read_back(pending: list[PendingStep], model: nn.Module, *,
              scaled: bool) -> tuple[list[SettledStep], Failure | None]:
    """The pending steps' numbers, read back in one host sync (``pending`` is emptied): the
    finite steps in order, up to the first that is not finite, and that one (None if none).
    ``scaled``: training with a gradient scaler, where an overflowed gradient is no failure."""
    if not pending:
        return [], None
    try:
        rows = torch.stack([torch.cat([p.losses, p.grad_norm.float()[None]]) for p in pending]).tolist()
        settled = []
        for p, row in zip(pending, rows):
            losses, grad_norm = row[:-1], row[-1]
            bad_micro = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
            if bad_micro is not None:
                return settled, Failure(p.step, "loss", losses[bad_micro], bad_micro, p.batches[bad_micro], None)
            total = 0.0
            for value in losses:  # summed as the step-by-step loop sums, for the same float
                total += value / len(losses)
            if not scaled and not math.isfinite(grad_norm):
                norms = dict(zip(p.names, p.grad_norms.tolist()))
                model_order = (n for n, _ in model.named_parameters() if n in norms)
                bad = next((n for n in model_order if not math.isfinite(norms[n])), None)
                return settled, Failure(p.step, "gradient", total, None, None, bad)
            settled.append(SettledStep(p.step, total, p.lr, grad_norm, p.seconds))
        return settled, None
    finally:
        pending.clear()
