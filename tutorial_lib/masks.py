"""Attention masks: building them, combining them, converting between conventions.

Convention inside tutorial_lib: a mask is a boolean tensor, ``True`` = this query may attend
to this key, broadcastable to (B, h, T, S). That is the convention of
``torch.nn.functional.scaled_dot_product_attention``. ``torch.nn.MultiheadAttention`` and
``torch.nn.Transformer*`` use the opposite (``True`` = blocked); convert at that boundary
with :func:`to_blocked` / :func:`from_blocked`, never by hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_count


def _check_bool_mask(name: str, mask) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a boolean tensor (True = may attend), got {got}")
    return mask


def causal_mask(T: int, S: int | None = None, *, device=None) -> Tensor:
    """Lower-triangular (T, S) mask: query i may see keys up to its own position.

    With S > T (decoding with S - T keys already cached) the queries are the *last* T
    positions, so this is the last T rows of the S x S causal mask.
    """
    check_count("T", T)
    S = T if S is None else check_count("S", S)
    if S < T:
        raise ValueError(f"a causal mask needs S >= T (queries are the last T keys), got T={T}, S={S}")
    rows = torch.arange(T, device=device).unsqueeze(1) + (S - T)  # absolute query positions
    cols = torch.arange(S, device=device).unsqueeze(0)
    return cols <= rows  # (T, S)


def padding_mask(lengths_or_ids: Tensor, S: int | None = None, pad_id: int | None = None) -> Tensor:
    """Key-padding mask of shape (B, 1, 1, S): True at real tokens, False at padding.

    Give either the lengths, shape (B,), with ``S`` the padded length, or token ids, shape
    (B, S), together with ``pad_id``.
    """
    x = torch.as_tensor(lengths_or_ids)
    if pad_id is not None:
        if x.dim() != 2:
            raise ValueError(f"with pad_id, expected ids of shape (B, S), got shape {tuple(x.shape)}")
        if S is not None and S != x.size(1):
            raise ValueError(f"S={S} does not match the ids' length {x.size(1)}")
        keep = x != pad_id  # (B, S)
    else:
        if x.dim() != 1 or x.dtype in (torch.bool,) or x.is_floating_point():
            raise ValueError(
                "expected integer lengths of shape (B,) (or ids of shape (B, S) with pad_id), "
                f"got dtype {x.dtype} and shape {tuple(x.shape)}"
            )
        if S is None:
            S = int(x.max())
        check_count("S", S)
        if (x < 0).any() or (x > S).any():
            raise ValueError(f"lengths must lie in [0, S={S}], got {x.tolist()}")
        keep = torch.arange(S, device=x.device).unsqueeze(0) < x.unsqueeze(1)  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


def cross_mask(target_keep: Tensor, source_keep: Tensor) -> Tensor:
    """Cross-attention mask (B, 1, T, S) from target (B, T) and source (B, S) keep flags.

    A padded source position is never a key; a padded target query sees nothing (its row
    is all False, so attention returns zeros there, and the loss ignores it anyway).
    """
    for name, keep in (("target_keep", target_keep), ("source_keep", source_keep)):
        if not isinstance(keep, Tensor) or keep.is_floating_point():
            got = f"dtype {keep.dtype}" if isinstance(keep, Tensor) else type(keep).__name__
            raise ValueError(f"{name} must hold boolean keep flags (True = real token), got {got}")
    if target_keep.dim() != 2 or source_keep.dim() != 2:
        raise ValueError(
            "expected target_keep (B, T) and source_keep (B, S), "
            f"got shapes {tuple(target_keep.shape)} and {tuple(source_keep.shape)}"
        )
    if target_keep.size(0) != source_keep.size(0):
        raise ValueError(f"batch sizes differ: {target_keep.size(0)} vs {source_keep.size(0)}")
    t, s = target_keep.bool(), source_keep.bool()
    return (t[:, :, None] & s[:, None, :]).unsqueeze(1)  # (B, 1, T, S)


def prefix_lm_mask(prefix_len: int | Tensor, T: int, *, device=None) -> Tensor:
    """Prefix-LM mask: full visibility inside the prefix, causal after it.

    ``prefix_len`` an int gives (T, T); a tensor of per-example lengths (B,) gives (B, 1, T, T).
    """
    check_count("T", T)
    causal = causal_mask(T, device=device)
    cols = torch.arange(T, device=device)
    if isinstance(prefix_len, Tensor):
        if prefix_len.dim() != 1 or prefix_len.is_floating_point() or prefix_len.dtype == torch.bool:
            raise ValueError(f"prefix_len as a tensor must hold integer lengths of shape (B,), got {prefix_len.dtype} "
                             f"{tuple(prefix_len.shape)}")
        if (prefix_len < 0).any() or (prefix_len > T).any():
            raise ValueError(f"prefix lengths must lie in [0, T={T}], got {prefix_len.tolist()}")
        in_prefix = cols[None, :] < prefix_len[:, None].to(cols.device)  # (B, T): key is in prefix
        return (causal[None] | in_prefix[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
    check_count("prefix_len", prefix_len, 0, maximum=T, bound_name="T")
    return causal | (cols < prefix_len)[None, :]  # (T, T)


def sliding_window_mask(T: int, window: int, S: int | None = None, *, device=None) -> Tensor:
    """Causal mask that also limits each query to its last ``window`` keys (itself included)."""
    check_count("window", window)
    S = T if S is None else check_count("S", S)
    causal = causal_mask(T, S, device=device)
    rows = torch.arange(T, device=device).unsqueeze(1) + (S - T)
    cols = torch.arange(S, device=device).unsqueeze(0)
    return causal & (rows - cols < window)  # (T, S)


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of boolean masks, broadcasting their shapes; ``None`` entries are skipped."""
    present = [m for m in masks if m is not None]
    for m in present:
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            got = f"dtype {m.dtype}" if isinstance(m, Tensor) else type(m).__name__
            raise ValueError(f"combine takes boolean masks (True = may attend), got {got}")
    if not present:
        return None
    try:
        torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"combine needs masks whose shapes broadcast together, got {shapes}") from None
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


def to_blocked(mask: Tensor) -> Tensor:
    """Our convention (True = may attend) to PyTorch's nn.MultiheadAttention / nn.Transformer
    boolean convention (True = blocked)."""
    return ~_check_bool_mask("mask", mask)


def from_blocked(blocked: Tensor) -> Tensor:
    """PyTorch's True = blocked convention to ours (True = may attend)."""
    if not isinstance(blocked, Tensor) or blocked.dtype != torch.bool:
        got = f"dtype {blocked.dtype}" if isinstance(blocked, Tensor) else type(blocked).__name__
        raise ValueError(f"blocked must be a boolean tensor (True = blocked), got {got}")
    return ~blocked


def key_padding_to_torch(mask: Tensor) -> Tensor:
    """A (B, 1, 1, S) key-padding mask in our convention to the (B, S) ``key_padding_mask``
    argument of nn.MultiheadAttention and nn.Transformer* (True = padding)."""
    if _check_bool_mask("mask", mask).dim() != 4 or mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"expected a boolean key-padding mask of shape (B, 1, 1, S), got {mask.dtype} {tuple(mask.shape)}"
        )
    return ~mask[:, 0, 0, :]


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Boolean mask to an additive float mask: 0 where allowed, -inf where blocked."""
    _check_bool_mask("mask", mask)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


# An added value at or below this blocks the key. Libraries fill blocked entries with -inf,
# with the dtype's most negative number (Hugging Face), with -1e9 or with -1e4 (older models,
# and fp16 code, where -1e9 overflows); any of them lowers a score by far more than the
# ~104 that already drives exp() to exactly 0 in float32 (about 745 in float64).
ADDITIVE_BLOCKED_AT = -1000.0


def from_additive(additive: Tensor) -> Tensor:
    """Additive float mask to boolean (True = may attend).

    A key is allowed where the added value is 0 and blocked where it is at or below
    ``ADDITIVE_BLOCKED_AT`` (-1000): -inf, ``torch.finfo(dtype).min``, -1e9, -1e4 all block.
    Any other value (between -1000 and 0, positive, NaN) is not a mask but a bias that
    shifts the scores (ALiBi, relative positions), and no boolean mask says the same:
    ``ValueError``; pass such a tensor to attention as ``bias=`` instead.
    """
    if not isinstance(additive, Tensor) or not additive.is_floating_point():
        got = additive.dtype if isinstance(additive, Tensor) else type(additive).__name__
        raise ValueError(f"expected a floating-point additive mask, got {got}")
    blocked = additive <= ADDITIVE_BLOCKED_AT
    ambiguous = ~(blocked | (additive == 0))
    if ambiguous.any():
        values = additive[ambiguous].unique()
        raise ValueError(
            f"an additive mask holds 0 (allowed) or a value <= {ADDITIVE_BLOCKED_AT:g} (blocked); this one "
            f"also holds {values[:5].tolist()}{' ...' if len(values) > 5 else ''}, which only shift the scores: "
            "that is a bias, not a mask (pass it to attention as bias=)"
        )
    return ~blocked
