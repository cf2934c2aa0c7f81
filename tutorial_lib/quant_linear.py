"""Linear layers whose weights stay quantized: the 4-bit CPU kernel, and blocks for fine-tuning.

A decoding step at batch 1 reads every weight once (notebook 11), so its time follows the
weight bytes. ``Q4_1`` stores a weight in 5 bits where float32 takes 32; these layers keep
those bytes and never hold the float32 matrix.

* :class:`Int4Linear` runs PyTorch's CPU kernel for 4-bit weights in groups of 32
  (``torch.ops.aten._weight_int4pack_mm_for_cpu``). It computes w = (q - 8) * scale + zero per
  group, so a ``Q4_1`` block (d, m, q: w = d * q + m) maps to scale d and zero m + 8d, stored
  in bfloat16. Its fast path takes bfloat16 activations and returns bfloat16: the layer casts
  its input to bfloat16 and its output back. Those two roundings (8 significant bits) and
  the bfloat16 scale and zero are where its results differ from the float32 model's.
* :class:`Int8Linear` does the same with 8-bit weights and one scale per output channel
  (``torch.ops.aten._weight_int8pack_mm``): for the output head, which 4 bits damage most.
* :class:`BlockQuantLinear` keeps ggml's block bytes (``Q8_0``, ``Q4_0``, ``Q4_1``) and
  dequantizes them inside every product, forward and backward, so autograd never saves a
  float32 copy: a frozen base for LoRA (notebook 12; the idea of QLoRA), exact to the
  dequantized weights.

:func:`quantize_linears` puts either into a loaded model in place of its ``nn.Linear`` layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import gguf
from .quant import quantize, quantize_symmetric

GROUP = 32  # values per block (ggml) and per group (PyTorch's int4 kernel)
Q4_1_BYTES = 20  # d (fp16), m (fp16), 16 bytes of nibbles


def _q4_1_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out, n_blocks * 20) Q4_1 bytes -> d, m (out, n_blocks) float32 and q (out, in) int32,
    read with the GGUF reader's own helpers."""
    out = blocks.size(0)
    b = blocks.reshape(out, -1, Q4_1_BYTES)  # (out, n_blocks, 20)
    d, m = gguf._halves(b, 0).squeeze(-1), gguf._halves(b, 2).squeeze(-1)
    return d, m, gguf._nibbles(b[..., 4:]).reshape(out, -1).to(torch.int32)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W in 4 bits, groups of 32, through PyTorch's CPU int4 kernel.

    Build it from ``Q4_1`` bytes (:meth:`from_q4_1`) or from a float weight
    (:meth:`from_float`, which first quantizes it to ``Q4_1``). Inference only: no gradients
    flow to the weight. CPU only (PyTorch's CUDA int4 kernel wants another packing).
    """

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, in_features: int, out_features: int,
                 bias: Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)  # (out, in / 2) uint8, the kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (in / 32, out, 2) bfloat16
        self.register_buffer("bias", bias)

    @classmethod
    def from_q4_1(cls, blocks: Tensor, bias: Tensor | None = None) -> Int4Linear:
        """blocks: (out, in / 32 * 20) uint8, the rows of a ``Q4_1`` tensor."""
        if not isinstance(blocks, Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.size(1) % Q4_1_BYTES:
            raise ValueError("blocks must be a 2-D uint8 tensor of Q4_1 rows (a multiple of 20 bytes each), got "
                             + (f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, Tensor)
                                else type(blocks).__name__))
        d, m, q = _q4_1_parts(blocks)
        out, in_features = q.shape
        if in_features % (2 * GROUP) or out % 16:
            raise ValueError(f"the int4 kernel packs a multiple of 16 rows of a multiple of 64 values each, got "
                             f"{out} rows of {in_features}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # (in / 32, out, 2): scale d and zero m + 8d, since the kernel computes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, scales_and_zeros, in_features, out, None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int4Linear:
        """Quantize a float (out, in) weight to ``Q4_1`` (ggml's encoder, tutorial_lib.quant) first."""
        return cls.from_q4_1(quantize(weight.detach().float().cpu(), "Q4_1"), bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(f"x must end in in_features={self.in_features}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (N, in)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        """Bytes a product reads: the packed nibbles and the scales and zeros."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4, group={GROUP}"


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in 8 bits, one scale per output channel (symmetric, -127..127),
    through PyTorch's weight-only int8 CPU kernel (``torch.ops.aten._weight_int8pack_mm``),
    bfloat16 activations as :class:`Int4Linear`. Inference only. For the output head, whose
    rows (the token table) lose too much in 4 bits (notebook 11 measures it)."""

    def __init__(self, weight_int8: Tensor, scales: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)  # (out, in) int8
        self.register_buffer("scales", scales)  # (out,) bfloat16
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        q = quantize_symmetric(weight.detach().float().cpu(), 8, "channel")
        return cls(q.q.contiguous(), q.scale.to(torch.bfloat16), None if bias is None else bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(f"x must end in in_features={self.in_features}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (N, in)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return self.weight_int8.nbytes + self.scales.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8, per channel"


class _BlockProduct(torch.autograd.Function):
    """x W^T with W dequantized from blocks in the forward pass and again in the backward pass:
    nothing float32 of W outlives either."""

    @staticmethod
    def forward(ctx, x: Tensor, blocks: Tensor, kind: str) -> Tensor:
        ctx.save_for_backward(blocks)
        ctx.kind = kind
        return F.linear(x, gguf.dequantize(blocks, kind).to(x.dtype))

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (blocks,) = ctx.saved_tensors
        grad_x = grad_y @ gguf.dequantize(blocks, ctx.kind).to(grad_y.dtype)  # (..., out) @ (out, in)
        return grad_x, None, None


class BlockQuantLinear(nn.Module):
    """A frozen linear layer that holds ggml blocks (``Q8_0``, ``Q4_0``, ``Q4_1``) and
    dequantizes them in every product. Gradients flow to the input (and so to a LoRA update
    beside it), never to the weight, which is a buffer."""

    def __init__(self, blocks: Tensor, kind: str, bias: Tensor | None = None):
        super().__init__()
        if kind not in ("Q8_0", "Q4_0", "Q4_1"):
            raise ValueError(f"kind must be one of Q8_0, Q4_0, Q4_1, got {kind!r}")
        self.kind = kind
        self.register_buffer("blocks", blocks)  # (out, in / 32 * block bytes) uint8
        self.register_buffer("bias", bias)
        self.out_features = blocks.size(0)
        self.in_features = gguf.dequantize(blocks[:1], kind).size(-1)

    @classmethod
    def from_float(cls, weight: Tensor, kind: str, bias: Tensor | None = None) -> BlockQuantLinear:
        return cls(quantize(weight.detach().float().cpu(), kind).to(weight.device), kind,
                   None if bias is None else bias.detach().clone())

    def dequantized_weight(self) -> Tensor:
        return gguf.dequantize(self.blocks, self.kind)

    def forward(self, x: Tensor) -> Tensor:
        y = _BlockProduct.apply(x, self.blocks, self.kind)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return self.blocks.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def quantize_linears(model: nn.Module, make, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (but those named in ``skip``) by
    ``make(name, linear)``, in place; return the names replaced. A tied head is replaced like
    any other layer: its new weights are its own, and the embedding keeps the float table."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in skip]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to replace (skip={skip})")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            setattr(parent, child, make(name, getattr(parent, child)))
    return names


def gguf_blocks(model: nn.Module, path) -> dict[str, tuple[Tensor, str]]:
    """The stored bytes of every weight matrix of a GGUF file, by the name of the ``nn.Linear``
    of ``model`` (a :class:`DecoderOnlyLM` loaded from that file) they fill, in the model's row
    order: the query and key rows put into the half-split RoPE layout as the loader does (a
    block never spans two rows, so rows move whole), the fused [Q; K; V] rows concatenated.
    Values: (bytes (out, bytes per row), type name). A matrix whose parts are stored in
    different types, or the tied head (the token table), is left out."""
    from .convert import gguf_tensor_map, mapped_tensor
    from .pretrained import gguf_config

    with gguf.read(path) as f:
        cfg = gguf_config(f.metadata, f.tensor_names(), str(path))
        parts: dict[str, list] = {}
        for m in gguf_tensor_map(cfg):
            if not m.target.endswith(".weight") or f.tensors[m.source].type_name not in ("Q8_0", "Q4_0", "Q4_1"):
                continue
            parts.setdefault(m.target[:-len(".weight")], []).append(
                (m.rows[0] if m.rows else 0, mapped_tensor(m, f.raw(m.source)).clone(), f.tensors[m.source].type_name))
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    out = {}
    for name, pieces in parts.items():
        kinds = {kind for _, _, kind in pieces}
        if name in linears and len(kinds) == 1:
            out[name] = (torch.cat([b for _, b, _ in sorted(pieces, key=lambda p: p[0])]), kinds.pop())
    return out


def int4_from_gguf(model: nn.Module, path, *, head: str = "int8") -> list[str]:
    """Put :class:`Int4Linear` layers into ``model`` (loaded from the GGUF file ``path``) in place
    of its ``nn.Linear`` ones, from the file's own ``Q4_1`` bytes (any other stored type is
    quantized to ``Q4_1`` from the float weight). The head (tied to the token table, stored as
    ``Q8_0``) becomes ``head``: ``"int8"`` (:class:`Int8Linear`), ``"int4"`` or ``"float"`` (left
    as it is). Returns the names replaced."""
    if head not in ("int8", "int4", "float"):
        raise ValueError(f"head must be 'int8', 'int4' or 'float', got {head!r}")
    blocks = gguf_blocks(model, path)

    def make(name: str, linear: nn.Linear) -> nn.Module:
        if name == "head" and head == "int8":
            return Int8Linear.from_float(linear.weight, linear.bias)
        if name in blocks and blocks[name][1] == "Q4_1":
            return Int4Linear.from_q4_1(blocks[name][0], linear.bias)
        return Int4Linear.from_float(linear.weight, linear.bias)

    return quantize_linears(model, make, skip=("head",) if head == "float" else ())
