"""A cached decoding step of a decoder-only model, run as one function instead of ~50 module calls.

At batch 1 a cached step of a small model does little arithmetic: about 20 matrix-vector
products. Through the modules it costs about as much again in Python: every ``nn.Module``
call, argument check, closure and named tuple of the forward pass runs once per layer and
per token. :class:`FastDecoder` runs the same operations on the same weight tensors, in the
same order, with those costs taken out: the weights are looked up once, the keys and values
are written straight into the cache's buffers, and nothing is checked per step (generate
checked the prompt, and every later token is an id the sampler picked).

On a CPU the logits are bit-identical to ``model(token, cache=cache).logits[:, -1]``
(tests/test_fast_decode.py compares them for every kind of block this package builds, also
under bf16 autocast; on a GPU tests/test_cuda.py asks for float32 rounding). A model the
module path would treat differently gets no fast decoder (:func:`fast_decoder` returns None
and :func:`tutorial_lib.sampling.generate` calls the modules): one in training mode (dropout),
one with a forward hook or a pre-hook (probes, the NaN finder, a learner's print), a
parametrized weight, a replaced ``forward``, or a part of a type this package did not build
there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_internals
from torch.nn.utils import parametrize

from .attention import KVCache, MultiHeadAttention, _fused
from .gpt import DecoderOnlyLM
from .layers import (
    Embeddings,
    FeedForward,
    Residual,
    RMSNorm,
    TransformerBlock,
    position_bias,
    rms_norm,
    rms_norm_steps,
)
from .moe import MoEFeedForward
from .positions import LearnedPositions, RelativePositionBias, RotaryEmbedding, SinusoidalPositions

# The parts whose forward FastDecoder reproduces (or, for a mixture of experts, calls as is).
_KNOWN_PARTS = (DecoderOnlyLM, Embeddings, nn.Embedding, LearnedPositions, SinusoidalPositions, RotaryEmbedding,
                RelativePositionBias, nn.ModuleList, TransformerBlock, MultiHeadAttention, nn.Linear, FeedForward,
                MoEFeedForward, Residual, nn.LayerNorm, RMSNorm, nn.Dropout, nn.Identity)


def _hooked_globally() -> bool:
    """True when a hook registered for every module (``register_module_forward_hook``) is set."""
    return any(getattr(module_internals, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called"))


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """A :class:`FastDecoder` for ``model``, or None when its steps must go through the modules
    (see the module's docstring for when)."""
    if type(model) is not DecoderOnlyLM or model.training or _hooked_globally():
        return None
    for part in model.modules():
        if (type(part) not in _KNOWN_PARTS or part._forward_hooks or part._forward_pre_hooks
                or "forward" in part.__dict__ or parametrize.is_parametrized(part)):
            return None
        if type(part) is nn.Embedding and part.max_norm is not None:  # rescales its table when called
            return None
    return FastDecoder(model)


def _norm(norm: nn.Module, float32: bool) -> Callable[[Tensor], Tensor]:
    """The norm's forward on its own weights, without the module call and the width check.
    ``float32``: the vectors will be float32 and no autocast is on, so RMSNorm can run as
    :func:`~tutorial_lib.layers.rms_norm_steps` (the same bits as torch's rms_norm, faster
    for one position)."""
    if type(norm) is nn.LayerNorm:
        shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    if type(norm) is RMSNorm:
        weight, eps = norm.weight, norm.eps
        if float32 and weight.dtype == torch.float32:
            width, eps_tensor = (torch.tensor(float(value), device=weight.device) for value in (weight.size(0), eps))
            return lambda x: rms_norm_steps(x, weight, width, eps_tensor)
        return lambda x: rms_norm(x, weight, eps)
    return lambda x: x  # nn.Identity: a post-LN stack has no final norm


class _Layer:
    """What one block's step reads, looked up once: norms, weights, the feed-forward network."""

    def __init__(self, block: TransformerBlock, float32: bool):
        attn, ffn = block.attn, block.ffn
        self.pre = block.attn_sublayer.order == "pre"
        self.attn_norm = _norm(block.attn_sublayer.norm, float32)
        self.ffn_norm = _norm(block.ffn_sublayer.norm, float32)
        self.qkv_weight, self.qkv_bias = attn.qkv.weight, attn.qkv.bias
        self.out_weight, self.out_bias = attn.out.weight, attn.out.bias
        self.rotary = attn.rotary
        self.moe = ffn if type(ffn) is MoEFeedForward else None  # called as a module: its routing varies
        if self.moe is None:
            self.act = ffn.act
            self.gate = None if ffn.gate is None else (ffn.gate.weight, ffn.gate.bias)
            self.up = ffn.up.weight, ffn.up.bias
            self.down = ffn.down.weight, ffn.down.bias

    def feed_forward(self, h: Tensor) -> Tensor:  # (B, d) -> (B, d)
        if self.moe is not None:
            return self.moe(h[:, None]).x[:, 0]  # as (B, 1, d), the shape it was built for
        hidden = F.linear(h, *self.up)  # (B, d_ff)
        if self.gate is not None:
            hidden = self.act(F.linear(h, *self.gate)) * hidden
        else:
            hidden = self.act(hidden)
        return F.linear(hidden, *self.down)


class FastDecoder:
    """``decoder(token, cache)``: the logits (B, V) of the next token after ``token`` (B, 1),
    which sits at position len(cache); its keys and values are appended to ``cache``.

    The cache must have room for the token (generate refills it through the modules when the
    context reaches max_len) and must hold at least one position (the prompt, run through the
    modules, allocated its buffers). Nothing here checks either: it is the hot loop of
    :func:`tutorial_lib.sampling.generate`, which guarantees both.
    """

    def __init__(self, model: DecoderOnlyLM):
        cfg = model.cfg
        self.cfg = cfg
        embed = model.embed
        self.token_table, self.padding_idx = embed.tokens.weight, embed.tokens.padding_idx
        self.scale = embed.scale
        positions = embed.positions
        self.position_table = (None if positions is None else positions.embedding.weight
                               if type(positions) is LearnedPositions else positions.table)  # (max_len, d)
        self.relative_bias = model.relative_bias
        self.biased = cfg.positions in ("alibi", "relative")  # a score bias per step (see position_bias)
        # the residual stream keeps the token table's dtype; autocast would change what the
        # norms' operations compute in, so only plain float32 takes the written-out RMSNorm
        table = self.token_table
        float32 = table.dtype == torch.float32 and not torch.is_autocast_enabled(table.device.type)
        self.layers = [_Layer(block, float32) for block in model.blocks]
        self.final_norm = _norm(model.final_norm, float32)
        self.head_weight, self.head_bias = model.head.weight, model.head.bias
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.d_k
        self.q_and_k = [cfg.n_heads + cfg.kv_heads, cfg.kv_heads]  # split sizes, built once
        self.q_k = [cfg.n_heads, cfg.kv_heads]
        self.q_k_v = [cfg.n_heads, cfg.kv_heads, cfg.kv_heads]
        self.gqa = cfg.n_heads != cfg.kv_heads

    def __call__(self, token: Tensor, cache: KVCache) -> Tensor:
        position = len(cache)
        B = token.size(0)
        # One position per sequence: vectors are (B, d), not (B, 1, d), which spares a view or a
        # transpose per operation and gives the same numbers (the same kernels on the same rows)
        x = F.embedding(token.view(B), self.token_table, self.padding_idx)  # (B, d)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position_table is not None:
            x = x + self.position_table.narrow(0, position, 1)  # (1, d) broadcast over the batch
        bias = None
        if self.biased:
            bias = position_bias(self.cfg, 1, position + 1, x.device, self.relative_bias)  # (1, h, 1, S)
        for layer, layer_cache in zip(self.layers, cache.layers):
            if layer.pre:
                x = x + self._attend(layer, layer.attn_norm(x), layer_cache, position, bias)
                x = x + layer.feed_forward(layer.ffn_norm(x))
            else:
                x = layer.attn_norm(x + self._attend(layer, x, layer_cache, position, bias))
                x = layer.ffn_norm(x + layer.feed_forward(x))
        return F.linear(self.final_norm(x), self.head_weight, self.head_bias)  # (B, V)

    def _attend(self, layer: _Layer, h: Tensor, layer_cache, position: int, bias: Tensor | None) -> Tensor:
        """Self-attention of one new position: (B, d) -> (B, d), its keys and values cached."""
        B = h.size(0)
        heads = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(
            B, self.n_heads + 2 * self.n_kv_heads, 1, self.head_dim)  # (B, h + 2 h_kv, 1, d_k)
        if layer.rotary is not None:
            q_and_k, v = heads.split_with_sizes(self.q_and_k, 1)
            q, k = layer.rotary.rotate(q_and_k, position).split_with_sizes(self.q_k, 1)
        else:
            q, k, v = heads.split_with_sizes(self.q_k_v, 1)
        k, v = layer_cache.append_one(k, v)  # (B, h_kv, S, d_k)
        if bias is None:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.gqa)  # (B, h, 1, d_k)
        else:
            out = _fused(q, k, v, None, bias, 0.0, False)
        return F.linear(out.reshape(B, -1), layer.out_weight, layer.out_bias)  # heads merged: (B, h * d_k)
