"""Argument checks shared by the library: counts, numbers, token ids and targets.

Every check raises ``ValueError`` with a message that names the argument, says what was
expected and shows what came. Two kinds:

* type, shape and dtype checks (:func:`check_int`, :func:`check_count`, :func:`check_number`,
  :func:`check_id_tensor`, :func:`check_length`, :func:`check_vectors`): plain Python on
  metadata, O(1), free to run anywhere;
* value checks that read tensor data (:func:`check_id_values`): every token id and target of
  one forward pass in one call, with one transfer to the host. They live here alone, so that
  a faster path can run them less often without hunting for them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


def _type_hint(value) -> str:
    """What to write instead of a float that holds a whole number (64 / 4 gives 16.0)."""
    return f" (write int({value!r}) or use //)" if isinstance(value, float) and value.is_integer() else ""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to us


def check_int(name: str, value, *, why: str = "", optional: bool = False) -> int | None:
    """``value`` as an int of any sign (an id, an index to skip); a bool or a float is refused.

    ``why`` says in the message what the int is for; ``optional``: None is accepted (and returned).
    """
    if _is_int(value) or (value is None and optional):
        return value
    expected = "an int" + (f" ({why})" if why else "") + (" or None" if optional else "")
    raise ValueError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}{_type_hint(value)}")


def check_count(name: str, value, minimum: int = 1, *, maximum: int | None = None, below: int | None = None,
                bound_name: str | None = None, why: str = "", optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum``; a float such as 64 / 4 or 3.0 is refused by name.

    An upper bound, when there is one: ``maximum`` (inclusive) or ``below`` (exclusive), shown
    as ``bound_name=value`` when the bound has a name (``[1, n_experts=4]``, ``[0, T=5)``).
    ``why`` says in the message what the bounds are for; ``optional``: None is accepted too
    (and returned). The message names the argument, the range expected and the value that came.
    """
    if maximum is not None and below is not None:
        raise ValueError("give check_count a maximum or a bound below, not both")
    if value is None and optional:
        return None
    if (_is_int(value) and value >= minimum and (maximum is None or value <= maximum)
            and (below is None or value < below)):
        return value
    # the message, built only when the check fails (some callers run at every decoding step)
    limit = maximum if below is None else below
    notes = [why] if why else []
    if limit is not None:
        shown = f"{bound_name}={limit}" if bound_name else f"{limit}"
        expected = f"an int in [{minimum}, {shown}{']' if below is None else ')'}"
    elif minimum in (0, 1):
        expected = "a positive int" if minimum else "a non-negative int"
        notes.insert(0, f"an int >= {minimum}")
    else:
        expected = f"an int >= {minimum}"
    expected += (f" ({'; '.join(notes)})" if notes else "") + (" or None" if optional else "")
    if not _is_int(value):
        raise ValueError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}{_type_hint(value)}")
    raise ValueError(f"{name} must be {expected}, got {value}")


def check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite real number (int or float, not bool) inside the given bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = "-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
        right = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {left}, {right}, got {value!r}")
    return float(value)


def check_id_tensor(name: str, ids, *, what: str = "token ids", shape: str = "(B, T)") -> Tensor:
    """``ids`` as an integer tensor with the rank ``shape`` names and at least one position."""
    rank = len([axis for axis in shape.strip("()").split(",") if axis.strip()])
    if not isinstance(ids, Tensor):
        raise ValueError(f"{name} must be a tensor of {what} {shape}, got {type(ids).__name__}"
                         + (" (wrap it: torch.tensor(...))" if isinstance(ids, (list, tuple)) else ""))
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer {what}, got dtype {ids.dtype} (use .long())")
    if ids.dim() != rank:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} of shape {tuple(ids.shape)} holds no {what}")
    return ids


def check_length(name: str, length: int, max_len: int, offset: int = 0) -> None:
    """Raise ValueError when ``length`` positions after ``offset`` cached ones pass ``max_len``."""
    if offset + length <= max_len:
        return
    if offset:
        raise ValueError(f"{name} has {length} new position(s) after {offset} cached ones, {offset + length} in all, "
                         f"past the model's context of max_len={max_len}; start a new cache from the last "
                         f"{max_len} tokens (generate does this)")
    raise ValueError(f"{name} has {length} positions, but the model's context is max_len={max_len} (positions "
                     f"0..{max_len - 1}); crop it to the last {max_len}: {name}[:, -{max_len}:]")


def check_vectors(name: str, x, d_model: int) -> None:
    """Raise ValueError unless ``x`` is a float tensor (B, T, d_model) (metadata only)."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.size(-1) != d_model or not x.is_floating_point():
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be float vectors of shape (B, T, d_model={d_model}), got {got}")


def check_ignore_index(ignore_index) -> int:
    """``ignore_index`` as an int (any value; -100 is PyTorch's default)."""
    return check_int("ignore_index", ignore_index, why="the target value to skip")


class IdRange(NamedTuple):
    """One tensor whose values must be ids in [0, size), or ``ignore_index`` (targets)."""

    name: str  # the argument, as the caller wrote it: "ids", "src", "targets", ...
    values: Tensor
    size: int  # vocabulary size, or number of classes
    ignore_index: int | None = None  # for targets: the value that marks "no target here"


def _out_of_range(r: IdRange) -> str:
    """The message for a range that failed (the slow path: it may read the tensor again)."""
    v = r.values
    bad = (v < 0) | (v >= r.size)
    if r.ignore_index is not None:
        bad &= v != r.ignore_index
    offending = v[bad].unique()
    first = tuple(int(i) for i in bad.nonzero()[0])
    shown = offending[:8].tolist()
    more = f" and {len(offending) - 8} more" if len(offending) > 8 else ""
    allowed = f"[0, {r.size - 1}]"
    if r.ignore_index is None:
        return (f"{r.name} must hold ids in {allowed} (size {r.size}); it holds {shown}{more}, "
                f"first at {r.name}[{', '.join(map(str, first))}]")
    return (f"{r.name} must hold class ids in {allowed} (size {r.size}) or ignore_index={r.ignore_index} "
            f"(positions without a target); it holds {shown}{more}, first at "
            f"{r.name}[{', '.join(map(str, first))}]")


def check_id_values(*ranges: IdRange) -> None:
    """Every value check on token ids and targets of one call, with one host transfer (two
    scalar reads when there is a single tensor of ids, as in a cached decoding step).

    Ids must lie in [0, size); a target may also equal its ``ignore_index``, but at least one
    target must not (else a mean over no positions gives 0 / 0 = NaN).
    """
    stats = []
    for r in ranges:
        v = r.values
        if v.numel() == 0:
            raise ValueError(f"{r.name} of shape {tuple(v.shape)} holds no values")
        if r.ignore_index is not None:
            kept = v != r.ignore_index
            stats.append(kept.any().long())
            v = v.masked_fill(~kept, 0)  # an ignored position counts as the valid id 0
        low, high = torch.aminmax(v)
        stats += [low.long(), high.long()]
    # one transfer to the host for several tensors; for one tensor (a cached decoding step) two
    # scalar reads cost less on a CPU than stacking them first
    found = [t.item() for t in stats] if len(stats) == 2 else torch.stack(stats).tolist()
    i = 0
    for r in ranges:
        if r.ignore_index is not None:
            if not found[i]:
                raise ValueError(f"every value of {r.name} equals ignore_index={r.ignore_index}: there is no "
                                 "position to compute a loss on (the mean over none is 0 / 0 = NaN)")
            i += 1
        low, high = found[i], found[i + 1]
        i += 2
        if low < 0 or high >= r.size:
            raise ValueError(_out_of_range(r))
