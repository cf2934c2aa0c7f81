"""Scoring attention heads by where they look, on sequences built to tell kinds of heads apart.

A **previous-token head** sends most of each position's attention to the position just
before it. An **induction head** (Olsson et al., 2022, "In-context Learning and Induction
Heads") completes patterns: at a token that occurred before, it attends to the token that
*followed* the earlier occurrence, so that the model can copy it. On a random sequence of
``period`` tokens repeated, the token after the earlier occurrence of position t (t >= period)
sits at t - period + 1; a random sequence has no other structure to exploit, so attention
there is the mark of induction.

Scores are mean attention weights, so they lie in [0, 1]: 1 means all of the attention of
every scored position goes to the scored key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_count


def repeated_random_tokens(vocab_size: int, period: int, *, repeats: int = 2, batch: int = 1, low: int = 0,
                           generator: torch.Generator | None = None) -> Tensor:
    """(batch, period * repeats) ids: one random sequence of ``period`` distinct ids in
    [low, vocab_size), repeated ``repeats`` times (a different sequence for each row).

    The ids of one sequence are drawn without replacement, so that every token of a later copy
    has exactly one earlier occurrence in each copy before it, and "the token that followed its
    earlier occurrence" names one position."""
    for name, value in (("vocab_size", vocab_size), ("period", period), ("repeats", repeats), ("batch", batch)):
        check_count(name, value)
    check_count("low", low, 0, below=vocab_size, bound_name="vocab_size")
    if period > vocab_size - low:
        raise ValueError(f"period must be at most the {vocab_size - low} ids in [low={low}, vocab_size={vocab_size}) "
                         f"to draw them without repeats, got {period}")
    # a random permutation of the allowed ids per row, cut to its first `period`
    order = torch.rand(batch, vocab_size - low, generator=generator).argsort(dim=1)
    block = order[:, :period] + low  # (batch, period)
    return block.repeat(1, repeats)  # (batch, period * repeats)


def _check_square(weights: Tensor) -> int:
    if not isinstance(weights, Tensor) or weights.dim() < 2 or weights.size(-1) != weights.size(-2):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be self-attention weights (..., T, T), got {shape}")
    return weights.size(-1)


def offset_scores(weights: Tensor, offset: int, start: int) -> Tensor:
    """(..., T, T) weights -> (...): the mean over query positions t >= start of the weight
    on key t - offset."""
    T = _check_square(weights)
    if not 0 <= offset <= start < T:
        raise ValueError(f"need 0 <= offset ({offset}) <= start ({start}) < T ({T})")
    rows = torch.arange(start, T, device=weights.device)
    return weights[..., rows, rows - offset].float().mean(dim=-1)


def previous_token_scores(weights: Tensor) -> Tensor:
    """(..., T, T) -> (...): mean attention from each position t >= 1 to position t - 1."""
    return offset_scores(weights, 1, 1)


def induction_scores(weights: Tensor, period: int) -> Tensor:
    """(..., T, T) -> (...) for a sequence that repeats with ``period``: mean attention from
    each position t >= period of the repeats to position t - period + 1, the token that
    followed the earlier occurrence of token t."""
    T = _check_square(weights)
    check_count("period", period, below=T, bound_name="T")
    return offset_scores(weights, period - 1, period)
