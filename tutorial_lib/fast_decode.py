"""A cached decoding step of a decoder-only model, run as one function instead of through its modules.

At batch 1 a cached step of a small model does little arithmetic: a few matrix-vector products
per layer. Through the modules it costs about as much again in Python: about a dozen
``nn.Module`` calls per layer (50 for the 4-layer tiny GPT), each with its argument checks,
closures and named tuples, once per token. :class:`FastDecoder` runs the same operations on
the same weight tensors, in the same order, with those costs taken out: the weights are looked
up once, the shapes of the new keys and values are not checked again before they are cached,
and the ids are not checked per step (generate checked the prompt, and every later token is an
id the sampler picked).

On a CPU the logits are bit-identical to ``model(token, cache=cache).logits[:, -1]``
(tests/test_fast_decode.py compares them for every kind of block this package builds, also
under bf16 autocast; on a GPU tests/test_cuda.py asks for float32 rounding). A model the
module path would treat differently gets no fast decoder (:func:`fast_decoder` returns None
and :func:`tutorial_lib.sampling.generate` calls the modules): one with a module in training
mode (dropout), a forward hook or pre-hook (probes, the NaN finder, a learner's print), a
parametrized weight, a replaced or compiled ``forward``, or, in any place, a part other than
the ones this package builds there (a sublayer ablated with ``nn.Identity``, a learner's own
attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_internals
from torch.nn.utils import parametrize

from .attention import KVCache, LayerKVCache, MultiHeadAttention, fused_attention_unchecked
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

NORMS = (nn.LayerNorm, RMSNorm)
# Every class that may appear in a model FastDecoder runs, with the forward it had at import:
# a forward patched on the class afterwards would change the module path and not this one.
_FORWARDS = {cls: cls.forward for cls in (
    DecoderOnlyLM, Embeddings, nn.Embedding, LearnedPositions, SinusoidalPositions, RotaryEmbedding,
    RelativePositionBias, nn.ModuleList, TransformerBlock, MultiHeadAttention, nn.Linear, FeedForward,
    MoEFeedForward, Residual, nn.LayerNorm, RMSNorm, nn.Dropout, nn.Identity)}
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")


def _is(part, *types) -> bool:
    return type(part) in types


def _built_here(model: DecoderOnlyLM) -> bool:
    """True when every place of the model holds the kind of part DecoderOnlyLM builds there,
    the parts whose computation FastDecoder repeats."""
    embed = model.embed
    if not (_is(embed, Embeddings) and _is(embed.tokens, nn.Embedding) and embed.tokens.max_norm is None
            and (embed.positions is None or _is(embed.positions, LearnedPositions, SinusoidalPositions))
            and _is(model.final_norm, *NORMS, nn.Identity) and _is(model.head, nn.Linear)
            and _is(model.blocks, nn.ModuleList)):
        return False
    return all(_block_built_here(block) for block in model.blocks)


def _block_built_here(block: nn.Module) -> bool:
    if not (_is(block, TransformerBlock) and _is(block.attn, MultiHeadAttention)):
        return False
    attn, ffn, sublayers = block.attn, block.ffn, (block.attn_sublayer, block.ffn_sublayer)
    if not (_is(attn.qkv, nn.Linear) and _is(attn.out, nn.Linear)
            and (attn.rotary is None or _is(attn.rotary, RotaryEmbedding))
            and all(_is(sublayer, Residual) and _is(sublayer.norm, *NORMS) for sublayer in sublayers)):
        return False
    if _is(ffn, MoEFeedForward):
        return True  # called as a module (its parts were checked by fast_decoder's loop)
    return (_is(ffn, FeedForward) and _is(ffn.up, nn.Linear) and _is(ffn.down, nn.Linear)
            and (not ffn.gated or _is(ffn.gate, nn.Linear)))


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """A :class:`FastDecoder` for ``model``, or None when its steps must go through the modules
    (see the module's docstring for when)."""
    if type(model) is not DecoderOnlyLM or any(getattr(module_internals, name, None) for name in _GLOBAL_HOOKS):
        return None
    for part in model.modules():
        if (_FORWARDS.get(type(part)) is not type(part).forward or part.training
                or part._forward_hooks or part._forward_pre_hooks or "forward" in part.__dict__
                or getattr(part, "_compiled_call_impl", None) is not None or parametrize.is_parametrized(part)):
            return None
    return FastDecoder(model) if _built_here(model) else None


def _norm(norm: nn.Module, plain_float32_cpu: bool) -> Callable[[Tensor], Tensor]:
    """The norm's forward on its own weights, without the module call and the width check.
    ``plain_float32_cpu``: float32 vectors on a CPU, no autocast; then RMSNorm runs as
    :func:`~tutorial_lib.layers.rms_norm_steps`, the same bits as torch's rms_norm there and
    faster for one position (a GPU has a fused rms_norm kernel, which computes otherwise)."""
    if type(norm) is nn.LayerNorm:
        shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    if type(norm) is RMSNorm:
        weight, eps = norm.weight, norm.eps
        if plain_float32_cpu and weight.dtype == torch.float32:
            width, eps_tensor = (torch.tensor(float(value)) for value in (weight.size(0), eps))  # made once
            return lambda x: rms_norm_steps(x, weight, width, eps_tensor)
        return lambda x: rms_norm(x, weight, eps)
    return lambda x: x  # nn.Identity: a post-LN stack has no final norm


class _Layer:
    """What one block's step reads, looked up once: norms and their order, weights, head counts."""

    def __init__(self, block: TransformerBlock, plain_float32_cpu: bool):
        attn, ffn = block.attn, block.ffn
        self.attn_first_norm = block.attn_sublayer.order == "pre"  # else norm after the residual sum
        self.ffn_first_norm = block.ffn_sublayer.order == "pre"
        self.attn_norm = _norm(block.attn_sublayer.norm, plain_float32_cpu)
        self.ffn_norm = _norm(block.ffn_sublayer.norm, plain_float32_cpu)
        self.qkv_weight, self.qkv_bias = attn.qkv.weight, attn.qkv.bias
        self.out_weight, self.out_bias = attn.out.weight, attn.out.bias
        self.rotary = attn.rotary
        h, h_kv = attn.n_heads, attn.n_kv_heads
        self.heads_shape = (h + 2 * h_kv, 1, attn.head_dim)  # queries, keys, values of one position
        # head counts along dim 1 for split_with_sizes: with RoPE, queries and keys are rotated
        # together and split afterwards
        self.heads_qk_v, self.heads_q_k, self.heads_q_k_v = [h + h_kv, h_kv], [h, h_kv], [h, h_kv, h_kv]
        self.grouped = h != h_kv
        self.moe = ffn if type(ffn) is MoEFeedForward else None  # called as a module: its routing varies
        if self.moe is None:
            self.act = ffn.act
            self.gate = (ffn.gate.weight, ffn.gate.bias) if ffn.gated else None
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

    One decoder serves one generation: it holds the weight tensors it found when it was made,
    so a model moved or cast afterwards (``.to``, ``.double()``) needs a new one (generate
    makes one per call). The cache must have room for the token (generate refills it through
    the modules when the context reaches max_len); nothing here checks that: it is the hot
    loop of :func:`tutorial_lib.sampling.generate`, which guarantees it.
    """

    def __init__(self, model: DecoderOnlyLM):
        cfg = model.cfg
        self.cfg = cfg
        embed = model.embed
        self.token_table, self.padding_idx = embed.tokens.weight, embed.tokens.padding_idx
        self.scale = embed.scale
        if embed.positions is None:
            self.position_table = None  # RoPE, ALiBi, T5's bias: positions act inside attention
        elif type(embed.positions) is LearnedPositions:
            self.position_table = embed.positions.embedding.weight  # (max_len, d)
        else:
            self.position_table = embed.positions.table  # sinusoidal, (max_len, d)
        self.relative_bias = model.relative_bias
        self.biased = cfg.positions in ("alibi", "relative")  # a score bias per step (see position_bias)
        # the residual stream keeps the token table's dtype; autocast would change what the
        # norms' operations compute in
        table = self.token_table
        plain_float32_cpu = (table.dtype == torch.float32 and table.device.type == "cpu"
                             and not torch.is_autocast_enabled("cpu"))
        self.layers = [_Layer(block, plain_float32_cpu) for block in model.blocks]
        self.final_norm = _norm(model.final_norm, plain_float32_cpu)
        self.head_weight, self.head_bias = model.head.weight, model.head.bias

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
            if layer.attn_first_norm:
                x = x + self._attend(layer, layer.attn_norm(x), layer_cache, position, bias)
            else:
                x = layer.attn_norm(x + self._attend(layer, x, layer_cache, position, bias))
            if layer.ffn_first_norm:
                x = x + layer.feed_forward(layer.ffn_norm(x))
            else:
                x = layer.ffn_norm(x + layer.feed_forward(x))
        return F.linear(self.final_norm(x), self.head_weight, self.head_bias)  # (B, V)

    @staticmethod
    def _attend(layer: _Layer, h: Tensor, layer_cache: LayerKVCache, position: int, bias: Tensor | None) -> Tensor:
        """Self-attention of one new position: (B, d) -> (B, d), its keys and values cached."""
        B = h.size(0)
        heads = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(B, *layer.heads_shape)  # (B, h + 2 h_kv, 1, d_k)
        if layer.rotary is not None:
            q_and_k, v = heads.split_with_sizes(layer.heads_qk_v, 1)
            q, k = layer.rotary.rotate(q_and_k, position).split_with_sizes(layer.heads_q_k, 1)
        else:
            q, k, v = heads.split_with_sizes(layer.heads_q_k_v, 1)
        k, v = layer_cache.append_one(k, v)  # (B, h_kv, S, d_k)
        if bias is None:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=layer.grouped)  # (B, h, 1, d_k)
        else:
            out = fused_attention_unchecked(q, k, v, None, bias, 0.0, False)
        return F.linear(out.reshape(B, -1), layer.out_weight, layer.out_bias)  # heads merged: (B, h * d_k)
