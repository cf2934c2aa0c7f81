"""Low-rank adapters (LoRA, Hu et al., 2021): fine-tune a few million numbers instead of all of them.

Full fine-tuning changes every weight matrix W (d_out x d_in) of a model. LoRA freezes W and
learns the change as a product of two thin matrices, B (d_out x r) and A (r x d_in), with a
rank r of 4 to 64 where d_in and d_out are in the hundreds or thousands:

    y = W x (+ b) + (alpha / r) * B (A x)

* A starts random and B at zero, so B A = 0 and the model computes exactly what it computed
  before: training starts from the pretrained model, not from a perturbed one. A is drawn
  uniformly in +-1 / sqrt(d_in), the default initialisation of ``nn.Linear`` and of ``peft``
  (``kaiming_uniform_`` with a = sqrt(5) works out to that bound).
* alpha / r scales the update, so that changing r does not change how large the first steps
  are (with r times more columns, each one moves 1 / r as much).
* A matrix of d_out x d_in numbers gets r (d_in + d_out) trainable ones: 8 * (576 + 1536) =
  16,896 instead of 884,736 for one FFN matrix of SmolLM2-135M, 1.9 %. The optimizer's state
  (two numbers per trainable parameter for AdamW) shrinks by the same factor.
* After training, :func:`merge_lora` adds (alpha / r) B A into W once: the merged model is a
  plain model again, exactly as fast as before, with no adapter left to run.

The frozen base does not have to be a float32 ``nn.Linear``. :class:`LoRALinear` wraps any
module that has ``in_features``, ``out_features`` and a forward x -> y that autograd can go
through to x, such as :class:`tutorial_lib.quant_linear.BlockQuantLinear`, which keeps ggml's
4-bit blocks and dequantizes them inside every product. The base then never exists in
float32 and only the small A and B are trained in float32: the idea of QLoRA (Dettmers et al.,
2023).

Which layers get an adapter is chosen by **fnmatch patterns over module names** (the names of
``model.named_modules()``, e.g. ``blocks.3.attn.qkv``; ``*`` matches any characters, dots
included). :data:`DEFAULT_TARGETS` picks every attention projection and FFN matrix of
tutorial_lib's models (self- and cross-attention, dense FFNs and the experts of a mixture),
not the token embedding, not the output head and not a router.

tutorial_lib's attention has one fused [Q; K; V] matrix where LLaMA checkpoints (and so
``peft`` on a ``transformers`` model) have three, ``q_proj``, ``k_proj`` and ``v_proj``. By
default the fused matrix gets one adapter per part (``splits``): the same update and the same
parameter count as LoRA on the three separate matrices. ``split_qkv=False`` puts a single
rank-r adapter on the fused matrix instead (fewer parameters, a different model).

    n = add_lora(model, r=8, alpha=16)     # wraps, freezes the rest, returns the trainable count
    ... train the parameters that require grad ...
    merge_lora(model)                      # folds B A into W and puts the plain layers back
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .checks import check_count, check_number
from .layers import maybe_dropout

# attention projections (self_attn / cross_attn / attn) and FFN matrices (dense, experts, shared)
DEFAULT_TARGETS: tuple[str, ...] = ("*attn.qkv", "*attn.out", "*.up", "*.gate", "*.down")


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear-like module, or None for any other module."""
    d_in, d_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(d_in, int) and isinstance(d_out, int) and callable(module):
        return d_in, d_out
    return None


def _placement(base: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the adapter lives: the base's device, and its dtype when its weight is a float
    (a quantized base holds bytes: the adapter is then float32)."""
    tensors = list(base.parameters()) + list(base.buffers())
    device = tensors[0].device if tensors else torch.device("cpu")
    weight = getattr(base, "weight", None)
    dtype = weight.dtype if isinstance(weight, Tensor) and weight.is_floating_point() else torch.float32
    return device, dtype


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * B A dropout(x), with the base frozen and A, B trained.

    base: an ``nn.Linear``, or any module with ``in_features``, ``out_features`` and a forward
    x (..., in) -> y (..., out) differentiable in x (a quantized layer). r: the rank; alpha:
    the scale numerator (the update is multiplied by alpha / r). dropout: applied to the
    adapter's input only, as ``peft`` does (0 by default). generator: draws A (reproducible
    adapters without touching the global seed).

    splits: output sizes of parts that get an adapter each, e.g. (576, 192, 192) for a fused
    [Q; K; V] matrix. Part i has its own A_i (r x in) and B_i (out_i x r); the A_i are stacked
    into one ``lora_A`` (parts * r, in), so that x is read once, and the B_i into ``lora_B``
    (out, r), used as the block-diagonal (out, parts * r) matrix of :meth:`full_B`. Trainable
    numbers: r (in + out_i) for each part, as separate layers would have.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float, *, dropout: float = 0.0,
                 splits: Sequence[int] | None = None, generator: torch.Generator | None = None):
        super().__init__()
        features = _features(base)
        if features is None or isinstance(base, LoRALinear):
            raise ValueError("LoRALinear wraps a linear layer: a module with int in_features and out_features "
                             f"(nn.Linear, BlockQuantLinear), got {type(base).__name__}")
        d_in, d_out = features
        self.r = check_count("r", r, why="the rank of the update")
        self.alpha = check_number("alpha", alpha, low=0.0, low_open=True)
        self.scaling = self.alpha / self.r
        splits = (d_out,) if splits is None else tuple(splits)
        if not splits or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in splits) \
                or sum(splits) != d_out:
            raise ValueError(f"splits must be positive ints that add up to out_features={d_out}, got {splits!r}")
        self.splits = splits
        self.base = base
        self.dropout = nn.Dropout(check_number("dropout", dropout, low=0.0, high=1.0, high_open=True))
        device, dtype = _placement(base)
        a = torch.empty(len(splits) * self.r, d_in, dtype=dtype)
        bound = 1.0 / math.sqrt(d_in)  # nn.Linear's default, and peft's, for A
        a.uniform_(-bound, bound, generator=generator)  # drawn on the CPU: same numbers on any device
        self.lora_A = nn.Parameter(a.to(device))  # (parts * r, in)
        self.lora_B = nn.Parameter(torch.zeros(d_out, self.r, device=device, dtype=dtype))  # (out, r): B A = 0
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.lora_A.size(1)

    @property
    def out_features(self) -> int:
        return self.lora_B.size(0)

    def full_B(self) -> Tensor:
        """B as one (out, parts * r) matrix: the B_i on the diagonal blocks and zeros elsewhere,
        so that B A stacks the B_i A_i and each part's rows see only their own A_i."""
        if len(self.splits) == 1:
            return self.lora_B
        return torch.block_diag(*self.lora_B.split(self.splits))

    def update(self, x: Tensor) -> Tensor:
        """(alpha / r) B A x: what the adapter adds to the base's output (..., out)."""
        return F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.full_B()) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)  # (..., out), frozen
        x = maybe_dropout(self.dropout, x)
        if y.dtype != self.lora_A.dtype:  # e.g. a bfloat16 base: the update in float32, then cast
            return y + self.update(x).to(y.dtype)
        h = F.linear(x.to(self.lora_A.dtype), self.lora_A)  # (..., parts * r)
        # y + (alpha / r) h B^T as one product that adds into y (addmm: y + alpha * h @ B^T), the
        # same as y + self.update(x) without an (..., out) temporary and a pass to scale it
        out = torch.addmm(y.reshape(-1, y.size(-1)), h.reshape(-1, h.size(-1)), self.full_B().t(), alpha=self.scaling)
        return out.view(y.shape)

    def delta_weight(self) -> Tensor:
        """(alpha / r) B A as one (out, in) matrix."""
        return (self.full_B() @ self.lora_A) * self.scaling

    def base_weight(self) -> Tensor:
        """The base's (out, in) weight as floats: its ``weight``, or its dequantized blocks."""
        weight = getattr(self.base, "weight", None)
        if isinstance(weight, Tensor):
            return weight
        if hasattr(self.base, "dequantized_weight"):
            return self.base.dequantized_weight()
        raise ValueError(f"{type(self.base).__name__} has neither a weight nor dequantized_weight(): "
                         "its matrix cannot be read")

    @property
    def weight(self) -> Tensor:
        """W + (alpha / r) B A, differentiable in A and B: for code that reads a layer's
        ``weight`` instead of calling it (the cross-attention of an encoder-decoder splits
        ``qkv.weight`` into its Q and K/V rows)."""
        w = self.base_weight()
        return w + self.delta_weight().to(w.dtype)

    @property
    def bias(self) -> Tensor | None:
        return getattr(self.base, "bias", None)

    def extra_repr(self) -> str:
        parts = f", splits={self.splits}" if len(self.splits) > 1 else ""
        return f"r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:g}{parts}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` of ``model``, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters (``...lora_A``, ``...lora_B``), by parameter name."""
    return {f"{name}.{p}": getattr(m, p) for name, m in lora_layers(model).items() for p in ("lora_A", "lora_B")}


def count_lora_parameters(model: nn.Module) -> int:
    """How many numbers the adapters hold: r (in + out) for each adapted matrix (or part)."""
    return sum(p.numel() for p in lora_parameters(model).values())


def _check_targets(targets) -> tuple[str, ...]:
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, Sequence) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError("targets must be an fnmatch pattern over module names or a non-empty list of them, "
                         f"e.g. {list(DEFAULT_TARGETS)}, got {targets!r}")
    return tuple(targets)


def _qkv_splits(model: nn.Module, name: str) -> tuple[int, int, int] | None:
    """(q, kv, kv) rows when ``name`` is the fused projection of a MultiHeadAttention, else None."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if child == "qkv" and isinstance(parent, MultiHeadAttention):
        return parent.q_size, parent.kv_size, parent.kv_size
    return None


def add_lora(model: nn.Module, r: int, alpha: float, targets: str | Sequence[str] | None = None, *,
             dropout: float = 0.0, split_qkv: bool = True, generator: torch.Generator | None = None) -> int:
    """Wrap the linear layers of ``model`` whose names match ``targets`` in :class:`LoRALinear`
    (in place), freeze every other parameter, and return the number of trainable parameters.

    targets: fnmatch patterns over module names (see the module docstring); each must match
    at least one linear layer (an ``nn.Linear`` or a module with in/out features such as
    ``BlockQuantLinear``); modules of other kinds are never chosen. None: :data:`DEFAULT_TARGETS`,
    of which a model has some (no ``gate`` without a gated FFN). split_qkv: one adapter for
    each of Q, K and V of a fused projection (as on a model with three matrices). Every
    argument is checked before the model is changed.
    """
    check_count("r", r, why="the rank of the update")
    check_number("alpha", alpha, low=0.0, low_open=True)
    check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    strict = targets is not None  # every pattern the caller names must match something
    targets = DEFAULT_TARGETS if targets is None else _check_targets(targets)
    if not isinstance(split_qkv, bool):
        raise ValueError(f"split_qkv must be True or False, got {split_qkv!r}")
    present = list(lora_layers(model))
    if present:
        raise ValueError(f"the model already has LoRA adapters ({len(present)}, e.g. {present[0]}): merge them "
                         "first (merge_lora) or start from a model without them")
    linear = [name for name, m in model.named_modules() if _features(m) is not None]
    chosen = set()
    for pattern in targets:
        hits = [name for name in linear if fnmatchcase(name, pattern)]
        if strict and not hits:
            raise ValueError(f"the target pattern {pattern!r} matches no linear layer of {type(model).__name__}; "
                             f"its linear layers are named like {linear[:4]}{' ...' if len(linear) > 4 else ''}")
        chosen.update(hits)
    if not chosen:
        raise ValueError(f"none of the default targets {list(DEFAULT_TARGETS)} matches a linear layer of "
                         f"{type(model).__name__} (named like {linear[:4]}); name the targets")
    for name in (n for n in linear if n in chosen):  # in the model's order: reproducible draws
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        splits = _qkv_splits(model, name) if split_qkv else None
        setattr(parent, child, LoRALinear(getattr(parent, child), r, alpha, dropout=dropout, splits=splits,
                                          generator=generator))
    adapters = {id(p) for p in lora_parameters(model).values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold each adapter into its base weight, W <- W + (alpha / r) B A, and put the base
    layer back in place of the :class:`LoRALinear` (in place); return the names merged.

    The merged weight is a new tensor: a weight shared with another layer (a tied head) is
    untied rather than changed under the other layer. A quantized base (no float ``weight``)
    becomes an ``nn.Linear`` with its dequantized weight plus the update, in float32:
    requantizing it is a further rounding, and the caller's choice. Base parameters stay
    frozen.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to merge (add_lora adds them)")
    for name, layer in layers.items():
        base = layer.base
        weight = getattr(base, "weight", None)
        if isinstance(weight, nn.Parameter):
            base.weight = nn.Parameter(weight + layer.delta_weight().to(weight.dtype), requires_grad=False)
        else:
            w = layer.base_weight().float() + layer.delta_weight().float()  # (out, in)
            bias = layer.bias
            plain = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, device=w.device)
            plain.weight.copy_(w)
            if bias is not None:
                plain.bias.copy_(bias)
            base = plain.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
    return list(layers)
