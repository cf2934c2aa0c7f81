"""The parts of a Transformer block around attention: feed-forward networks, norms, residual
sublayers in both orders, the block itself, token embeddings, and weight initialisation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import LayerKVCache, MultiHeadAttention
from .checks import (
    IdRange,
    check_count,
    check_id_tensor,
    check_id_values,
    check_length,
    check_number,
    check_vectors,
)
from .config import GATED_FFNS, ModelConfig
from .positions import LearnedPositions, RelativePositionBias, RotaryEmbedding, SinusoidalPositions, alibi_bias


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * g.

    Unlike LayerNorm it does not subtract the mean and has no bias, only a learned scale g.
    The epsilon sits inside the square root, as in ``torch.nn.RMSNorm`` and LLaMA.
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        check_count("d", d)
        self.eps = check_number("eps", eps, low=0.0, low_open=True)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight  # read once: a module attribute lookup costs on the decoding hot path
        if x.size(-1) != weight.size(0):
            raise ValueError(f"RMSNorm({weight.size(0)}) normalises vectors of width {weight.size(0)}; "
                             f"x has shape {tuple(x.shape)}")
        return rms_norm(x, weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What :class:`RMSNorm` computes, without its check (also called by
    :class:`tutorial_lib.fast_decode.FastDecoder`): x32 * rsqrt(mean(x32^2) + eps) in float32
    (also under bf16 autocast), through torch's rms_norm, which gives the same numbers as those
    operations written out; then the scale, in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # the same numbers with the scale applied inside the one call (checked bit for
        # bit in tests/test_layers.py): two fewer operations on the decoding hot path
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * normed.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm the config asks for, over d_model features."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.uses_bias("norm"))


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "swiglu": F.silu,  # the gate's activation in SwiGLU (Shazeer, 2020)
    "geglu": F.gelu,  # ... and in GeGLU
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU with tanh GELU (Gemma, T5 v1.1)
}


def maybe_dropout(dropout: nn.Dropout, x: Tensor) -> Tensor:
    """``dropout(x)``, without calling it when it would return x unchanged (eval mode or p=0).
    The result is the same (forward hooks on the skipped module do not run); a cached decoding
    step of a small model is dominated by fixed per-call costs, and this saves three calls per
    block and one in the embeddings."""
    return dropout(x) if dropout.training and dropout.p > 0 else x


class FeedForward(nn.Module):
    """Position-wise feed-forward network.

    Plain (``relu``, ``gelu``, ``gelu_tanh``): down(act(up(x))), two matrices.
    Gated (``swiglu``, ``geglu``, ``geglu_tanh``): down(act(gate(x)) * up(x)), three matrices.
    The inner width defaults to 4 * d_model.
    """

    def __init__(self, d_model: int, d_ff: int | None = None, activation: str = "gelu", *,
                 bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        check_count("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else check_count("d_ff", d_ff)
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        self.activation = activation
        self.act = _ACTIVATIONS[activation]
        self.gated = activation in GATED_FFNS
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, d)
        hidden = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))  # (B, T, d_ff)
        return self.down(maybe_dropout(self.dropout, hidden))


class Residual(nn.Module):
    """A residual sublayer around ``fn``, in either order.

    post-LN (Vaswani et al., 2017):  norm(x + dropout(fn(x)))
    pre-LN  (GPT-2 and most models since):  x + dropout(fn(norm(x)))
    """

    def __init__(self, norm: nn.Module, order: str = "pre", dropout: float = 0.0):
        super().__init__()
        if order not in ("pre", "post"):
            raise ValueError(f"order must be 'pre' or 'post', got {order!r}")
        self.norm = norm
        self.order = order
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.order == "pre":
            return x + maybe_dropout(self.dropout, fn(self.norm(x)))
        return self.norm(x + maybe_dropout(self.dropout, fn(x)))


def refuse_unbuilt_parts(cfg: ModelConfig, what: str) -> None:
    """Raise ValueError naming the fields of ``cfg`` that ask for parts this package counts but
    does not build (BERT's token-type table, embedding norm and pooler; Qwen3's query/key norm;
    DeepSeek's latent attention and multi-token prediction). Only a
    :class:`tutorial_lib.params.CountedConfig` has such fields (``cfg.unbuilt_parts()``); a
    model built without those parts would silently be a different one."""
    missing = cfg.unbuilt_parts()
    if missing:
        raise ValueError(f"tutorial_lib's {what} cannot be built from this {type(cfg).__name__}: it asks for "
                         f"{', '.join(missing)}, which tutorial_lib.params counts but tutorial_lib does not build")


def make_rotary(cfg: ModelConfig) -> RotaryEmbedding | None:
    return RotaryEmbedding(cfg.head_dim, cfg.rope_base) if cfg.positions == "rope" else None


def make_relative_bias(cfg: ModelConfig, *, bidirectional: bool) -> RelativePositionBias | None:
    """T5's learned relative-position table for one self-attention stack, shared by its layers,
    when the config uses it (``positions="relative"``), else None. ``bidirectional``: True for
    an encoder, False for a causal decoder."""
    if cfg.positions != "relative":
        return None
    return RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance,
                                bidirectional=bidirectional)


def position_bias(cfg: ModelConfig, T: int, S: int, device=None,
                  relative: RelativePositionBias | None = None) -> Tensor | None:
    """The additive score bias (1, h, T, S) of the config's positions, for T queries at the last
    T of S positions: ALiBi's fixed one, T5's learned one (``relative``, the stack's table from
    :func:`make_relative_bias`), else None. The batch axis is in front because attention refuses
    a 3-D bias, whose first axis would be ambiguous."""
    if cfg.positions == "relative":
        if relative is None:
            raise ValueError("positions='relative' needs the stack's table (make_relative_bias)")
        return relative(T, S)[None]  # (1, h, T, S)
    if cfg.positions != "alibi":
        return None
    return alibi_bias(cfg.n_heads, T, S).to(device)[None]  # (1, h, T, S)


def stack_weights(weights: list) -> Tensor | None:
    """Per-layer attention weights stacked to (L, B, h, T, S), or None when none were asked for."""
    return torch.stack(weights) if weights and weights[0] is not None else None


class BlockOutput(NamedTuple):
    x: Tensor  # (B, T, d)
    weights: Tensor | None  # (B, h, T, S) when asked for
    routing: NamedTuple | None = None  # a mixture of experts' tutorial_lib.moe.Routing, else None


class TransformerBlock(nn.Module):
    """Self-attention, then a feed-forward network, each inside a residual sublayer.

    With a padding mask this is an encoder layer; with a causal mask it is the block of a
    decoder-only language model (GPT, LLaMA). The norm order comes from the config.

    ``ffn``: the feed-forward part, by default the dense :class:`FeedForward` the config
    describes. A mixture of experts (:class:`tutorial_lib.moe.MoEFeedForward`) returns its
    output together with its routing, which the block hands on in ``BlockOutput.routing``.
    """

    def __init__(self, cfg: ModelConfig, rotary: nn.Module | None = None, *, ffn: nn.Module | None = None):
        super().__init__()
        refuse_unbuilt_parts(cfg, "layers")
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, n_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
            bias=cfg.uses_bias("qkv"), out_bias=cfg.uses_bias("out"), dropout=cfg.dropout,
            rotary=rotary)
        self.ffn = ffn if ffn is not None else FeedForward(
            cfg.d_model, cfg.ffn_dim, cfg.ffn, bias=cfg.uses_bias("ffn"), dropout=cfg.dropout)
        self.attn_sublayer = Residual(make_norm(cfg), cfg.norm_order, cfg.dropout)
        self.ffn_sublayer = Residual(make_norm(cfg), cfg.norm_order, cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, is_causal: bool = False,
                bias: Tensor | None = None, cache: LayerKVCache | None = None,
                need_weights: bool = False) -> BlockOutput:
        check_vectors("x", x, self.attn.d_model)
        weights = None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            out, weights = self.attn(h, mask=mask, is_causal=is_causal, bias=bias, cache=cache,
                                     need_weights=need_weights)
            return out

        routing = None

        def feed_forward(h: Tensor) -> Tensor:
            nonlocal routing
            out = self.ffn(h)
            if isinstance(out, tuple):  # a mixture of experts: (output, routing)
                out, routing = out
            return out

        x = self.attn_sublayer(x, attend)
        x = self.ffn_sublayer(x, feed_forward)
        return BlockOutput(x, weights, routing)


def make_positions(cfg: ModelConfig) -> nn.Module | None:
    """The position table added to the input vectors: learned, sinusoidal, or None (RoPE and
    ALiBi act inside attention instead)."""
    if cfg.positions == "learned":
        return LearnedPositions(cfg.max_len, cfg.d_model)
    if cfg.positions == "sinusoidal":
        return SinusoidalPositions(cfg.max_len, cfg.d_model)
    return None


class Embeddings(nn.Module):
    """Token ids (B, T) -> vectors (B, T, d): the token table, optionally scaled by sqrt(d),
    plus learned or sinusoidal position vectors when the config uses them, then dropout.

    ``vocab_size=0`` builds no token table: for a continuous frontend, call
    :meth:`add_positions` on its output instead.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        refuse_unbuilt_parts(cfg, "embeddings")
        self.vocab_size = cfg.vocab_size if vocab_size is None else vocab_size
        self.tokens = nn.Embedding(self.vocab_size, cfg.d_model) if self.vocab_size else None
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.max_len = cfg.max_len
        self.positions = make_positions(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def add_positions(self, x: Tensor, offset: int = 0, *, name: str = "the input") -> Tensor:
        """(B, T, d) vectors -> the same plus position vectors for positions offset.., dropout."""
        check_length(name, x.size(1), self.max_len, offset)
        if self.positions is not None:
            x = x + self.positions(x.size(1), offset)  # (T, d) broadcast over the batch
        return maybe_dropout(self.dropout, x)

    def forward(self, ids: Tensor, offset: int = 0, *, name: str = "ids", check_ids: bool = True) -> Tensor:
        """ids (B, T) -> (B, T, d). ``name`` is the caller's name for the ids, used in errors;
        ``check_ids=False`` when the caller has already checked them (shape, dtype, range)."""
        if self.tokens is None:
            raise ValueError("these embeddings have no token table (vocab_size=0); use add_positions")
        if check_ids:
            check_id_values(IdRange(name, check_id_tensor(name, ids), self.vocab_size))
        x = self.tokens(ids)  # (B, T, d)
        if self.scale != 1.0:  # GPT and LLaMA do not scale: skip a multiplication by 1
            x = x * self.scale
        return self.add_positions(x, offset, name=name)


def residual_branches(cfg: ModelConfig) -> int:
    """How many residual branches a model built from ``cfg`` has: two per encoder layer and per
    decoder-only layer (attention, FFN), three per decoder layer of an encoder-decoder model
    (self-attention, cross-attention, FFN)."""
    if cfg.family == "encoder-decoder":
        return 2 * cfg.n_layers + 3 * cfg.decoder_layers
    return 2 * cfg.n_layers


def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Initialise a model built from ``cfg``, with the options practitioners use.

    Every Linear and Embedding weight ~ N(0, init_std^2), biases 0, norm scales 1 (GPT-2's
    scheme). Then, when the config asks:
    ``qk_gain``: W_Q and W_K multiplied by it (a smaller gain keeps early attention logits
    small); ``zero_init_out``: the output projection of every residual branch (attention's W_O,
    the FFN's down matrix) starts at zero, so each block starts as the identity;
    ``scale_residual_init``: those projections scaled by 1/sqrt(N), N the number of residual
    branches in the model: 2 per encoder layer and per decoder-only layer (GPT-2's
    1/sqrt(2 * n_layers)), 3 per decoder layer of an encoder-decoder model (self-attention,
    cross-attention, FFN). At initialisation the branches' writes are roughly independent, so
    their variances add; scaled this way, all N writes together add about as much variance
    as one unscaled write. The stream's variance still grows, but by a factor that stays
    about the same whatever the depth, instead of in proportion to N.
    """
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    n_residual = residual_branches(cfg)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MultiHeadAttention):
                module.qkv.weight[: module.q_size + module.kv_size].mul_(cfg.qk_gain)
                outputs = [module.out.weight]
            elif isinstance(module, FeedForward):
                outputs = [module.down.weight]
            else:
                continue
            for weight in outputs:
                if cfg.zero_init_out:
                    weight.zero_()
                elif cfg.scale_residual_init:
                    weight.mul_(1.0 / math.sqrt(n_residual))
