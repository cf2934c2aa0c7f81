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

from .checks import IdRange, check_count, check_id_tensor, check_id_values

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


def _check_ids(ids: Tensor, vocab_size: int | None, name: str = "ids") -> int:
    check_id_tensor(name, ids)
    if ids.size(1) < 2:
        raise ValueError(f"the probes need at least 2 positions, got T={ids.size(1)}")
    if vocab_size is None:
        vocab_size = max(int(ids.max()) + 1, 2)
    check_count("vocab_size", vocab_size, 2, why="a token must have an alternative")
    check_id_values(IdRange(name, ids, vocab_size))
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
    for i, t in enumerate(cuts):
        check_count(f"positions[{i}]", t, 0, below=T - 1, bound_name="T-1", why="something must come after them")
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
    check_count("trials", trials)
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
    vocab_size = _check_ids(labels, vocab_size, "labels")
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
