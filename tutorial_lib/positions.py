"""Position information: sinusoidal table, learned table, rotary embedding (RoPE), ALiBi bias,
T5's relative-position bias.

Attention on its own is permutation-equivariant; each of these breaks that symmetry in a
different place: added to the embeddings (sinusoidal, learned), rotating queries and keys
(RoPE), or added to the attention scores (ALiBi's fixed bias, T5's learned one).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .checks import check_count


def sinusoidal_table(T: int, d: int, base: float = 10000.0) -> Tensor:
    """The table of Vaswani et al. (2017), section 3.5, shape (T, d).

    PE[p, 2i] = sin(p / base^(2i/d)) and PE[p, 2i+1] = cos(p / base^(2i/d)).
    """
    check_count("T", T)
    if check_count("d", d, 2) % 2:
        raise ValueError(f"the sinusoidal table needs an even d (sine/cosine pairs), got d={d}")
    position = torch.arange(T, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    two_i = torch.arange(0, d, 2, dtype=torch.float64)  # (d/2,)
    angle = position / base ** (two_i / d)  # (T, d/2)
    table = torch.empty(T, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position vectors, looked up by position (no parameters)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        check_count("T", T)
        check_count("offset", offset, 0)
        if offset + T > self.max_len:
            raise ValueError(
                f"positions {offset}..{offset + T - 1} requested, but the table holds {self.max_len}"
            )
        return self.table[offset : offset + T]  # (T, d)


class LearnedPositions(nn.Module):
    """A learned table of ``max_len`` position vectors. It has nothing past ``max_len``."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        check_count("T", T)
        check_count("offset", offset, 0)
        if offset + T > self.max_len:
            raise ValueError(
                f"a learned position table of length {self.max_len} has no vector for positions "
                f"{self.max_len}..{offset + T - 1} (asked for {T} positions from offset {offset})"
            )
        # rows offset .. offset + T - 1 of the table: the same vectors (and gradients) as
        # looking them up with an index tensor, without building one at every decoding step
        return self.embedding.weight[offset : offset + T]  # (T, d)


def rotate_half(x: Tensor) -> Tensor:
    """Split the last dimension in two halves (x1, x2) and return (-x2, x1).

    This is the half-split pairing used by Hugging Face's LLaMA: dimension i is rotated
    together with dimension i + d/2.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., T, d_k) by the angles whose cos/sin are given, shape (T, d_k)."""
    return x * cos + rotate_half(x) * sin


def rotate_pairs(x: Tensor) -> Tensor:
    """The interleaved pairing of Meta's original LLaMA code and of llama.cpp: dimension 2i is
    rotated together with 2i + 1, so (x0, x1, x2, x3, ...) becomes (-x1, x0, -x3, x2, ...)."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., d/2, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE with the interleaved pairing; cos and sin (T, d_k/2), one angle per pair."""
    return x * cos.repeat_interleave(2, dim=-1) + rotate_pairs(x) * sin.repeat_interleave(2, dim=-1)


def interleaved_to_half_split(w: Tensor, n_heads: int) -> Tensor:
    """Reorder the rows of a query or key projection (n_heads * d_k, ...) from the interleaved
    RoPE layout to the half-split one, head by head.

    The two layouts compute the same attention: RoPE rotates pairs of dimensions, and only
    *which* dimensions form a pair differs, (2i, 2i + 1) or (i, i + d_k/2). Moving row 2i of
    each head to place i and row 2i + 1 to place i + d_k/2 turns one into the other. Scores
    are dot products over a head's dimensions, which do not care about their order, as long
    as queries and keys are reordered alike. llama.cpp's converter applies the inverse
    (:func:`half_split_to_interleaved`) to Hugging Face checkpoints; a GGUF loader undoes it.
    """
    rows = w.size(0)
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even width")
    d_k = rows // n_heads
    # (heads, d_k/2, 2): row 2i + j of a head -> (i, j); then pairs' first members, then second
    return w.reshape(n_heads, d_k // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_split_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of :func:`interleaved_to_half_split` (what llama.cpp's converter does)."""
    rows = w.size(0)
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even width")
    d_k = rows // n_heads
    return w.reshape(n_heads, 2, d_k // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021) for heads of width ``head_dim``.

    Pair (i, i + d/2) of a query or key at position p is rotated by the angle
    p * base^(-2i/d). The score between a query at m and a key at n then depends only on
    m - n. ``offset`` is the position of the first of the T vectors (the cache length
    during cached decoding).
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim >= 2, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # cos, sin and the sign-folded sin (see rotate) for positions 0 .. n-1, each (n, d_k)
        self._table: tuple[Tensor, Tensor, Tensor] | None = None

    def cos_sin(self, T: int, offset: int = 0, *, dtype=torch.float32) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles at positions offset .. offset + T - 1, each (T, d_k)."""
        cos, sin, _ = self._table_for(offset + T, dtype)
        return cos[offset : offset + T], sin[offset : offset + T]

    def _table_for(self, end: int, dtype) -> tuple[Tensor, Tensor, Tensor]:
        """The table (cos, sin, sign-folded sin) for at least positions 0 .. end - 1, on the
        device of inv_freq, in ``dtype``; built again only when it is too short or elsewhere."""
        table = self._table
        if table is None or table[0].size(0) < end or table[0].device != self.inv_freq.device \
                or table[0].dtype != dtype:
            # computed once for many positions and sliced afterwards: a decoding step then
            # costs two slices instead of six small operations per layer
            size = max(end, 2 * (0 if table is None else table[0].size(0)), 64)
            # built as ordinary tensors even under torch.inference_mode(): the table outlives
            # the call, and an inference tensor could not be saved for a later backward pass
            with torch.inference_mode(False):
                position = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
                angle = torch.outer(position, self.inv_freq)  # (size, d_k/2)
                angle = torch.cat((angle, angle), dim=-1)  # (size, d_k): the same angle for i and i + d/2
                sin = angle.sin()
                half = self.head_dim // 2
                signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # (size, d_k)
                table = self._table = (angle.cos().to(dtype), sin.to(dtype), signed.to(dtype))
        return table

    def forward(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """Rotate q (B, h, T, d_k) and k (B, h_kv, T, d_k) that sit at positions offset.."""
        if q.size(-1) != self.head_dim or k.size(-1) != self.head_dim:
            raise ValueError(
                f"RotaryEmbedding was built for head_dim={self.head_dim}, "
                f"got q and k with last dimension {q.size(-1)} and {k.size(-1)}"
            )
        if q.size(-2) != k.size(-2):
            raise ValueError(
                "q and k must hold the same positions (rotate new keys before caching them), "
                f"got {q.size(-2)} queries and {k.size(-2)} keys"
            )
        check_count("offset", offset, 0)
        return self.rotate(q, offset), self.rotate(k, offset)

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate x (B, heads, T, d_k) at positions offset.. (any heads: queries, keys, or both
        stacked). No checks: :meth:`forward` checks its inputs, and MultiHeadAttention hands
        this the heads of its own projection, whose width it built to fit."""
        T = x.size(-2)
        cos, _, signed_sin = self._table_for(offset + T, x.dtype)
        cos, signed_sin = cos[offset : offset + T], signed_sin[offset : offset + T]  # (T, d_k)
        # apply_rope's x * cos + rotate_half(x) * sin in four operations instead of six:
        # rotate_half(x) = cat(-x2, x1), so rotate_half(x) * sin = roll(x) * cat(-sin1, sin1),
        # where roll(x) = cat(x2, x1). Moving the minus sign from x2 to sin changes no bit.
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * signed_sin


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head slopes of ALiBi (Press et al., 2022).

    For n a power of two: the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    Otherwise the published rule: the slopes of the closest smaller power of two n', then
    every other slope of 2n' until there are n.
    """
    check_count("n_heads", n_heads)

    def geometric(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = geometric(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = geometric(closest) + geometric(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(n_heads: int, T: int, S: int | None = None) -> Tensor:
    """Additive ALiBi bias of shape (h, T, S): -slope_h * |i - j|.

    The queries are the last T of S positions (as in cached decoding). For a causal model
    only j <= i is ever used, where this is the published -slope * (i - j).
    """
    S = T if S is None else check_count("S", S)
    if check_count("T", T) > S:
        raise ValueError(f"expected T <= S (the queries are the last T of S positions), got T={T}, S={S}")
    rows = torch.arange(T).unsqueeze(1) + (S - T)  # absolute query positions (T, 1)
    cols = torch.arange(S).unsqueeze(0)  # (1, S)
    distance = (rows - cols).abs().float()  # (T, S)
    return -alibi_slopes(n_heads)[:, None, None] * distance  # (h, T, S)


def relative_position_bucket(relative_position: Tensor, *, bidirectional: bool, n_buckets: int = 32,
                             max_distance: int = 128) -> Tensor:
    """T5's bucket (Raffel et al., 2020, section 2.1) of each relative position, an integer
    tensor of key position - query position; returns bucket ids in [0, n_buckets).

    Bidirectional (encoder): half of the buckets for keys at or before the query, the other
    half (ids from n_buckets // 2) for keys after it. Causal (decoder): every bucket for keys at
    or before the query; a key after it (which the causal mask hides) shares bucket 0 with
    distance 0. Within a side of ``n`` buckets, the distances 0 .. n/2 - 1 get one bucket each;
    longer distances share the other n/2 buckets on a logarithmic scale up to
    ``max_distance``, and every distance from there on falls into the last bucket.
    """
    if relative_position.is_floating_point() or relative_position.dtype == torch.bool:
        raise ValueError(f"relative_position must be an integer tensor, got dtype {relative_position.dtype}")
    n = n_buckets // 2 if bidirectional else n_buckets  # buckets for one side
    exact = n // 2  # distances 0 .. exact - 1 get a bucket each
    if exact < 1:
        raise ValueError(f"n_buckets must be at least {4 if bidirectional else 2} "
                         f"({'bidirectional' if bidirectional else 'causal'}), got {n_buckets}")
    if max_distance <= exact:
        raise ValueError(f"max_distance must exceed the {exact} exact buckets, got {max_distance}")
    if bidirectional:
        side = (relative_position > 0).long() * n  # keys after the query: the upper half of the ids
        distance = relative_position.abs()
    else:
        side = torch.zeros_like(relative_position, dtype=torch.long)
        distance = (-relative_position).clamp(min=0)  # how far back the key is; future keys: 0
    # log(distance / exact) / log(max_distance / exact) is 0 at the first shared bucket and 1 at
    # max_distance; the n - exact shared buckets cover that range (clamp: no log of 0)
    scaled = torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    shared = (exact + (scaled * (n - exact)).long()).clamp(max=n - 1)
    return side + torch.where(distance < exact, distance, shared)


class RelativePositionBias(nn.Module):
    """T5's learned relative-position bias: one number per (bucket, head), added to the
    attention scores of query i and key j in head h as table[bucket(j - i), h].

    One table serves every self-attention layer of a stack (T5 keeps it in the first layer and
    passes the bias on). ``bidirectional=True`` for an encoder, False for a causal decoder.
    """

    def __init__(self, n_heads: int, n_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool):
        super().__init__()
        check_count("n_heads", n_heads)
        check_count("n_buckets", n_buckets)
        check_count("max_distance", max_distance)
        relative_position_bucket(torch.zeros(1, dtype=torch.long), bidirectional=bidirectional,
                                 n_buckets=n_buckets, max_distance=max_distance)  # validates the sizes
        self.n_buckets, self.max_distance, self.bidirectional = n_buckets, max_distance, bidirectional
        self.table = nn.Embedding(n_buckets, n_heads)

    def buckets(self, T: int, S: int | None = None) -> Tensor:
        """(T, S) bucket ids; the queries are the last T of S positions (cached decoding)."""
        S = T if S is None else check_count("S", S)
        if check_count("T", T) > S:
            raise ValueError(f"expected T <= S (the queries are the last T of S positions), got T={T}, S={S}")
        device = self.table.weight.device
        queries = torch.arange(S - T, S, device=device)[:, None]  # absolute query positions (T, 1)
        keys = torch.arange(S, device=device)[None, :]  # (1, S)
        return relative_position_bucket(keys - queries, bidirectional=self.bidirectional,
                                        n_buckets=self.n_buckets, max_distance=self.max_distance)

    def forward(self, T: int, S: int | None = None) -> Tensor:
        """The additive bias (h, T, S) for T queries at the last T of S positions."""
        return self.table(self.buckets(T, S)).permute(2, 0, 1)  # (T, S, h) -> (h, T, S)
