"""Scaled dot-product attention and multi-head attention (self, cross, grouped-query).

Two paths give the same numbers:

* the written-out :func:`scaled_dot_product_attention`, which returns the attention weights
  (for plots and for learning), and
* PyTorch's fused ``F.scaled_dot_product_attention``, the default inside
  :class:`MultiHeadAttention` because it is faster and needs less memory.

Masks are boolean, ``True`` = may attend, of shape (T, S) (the same for every example and
head) or 4-D, broadcastable to (B, h, T, S). A 3-D mask is refused: (B, T, S) would line its
batch axis up with the heads. A query whose row allows no key at all gets an output of zeros
and finite gradients (never NaN), on both paths.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_count, check_number
from .masks import causal_mask, combine


class AttentionOutput(NamedTuple):
    """What attention returns: the output and, when asked for, the weights (B, h, T, S)."""

    out: Tensor
    weights: Tensor | None


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                           bias: Tensor | None = None) -> None:
    """Raise ``ValueError`` unless q (B, h, T, d_k), k and v (B, h_kv, S, d_k) and the mask
    and bias fit together (see :func:`check_mask`). Only shapes, dtypes and devices are read
    (no tensor data)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor (B, heads, length, d_k), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, heads, length, d_k), got shape {_shape(t)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    (B, h, T, d_q), (B_k, h_k, S, d_k), (B_v, h_v, S_v, _) = q.shape, k.shape, v.shape
    if not (B == B_k == B_v):
        raise ValueError(f"batch sizes differ: q {B}, k {B_k}, v {B_v}")
    if d_q != d_k:
        raise ValueError(f"q and k must have the same d_k, got {d_q} and {d_k}")
    if h_k != h_v or S != S_v:
        raise ValueError(f"k and v must have the same heads and length, got {_shape(k)} and {_shape(v)}")
    if h % h_k:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the key/value heads ({h_k})")
    check_mask_and_bias(mask, bias, (B, h, T, S), q.device)


def check_mask_and_bias(mask: Tensor | None, bias: Tensor | None, target: tuple[int, int, int, int],
                        device: torch.device) -> None:
    """Check a boolean mask and an additive bias (either may be None) against (B, h, T, S)."""
    if mask is not None:
        check_mask("mask", mask, target, device)
    if bias is not None:
        check_mask("bias", bias, target, device, bias=True)


def check_mask(name: str, m, target: tuple[int, int, int, int], device: torch.device | None = None, *,
               bias: bool = False) -> None:
    """Raise ``ValueError`` unless ``m`` is a boolean mask (a float tensor with ``bias=True``)
    of shape (T, S) or 4-D, broadcastable to ``target`` = (B, h, T, S). ``name`` is the
    caller's name for it (``mask``, ``src_mask``, ...). Reads metadata only.

    A 3-D one is refused: broadcasting would line up its first axis with the heads, so a
    (B, T, S) mask with B == h would silently give example b's mask to head b. A 2-D mask is
    always read as (T, S); a (B, S) key-padding mask needs ``mask[:, None, None, :]``.
    """
    B, h, T, S = target
    if not isinstance(m, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(m).__name__}")
    if bias:
        if not m.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {m.dtype}")
    elif m.dtype != torch.bool:
        raise ValueError(
            f"{name} must be boolean (True = may attend), got dtype {m.dtype}; "
            "convert an additive float mask with tutorial_lib.masks.from_additive"
        )
    if device is not None and m.device != device:
        raise ValueError(f"{name} is on {m.device} but the queries are on {device}; move it with .to()")
    if m.dim() == 3:
        raise ValueError(
            f"a 3-D {name} of shape {_shape(m)} is ambiguous: its first axis would be read as heads. "
            f"Add the head axis for a per-example {name} (B, T, S): {name}[:, None] gives (B, 1, T, S); "
            f"add the batch axis for a per-head one (h, T, S): {name}[None] gives (1, h, T, S)"
        )
    if m.dim() not in (2, 4):
        raise ValueError(f"{name} must be 2-D (T, S) or 4-D, broadcastable to (B, h, T, S) = {target}; got a "
                         f"{m.dim()}-D {name} of shape {_shape(m)}")
    try:
        broadcast = torch.broadcast_shapes(m.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != target:
        hint = ""
        if m.dim() == 2 and m.shape != (T, S) and m.size(0) == B:
            hint = f"; a 2-D {name} is read as (T, S): a (B, S) key-padding mask needs {name}[:, None, None, :]"
        elif m.dim() == 2:
            hint = f"; expected (T, S) = ({T}, {S}) or a 4-D {name}"
        raise ValueError(f"{name} of shape {_shape(m)} does not broadcast to (B, h, T, S) = {target}{hint}")


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, h_kv, S, d_k) -> (B, h_kv * n_rep, S, d_k): each key/value head serves n_rep query
    heads (grouped-query attention); query head i reads key/value head i // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on this device, or None outside autocast."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def empty_rows(mask: Tensor) -> Tensor:
    """(..., T, 1): True for the query rows of ``mask`` (..., T, S) that allow no key."""
    return ~mask.any(dim=-1, keepdim=True)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                                 bias: Tensor | None = None, dropout_p: float = 0.0) -> AttentionOutput:
    """softmax(q k^T / sqrt(d_k) + bias, masked) v, written out. Returns (out, weights).

    q: (B, h, T, d_k); k, v: (B, h_kv, S, d_k) with h a multiple of h_kv; mask: boolean,
    True = may attend, (T, S) or 4-D broadcastable to (B, h, T, S); bias: an additive float
    term with the same shapes (ALiBi, relative positions). The returned weights are before
    dropout. A query row with no allowed key gets weights 0, output 0 and finite gradients.

    Precision: the scores, the softmax and the weighted sum run in float32 whatever the input
    dtype, and the results are cast back to it (bf16 or fp16 inputs, or the autocast dtype
    under ``torch.autocast``, whose inputs are rounded to that dtype first, as autocast does
    for a matrix product). PyTorch's fused kernels also accumulate in float32, so the two
    paths agree to the rounding of the output dtype.
    """
    check_attention_inputs(q, k, v, mask, bias)
    if dropout_p != 0.0:  # the usual value costs one comparison
        check_number("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    autocast_dtype = _autocast_dtype(q.device)
    out_dtype = autocast_dtype or q.dtype
    # under autocast, switch it off here: it would run the products below in its low precision
    with contextlib.nullcontext() if autocast_dtype is None else torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.to(out_dtype).float() for t in (q, k, v))  # round as autocast would, then float32
        n_rep = q.size(1) // k.size(1)
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, h, S, d_k)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, h, T, S), float32
        if bias is not None:
            scores = scores + bias.float()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
            # A row with no allowed key would be softmax(all -inf) = NaN. Give it finite scores;
            # its weights are zeroed below, so its output is 0 and no NaN flows backwards.
            scores = scores.masked_fill(empty_rows(mask), 0.0)
        weights = scores.softmax(dim=-1)
        if mask is not None:
            weights = weights.masked_fill(~mask, 0.0)  # exact zeros at masked keys and empty rows
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
        out = dropped @ v  # (B, h, T, d_k), float32
    return AttentionOutput(out.to(out_dtype), weights.to(out_dtype))  # (B, h, T, d_k), (B, h, T, S)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                    bias: Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False) -> Tensor:
    """The same computation through ``torch.nn.functional.scaled_dot_product_attention``.

    ``is_causal`` asks for the causal mask of a square (T == S) problem without building it.
    Rows with no allowed key return zeros, as in the written-out version. The mask is made
    safe *before* the kernel (an empty row may attend to every key, and its output is zeroed
    afterwards), because some kernels return NaN for an all-blocked row, and a NaN that is
    only overwritten in the output still flows into the gradients of the backward pass.
    """
    check_attention_inputs(q, k, v, mask, bias)
    if dropout_p != 0.0:  # the usual value costs one comparison
        check_number("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    return fused_attention_unchecked(q, k, v, mask, bias, dropout_p, is_causal)


def fused_attention_unchecked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
                              dropout_p: float, is_causal: bool) -> Tensor:
    """:func:`fused_attention` without its checks, for callers whose inputs are already known
    to fit (:class:`MultiHeadAttention` and :class:`tutorial_lib.fast_decode.FastDecoder` build
    q, k and v themselves; the first checks a mask or bias it is given): a cached decoding step
    of a small model is mostly such fixed costs."""
    T, S = q.size(-2), k.size(-2)
    if is_causal and T == 1:
        is_causal = False  # one query, the newest position: it may see every key (cached decoding)
    if is_causal and (mask is not None or bias is not None or T != S):
        # SDPA's own is_causal aligns the triangle top-left; we need it bottom-right when
        # keys are cached (S > T), and it cannot be combined with a mask. Build it instead.
        mask = combine(mask, causal_mask(T, S, device=q.device))
        is_causal = False
    empty = None
    attn_mask = None if bias is None else bias.to(q.dtype)
    if mask is not None:
        empty = empty_rows(mask)  # (..., T, 1)
        safe = mask | empty  # an empty row attends everywhere; its output is zeroed below
        attn_mask = safe if bias is None else attn_mask.masked_fill(~safe, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        enable_gqa=q.size(1) != k.size(1),
    )
    if empty is not None:
        out = out.masked_fill(empty, 0.0)  # empty rows: 0, and a zero gradient into the kernel
    return out  # (B, h, T, d_k)


class LayerKVCache:
    """Keys and values of one attention layer, kept across decoding steps.

    Self-attention appends the new step's keys and values; cross-attention stores the
    encoder's keys and values once and reads them at every later step.

    The keys and values live in buffers with room to spare, and ``keys`` / ``values`` are
    views of the filled part: appending one position writes it in place instead of copying
    the whole cache (``torch.cat``) at every step. When a buffer is full its room doubles,
    so a generation of n tokens copies the cache only about log2(n) times. With ``capacity``
    (a model's max_len) the first append allocates room for that many positions at once, and
    the buffers are never copied.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self._keys: Tensor | None = None  # (B, h_kv, capacity, d_k)
        self._values: Tensor | None = None
        self._length = 0
        self.capacity = None if capacity is None else check_count("capacity", capacity)

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> Tensor | None:
        """The cached keys, (B, h_kv, S, d_k); None before the first append."""
        return None if self._keys is None else self._keys[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values[:, :, : self._length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the keys and values of new positions; return all of them so far."""
        if v.shape != k.shape:
            raise ValueError(f"new values of shape {_shape(v)} differ from the new keys {_shape(k)}; both are "
                             "(B, h_kv, T, d_k)")
        if self._keys is None:
            if self.capacity is None:
                self._keys, self._values, self._length = k, v, k.size(-2)
                return k, v
            # room for the whole context; the prompt is written into it like any later step
            self._keys = self._grow(k, 0, max(self.capacity, k.size(-2)))
            self._values = self._grow(v, 0, self._keys.size(-2))
        if k.shape[:2] != self._keys.shape[:2] or k.size(-1) != self._keys.size(-1):
            raise ValueError(f"new keys of shape {_shape(k)} do not fit the cached keys {_shape(self.keys)}")
        start, end = self._length, self._length + k.size(-2)
        if end > self._keys.size(-2):  # full: move to buffers with twice the room
            capacity = max(end, 2 * self._keys.size(-2))
            self._keys = self._grow(self._keys, start, capacity)
            self._values = self._grow(self._values, start, capacity)
        self._keys.narrow(2, start, end - start).copy_(k)  # in place: buffer[:, :, start:end] = k
        self._values.narrow(2, start, end - start).copy_(v)
        self._length = end
        return self._keys[:, :, :end], self._values[:, :, :end]  # (B, h_kv, S + T, d_k)

    @staticmethod
    def _grow(buffer: Tensor, filled: int, capacity: int) -> Tensor:
        B, h, _, d = buffer.shape
        grown = buffer.new_empty(B, h, capacity, d)
        grown[:, :, :filled] = buffer[:, :, :filled]
        return grown

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding drops the keys and
        values of rejected draft tokens); the buffers keep their room."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"length must be an int from 0 to the {self._length} cached positions, got {length!r}")
        self._length = length

    def select(self, index: Tensor) -> None:
        """Keep the sequences ``index`` (N,) of the batch, in that order (beam search)."""
        self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes of the cached keys and values (the filled part, not the spare room)."""
        if self._keys is None:
            return 0
        return 2 * self._length * self._keys[:, :, :1].numel() * self._keys.element_size()


class KVCache:
    """The key/value caches of a whole stack, one :class:`LayerKVCache` per layer."""

    def __init__(self, n_layers: int, capacity: int | None = None) -> None:
        check_count("n_layers", n_layers)
        self.layers = [LayerKVCache(capacity) for _ in range(n_layers)]

    def __len__(self) -> int:
        """How many positions are cached (the position of the next token)."""
        return len(self.layers[0])

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        for layer in self.layers:
            layer.crop(length)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention, cross-attention and grouped-query attention.

    One fused projection produces queries (``n_heads`` heads) and keys and values
    (``n_kv_heads`` heads each, fewer than ``n_heads`` for grouped-query attention); its
    rows are ordered [Q; K; V], the layout of ``nn.MultiheadAttention.in_proj_weight``.
    For cross-attention the same matrix is used in two parts: Q from the target, K/V from
    the context.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = True, out_bias: bool | None = None,
                 dropout: float = 0.0, rotary: nn.Module | None = None):
        super().__init__()
        check_count("d_model", d_model)
        check_count("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else check_count("n_kv_heads", n_kv_heads)
        if head_dim is not None:
            check_count("head_dim", head_dim)
        else:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                                 "or give head_dim explicitly")
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.dropout = dropout
        self.q_size = n_heads * head_dim
        self.kv_size = n_kv_heads * head_dim
        self.qkv = nn.Linear(d_model, self.q_size + 2 * self.kv_size, bias=bias)
        self.out = nn.Linear(self.q_size, d_model, bias=bias if out_bias is None else out_bias)
        self.rotary = rotary

    def _split_heads(self, x: Tensor, n: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.head_dim).transpose(1, 2)  # (B, n, L, d_k)

    def _self_heads(self, x: Tensor) -> Tensor:
        """The fused projection of x as heads (B, h + 2 h_kv, T, d_k): queries, then keys, then
        values. One view and one transpose for all three instead of a split, three views and
        three transposes (a cached decoding step is mostly such fixed costs); splitting this on
        dim 1 gives the same views, strides included, as splitting the features first."""
        B, T, _ = x.shape
        return self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)

    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries from x; keys and values from context (cross) or from x (self)."""
        if context is None:
            # split_with_sizes: Tensor.split without its Python wrapper (a cost per decoding step)
            return self._self_heads(x).split_with_sizes([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        else:
            w_q, w_kv = self.qkv.weight.split([self.q_size, 2 * self.kv_size], dim=0)
            b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split(
                [self.q_size, 2 * self.kv_size])
            q = F.linear(x, w_q, b_q)
            k, v = F.linear(context, w_kv, b_kv).split([self.kv_size, self.kv_size], dim=-1)
        return self._split_heads(q, self.n_heads), self._split_heads(k, self.n_kv_heads), \
            self._split_heads(v, self.n_kv_heads)

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None, *,
                is_causal: bool = False, bias: Tensor | None = None,
                cache: LayerKVCache | None = None, need_weights: bool = False) -> AttentionOutput:
        """x: (B, T, d). context: (B, S, d) for cross-attention, None for self-attention.

        ``cache``: for self-attention the new keys and values are appended and the new
        queries sit at positions len(cache)..; for cross-attention the context's keys and
        values are computed on the first call and reused afterwards.
        ``need_weights=True`` takes the written-out path and returns the weights.
        """
        if not isinstance(x, Tensor):
            raise ValueError(f"x must be a tensor (B, T, d_model={self.d_model}), got {type(x).__name__}")
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(f"x must have shape (B, T, d_model={self.d_model}), got {_shape(x)}")
        if context is not None and (context.dim() != 3 or context.size(-1) != self.d_model
                                    or context.size(0) != x.size(0)):
            raise ValueError(f"context must have shape (B={x.size(0)}, S, d_model={self.d_model}), "
                             f"got {_shape(context)}")
        cross = context is not None
        if cross and cache is not None and len(cache) > 0:
            # Encoder keys/values were projected at the first step: only queries are new.
            w_q = self.qkv.weight[: self.q_size]
            b_q = None if self.qkv.bias is None else self.qkv.bias[: self.q_size]
            q = self._split_heads(F.linear(x, w_q, b_q), self.n_heads)
            k, v = cache.keys, cache.values
        elif (rotary := self.rotary) is not None and not cross:
            # RoPE on queries and keys in one go: they are adjacent heads of the projection,
            # and the rotation is per head and position (half the operations of rotating each)
            q_and_k, v = self._self_heads(x).split_with_sizes([self.n_heads + self.n_kv_heads, self.n_kv_heads], 1)
            q, k = rotary.rotate(q_and_k, 0 if cache is None else len(cache)).split_with_sizes(
                [self.n_heads, self.n_kv_heads], 1)  # (B, h, T, d_k), (B, h_kv, T, d_k)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, h_kv, S_total, d_k)
        else:
            q, k, v = self.project(x, context)  # (B, h, T, d_k), (B, h_kv, S, d_k) x 2
            if cache is not None:
                k, v = cache.append(k, v)  # (B, h_kv, S_total, d_k)

        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            if is_causal:
                mask = combine(mask, causal_mask(q.size(-2), k.size(-2), device=q.device))
            out, weights = scaled_dot_product_attention(q, k, v, mask, bias=bias, dropout_p=dropout_p)
        else:
            # q, k and v were built here (their shapes fit by construction): only what the
            # caller handed in is checked, and a decoding step without a mask checks nothing
            if mask is not None or bias is not None:
                check_mask_and_bias(mask, bias, (q.size(0), self.n_heads, q.size(-2), k.size(-2)), q.device)
            out = fused_attention_unchecked(q, k, v, mask, bias, dropout_p, is_causal)
            weights = None
        B, _, T, _ = out.shape
        if T == 1:  # one query (a decoding step): (B, h, 1, d_k) holds the heads in merged order
            out = out.reshape(B, 1, self.q_size)
        else:
            out = out.transpose(1, 2).reshape(B, T, self.q_size)  # merge heads: (B, T, h * d_k)
        return AttentionOutput(self.out(out), weights)  # (B, T, d)
