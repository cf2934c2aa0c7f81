"""Quantization written out: integers and scales by hand, then ggml's block formats byte for byte.

**Integer quantization.** A group of values shares one float *scale*; each value is stored as a
small integer q, and read back as scale * q (plus a minimum, in the asymmetric kind). Two
steps lose information, and both are written out below: the **rounding** of x / scale to an
integer, and the **clamping** of that integer to the range that ``bits`` bits can hold.

* *Symmetric (absmax)*: scale = max|x| / qmax with qmax = 2**(bits-1) - 1, and
  q = clamp(round(x / scale), -qmax, qmax). The range is kept symmetric, -qmax..qmax
  (-7..7 for 4 bits): the largest |x| lands exactly on ±qmax, so the extra code -qmax-1 of
  two's complement would never be used by this scale. Zero is always exact.
* *Asymmetric (scale and minimum)*: scale = (max - min) / (2**bits - 1),
  q = clamp(round((x - min) / scale), 0, 2**bits - 1), value = scale * q + min. All
  2**bits codes span the values actually there, which pays off for one-signed data; the
  minimum is exact, zero in general is not.

Rounding is ``torch.round`` (ties to even). With these scales a finite x / scale never leaves
the range by more than float rounding, so the clamp only guards the ends; it starts to matter
as soon as a scale is chosen smaller than max|x| / qmax (clipping outliers on purpose).

The **granularity** says which values share a scale: the whole tensor, each output channel
(each row of an (out, in) weight: the last dimension), or each block of ``block_size``
consecutive values of a row. Smaller groups cost more scales but confine an outlier's damage
to its own group; :attr:`Quantized.bits_per_weight` counts the price.

**ggml's blocks.** :func:`quantize` writes the block types Q8_0, Q4_0 and Q4_1 exactly as
ggml's reference quantizer (and the ``gguf`` package's numpy copy of it) writes them; the byte
layout is described in :mod:`tutorial_lib.gguf`, whose :func:`~tutorial_lib.gguf.dequantize`
reads them back (:func:`dequantize` here is that function). Against the integer kinds above:

* Q8_0 is symmetric 8-bit per block of 32, with d = max|x| / 127 stored as float16;
* Q4_0 is *not* the symmetric 4-bit kind: d = m / -8 where m is the value of largest
  magnitude *with its sign*, so m itself lands on code -8 and all 16 codes -8..7 are used
  (the range is lopsided, but towards the block's own extreme);
* Q4_1 is asymmetric 4-bit per block of 32, d and the minimum stored as float16.

To produce ggml's bits, the arithmetic follows it step by step in float32: the scale d is
computed in float32, the integers come from x * (1 / d) with that float32 d (not from the
float16 d that is stored), a block with d = 0 gets 1 / d = 0, Q8_0 rounds half away from zero,
and the 4-bit kinds take trunc(x * (1 / d) + 8.5) (Q4_0) or trunc((x - min) * (1 / d) + 0.5)
(Q4_1) and clamp to 0..15. Only then are d (and the minimum) rounded to float16, to nearest
even: a d above 65504 becomes inf, a tiny one a subnormal or 0, as in ggml.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tutorial_lib import gguf
from tutorial_lib.checks import check_count

GRANULARITIES = ("tensor", "channel", "block")
SCALE_BITS = 16  # each stored scale or minimum is counted as a float16, as ggml stores them
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = gguf.BLOCK  # 32 values per ggml block
CPU_CHUNK_BLOCKS = 4096  # blocks encoded at once on a CPU: 512 KiB of float32 per temporary
BLOCK_BYTES = {t.name: t.block_bytes for t in gguf.TENSOR_TYPES.values() if t.name in BLOCK_KINDS}  # 34, 18, 20


# ---- checks and grouping ---------------------------------------------------------------------


def _float32(x, name: str = "x") -> Tensor:
    """``x`` as float32 (a floating tensor with at least one dimension and finite values)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (its last one holds the rows), got a 0-d tensor")
    x32 = x.float()
    # one reduction tells: max|x| is nan or inf exactly when some value is (amax propagates nan)
    if x32.numel() and not bool(torch.isfinite(x32.abs().amax())):
        finite = torch.isfinite(x32)
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        widened = " (it overflows float32)" if x.dtype == torch.float64 and bool(torch.isfinite(x[where])) else ""
        raise ValueError(f"{name} must hold finite values; it has {int((~finite).sum())} that are not "
                         f"(nan or ±inf), the first at index {where}: {x[where].item()}{widened}")
    return x32


def _check_bits(bits) -> int:
    return check_count("bits", bits, 2, maximum=8, why="the width of one stored integer")


def _check_grouping(x: Tensor, granularity, block_size) -> int | None:
    """The block size to store (None unless granularity is "block"), after checking both."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    if granularity != "block":
        return None
    check_count("block_size", block_size)
    if x.size(-1) % block_size:
        raise ValueError(f"per-block quantization needs rows (the last dimension) made of whole blocks of "
                         f"block_size={block_size}; got rows of {x.size(-1)} values (shape {tuple(x.shape)})")
    return block_size


def _groups(x: Tensor, granularity: str, block_size: int | None) -> Tensor:
    """``x`` seen as (n_groups, values per group): the values in a row of the result share one scale."""
    if granularity == "tensor":
        return x.reshape(1, -1)
    if granularity == "channel":
        return x.reshape(-1, x.size(-1))
    return x.reshape(-1, block_size)


def _scale_shape(shape: torch.Size, granularity: str, block_size: int | None) -> tuple[int, ...]:
    """How the scales are kept: () per tensor, (*lead,) per channel, (*lead, blocks per row) per block."""
    if granularity == "tensor":
        return ()
    if granularity == "channel":
        return tuple(shape[:-1])
    return (*shape[:-1], shape[-1] // block_size)


def _nonzero(scale: Tensor) -> Tensor:
    """The scale to divide by: 1 where it is 0 (a group with no range, whose q are then all 0)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# ---- integer quantization ----------------------------------------------------------------------


class Quantized(NamedTuple):
    """Integers and their scales: what :func:`quantize_symmetric` and :func:`quantize_asymmetric` return.

    ``q`` has the shape of the input (int8 when symmetric, uint8 when asymmetric); ``scale``
    (float32) has one entry per group, shaped () per tensor, (*lead,) per channel and
    (*lead, blocks per row) per block; ``minimum`` is shaped like ``scale``, or None when
    symmetric; ``block_size`` is None unless the granularity is "block".
    """

    q: Tensor
    scale: Tensor
    minimum: Tensor | None
    bits: int
    granularity: str
    block_size: int | None

    def dequantize(self) -> Tensor:
        """The values read back, float32, in the shape of ``q``: scale * q (+ minimum)."""
        q = _groups(self.q, self.granularity, self.block_size).float()  # (n_groups, per group)
        values = self.scale.reshape(-1, 1) * q
        if self.minimum is not None:
            values = values + self.minimum.reshape(-1, 1)
        return values.reshape(self.q.shape)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per value: ``bits`` for the integer plus the scales (and minimums) shared
        out over the values, each counted at 16 bits (float16, as ggml stores them; this object
        keeps them in float32 for the arithmetic). 4-bit per block of 32: 4.5 symmetric (as
        Q4_0), 5.0 asymmetric (as Q4_1); 8-bit symmetric per block of 32: 8.5 (as Q8_0)."""
        n_floats = self.scale.numel() + (0 if self.minimum is None else self.minimum.numel())
        return self.bits + n_floats * SCALE_BITS / self.q.numel()


def quantize_symmetric(x: Tensor, bits: int, granularity: str = "block", block_size: int = 32) -> Quantized:
    """Absmax quantization: scale = max|x| / qmax, q = clamp(round(x / scale), -qmax, qmax),
    qmax = 2**(bits-1) - 1; a group of zeros gets scale 0 and q = 0. Computed in float32."""
    bits = _check_bits(bits)
    x = _float32(x)
    block_size = _check_grouping(x, granularity, block_size)
    groups = _groups(x, granularity, block_size)  # (n_groups, per group)
    qmax = 2 ** (bits - 1) - 1
    scale = groups.abs().amax(dim=1, keepdim=True) / qmax  # (n_groups, 1)
    q = torch.round(groups / _nonzero(scale))  # the rounding
    q = q.clamp(-qmax, qmax)  # the clamping
    return Quantized(q.to(torch.int8).reshape(x.shape), scale.reshape(_scale_shape(x.shape, granularity, block_size)),
                     None, bits, granularity, block_size)


def quantize_asymmetric(x: Tensor, bits: int, granularity: str = "block", block_size: int = 32) -> Quantized:
    """Scale-and-minimum quantization: scale = (max - min) / (2**bits - 1),
    q = clamp(round((x - min) / scale), 0, 2**bits - 1); a constant group gets scale 0 and
    q = 0, so it reads back as its minimum, exactly. Computed in float32."""
    bits = _check_bits(bits)
    x = _float32(x)
    block_size = _check_grouping(x, granularity, block_size)
    groups = _groups(x, granularity, block_size)  # (n_groups, per group)
    levels = 2 ** bits - 1
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)  # (n_groups, 1)
    scale = (high - low) / levels
    q = torch.round((groups - low) / _nonzero(scale))  # the rounding
    q = q.clamp(0, levels)  # the clamping
    shape = _scale_shape(x.shape, granularity, block_size)
    return Quantized(q.to(torch.uint8).reshape(x.shape), scale.reshape(shape), low.reshape(shape),
                     bits, granularity, block_size)


def round_trip(x: Tensor, bits: int, granularity: str = "block", *, symmetric: bool = True,
               block_size: int = 32) -> Tensor:
    """``x`` quantized and read back (float32, x's shape): the values a model would compute with."""
    quantize_kind = quantize_symmetric if symmetric else quantize_asymmetric
    return quantize_kind(x, bits, granularity, block_size).dequantize()


# ---- ggml's block formats ----------------------------------------------------------------------


def _divide(a: Tensor, b: float) -> Tensor:
    """a / b, correctly rounded on every device: CUDA turns a division by a Python number into a
    product with its reciprocal (at times one bit off), a division by a tensor it does not."""
    return a / a.new_tensor(b)


def _inverse(d: Tensor) -> Tensor:
    """1 / d, and 0 where d is 0 (ggml's ``id = d ? 1.0f/d : 0.0f``)."""
    return torch.where(d == 0, torch.zeros_like(d), torch.reciprocal(d))


JUST_BELOW_HALF = 0.5 - 2.0 ** -25  # the largest float32 below 0.5


def _round_half_away(v: Tensor) -> Tensor:
    """Round float32 values to the nearest integer, ties away from zero (C's roundf, which ggml
    uses; torch.round sends ties to even). The magnitude gets 0.49999997 (just below one half),
    then its floor: a tie still reaches the next integer (the sum rounds up to it in float32),
    and 0.49999997 itself gives 0.99999994, not the 1.0 that adding 0.5 would give."""
    return v.sign() * torch.floor(v.abs() + JUST_BELOW_HALF)


def _half_bytes(v: Tensor) -> Tensor:
    """(n_blocks, 1) float32 -> (n_blocks, 2) bytes of its float16 (round to nearest even, as ggml)."""
    return v.to(torch.float16).view(torch.uint8)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """(n_blocks, 32) float codes 0..15 -> (n_blocks, 16) bytes: element j low, element j + 16 high."""
    q = codes.to(torch.int8).view(torch.uint8)  # through int8: torch converts floats to it faster than to uint8
    return q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << 4)


def _q8_0(blocks: Tensor) -> Tensor:
    d = _divide(blocks.abs().amax(dim=1, keepdim=True), 127.0)  # (n_blocks, 1), float32
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8)  # -127..127
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=1)


def _q4_0(blocks: Tensor) -> Tensor:
    largest = blocks.abs().argmax(dim=1, keepdim=True)  # the first, on a tie of +m and -m
    d = _divide(blocks.gather(1, largest), -8.0)  # the signed extreme lands on -8
    # ggml truncates; the sum is never negative (x * (1 / d) >= -8, up to rounding): floor is the same, and faster
    q = torch.floor(blocks * _inverse(d) + 8.5).clamp(0, 15)  # q - 8 is the code -8..7
    return torch.cat([_half_bytes(d), _pack_nibbles(q)], dim=1)


def _q4_1(blocks: Tensor) -> Tensor:
    low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    d = _divide(high - low, 15.0)
    q = torch.floor((blocks - low) * _inverse(d) + 0.5).clamp(0, 15)  # trunc in ggml: the same, as x >= low
    return torch.cat([_half_bytes(d), _half_bytes(low), _pack_nibbles(q)], dim=1)


_ENCODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def _check_kind(kind) -> str:
    if kind not in BLOCK_KINDS:
        raise ValueError(f"kind must be one of the block types {', '.join(BLOCK_KINDS)}, got {kind!r}")
    return kind


def quantize(x: Tensor, kind: str) -> Tensor:
    """``x`` (floating, rows of a multiple of 32 values) -> ggml's bytes of type ``kind``: a uint8
    tensor of shape (*x.shape[:-1], x.shape[-1] // 32 * bytes per block), bytes per block being
    34 (Q8_0), 18 (Q4_0) or 20 (Q4_1). Byte for byte what ``gguf.quants.quantize`` writes.
    Other floating dtypes are converted to float32 first, as ``gguf`` does.

    One corner has no reference answer: in a block of values all tinier than about 4e-37 (Q8_0's
    max|x|) or 4e-38 (Q4_0's max|x|, Q4_1's max - min), far below any weight, 1 / d overflows to
    inf, and ggml converts inf or NaN to an integer, which C leaves undefined; there the bytes
    may differ from ``gguf``'s."""
    kind = _check_kind(kind)
    x = _float32(x)
    if x.size(-1) % BLOCK:
        raise ValueError(f"{kind} stores rows (the last dimension) in blocks of {BLOCK} values; got rows of "
                         f"{x.size(-1)} values (shape {tuple(x.shape)})")
    blocks = x.reshape(-1, BLOCK)  # (n_blocks, 32): the blocks of all rows, in order
    out = torch.empty(blocks.size(0), BLOCK_BYTES[kind], dtype=torch.uint8, device=x.device)
    # A CPU encodes a few thousand blocks at a time: the temporaries then stay in its cache and
    # in the allocator's free memory, instead of costing fresh pages from the system at every
    # operation (that is most of the time on a whole weight). A GPU takes all blocks at once.
    step = max(blocks.size(0), 1) if x.device.type != "cpu" else CPU_CHUNK_BLOCKS
    for start in range(0, blocks.size(0), step):
        out[start:start + step] = _ENCODERS[kind](blocks[start:start + step])
    return out.reshape(*x.shape[:-1], x.size(-1) // BLOCK * BLOCK_BYTES[kind])  # (*lead, bytes per row)


def dequantize(q: Tensor, kind: str) -> Tensor:
    """ggml's bytes of type ``kind`` (Q8_0, Q4_0 or Q4_1) -> float32 values: the reader of
    :mod:`tutorial_lib.gguf`, named here for symmetry with :func:`quantize`."""
    return gguf.dequantize(q, _check_kind(kind))
