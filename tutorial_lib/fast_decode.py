"""A cached decoding step of a decoder-only model, run as one function instead of through its
modules: ``generate(..., fast=True)``, a lesson on where a decoding step's time goes.

By default :func:`tutorial_lib.sampling.generate` runs every step through the model's own
modules, so what a learner reads, hooks and debugs is what runs. At batch 1 a cached step of
a small model does little arithmetic: a few matrix-vector products per layer. Through the
modules it costs about as much again in Python: about a dozen ``nn.Module`` calls per layer
(50 for the 4-layer tiny GPT), each with its argument checks, closures and named tuples, once
per token. :class:`FastDecoder` runs the same operations on the same weight tensors, in the
same order, with those costs taken out: the weights are looked up once, the ids are not
checked per step (generate checked the prompt, and every later token is an id the sampler
picked), and LLaMA's RMSNorm runs as :func:`rms_norm_steps`. What is left is the time of the
operations themselves; the difference to the module path is the price of the modules.

On a CPU the logits are bit-identical to ``model(token, cache=cache).logits[:, -1]``
(tests/test_fast_decode.py compares them for every kind of block this package builds, also
under bf16 autocast; on a GPU tests/test_cuda.py asks for float32 rounding). A model the
module path would treat differently gets no fast decoder (:func:`why_not_fast` says why,
:func:`fast_decoder` returns None, and ``generate(..., fast=True)`` raises a ValueError with
that reason rather than quietly running something else): one with a module in training mode
(dropout), a forward hook or pre-hook (probes, the NaN finder, a learner's print: FastDecoder
calls no modules, so a hook would never fire), a parametrized weight, a replaced or compiled
``forward``, or, in any place, a part other than the ones this package builds there (a
sublayer ablated with ``nn.Identity``, a learner's own attention).
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
from .layers import Embeddings, FeedForward, Residual, RMSNorm, TransformerBlock, position_bias, rms_norm
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


def _foreign_part(model: DecoderOnlyLM) -> tuple[str, object] | None:
    """(place, part) of the first part that is not the kind DecoderOnlyLM builds there (the
    parts whose computation FastDecoder repeats), or None when every place holds one."""
    embed = model.embed
    if not _is(embed, Embeddings):
        return "embed", embed
    if not (_is(embed.tokens, nn.Embedding) and embed.tokens.max_norm is None):
        return "embed.tokens", embed.tokens  # max_norm: the lookup would renormalise rows in place
    for place, part, types in (
            ("embed.positions", embed.positions, (type(None), LearnedPositions, SinusoidalPositions)),
            ("final_norm", model.final_norm, (*NORMS, nn.Identity)), ("head", model.head, (nn.Linear,)),
            ("blocks", model.blocks, (nn.ModuleList,))):
        if not _is(part, *types):
            return place, part
    for i, block in enumerate(model.blocks):
        foreign = _foreign_part_of_block(block)
        if foreign is not None:
            return f"blocks.{i}{foreign[0]}", foreign[1]
    return None


def _foreign_part_of_block(block: nn.Module) -> tuple[str, object] | None:
    """As :func:`_foreign_part`, for one block: ("", block), (".attn", ...), ..., or None."""
    if not _is(block, TransformerBlock):
        return "", block
    attn, ffn = block.attn, block.ffn
    if not _is(attn, MultiHeadAttention):
        return ".attn", attn
    for place, part, types in ((".attn.qkv", attn.qkv, (nn.Linear,)), (".attn.out", attn.out, (nn.Linear,)),
                               (".attn.rotary", attn.rotary, (type(None), RotaryEmbedding)),
                               (".attn_sublayer", block.attn_sublayer, (Residual,)),
                               (".ffn_sublayer", block.ffn_sublayer, (Residual,)),
                               (".attn_sublayer.norm", block.attn_sublayer.norm, NORMS),
                               (".ffn_sublayer.norm", block.ffn_sublayer.norm, NORMS)):
        if not _is(part, *types):
            return place, part
    if _is(ffn, MoEFeedForward):
        return None  # called as a module (its parts were checked by why_not_fast's loop)
    if not _is(ffn, FeedForward):
        return ".ffn", ffn
    for place, part in ((".ffn.up", ffn.up), (".ffn.down", ffn.down), *([(".ffn.gate", ffn.gate)] * ffn.gated)):
        if not _is(part, nn.Linear):
            return place, part
    return None


def why_not_fast(model: nn.Module) -> str | None:
    """Why FastDecoder cannot run ``model``'s steps (its modules would compute or report
    something it does not), as a phrase for an error message; None when it can."""
    if type(model) is not DecoderOnlyLM:
        return (f"it runs tutorial_lib's DecoderOnlyLM itself, and this model is a {type(model).__name__} "
                "(a subclass may compute something else)")
    for name in _GLOBAL_HOOKS:
        if getattr(module_internals, name, None):
            return ("a global module hook is registered (torch.nn.modules.module.register_module_forward_hook "
                    "or _pre_hook), which FastDecoder, calling no modules, would never run")
    for place, part in model.named_modules():
        place = place or "the model"
        kind = type(part)
        if parametrize.is_parametrized(part):
            return f"{place} has a parametrized weight, computed by its parametrization at every call"
        if kind not in _FORWARDS:
            return f"{place} is of type {kind.__name__}, a part FastDecoder does not know"
        if _FORWARDS[kind] is not kind.forward:
            return f"{kind.__name__}.forward was replaced after tutorial_lib was imported"
        if part.training:
            return f"{place} is in training mode (dropout is the modules' business)"
        if part._forward_hooks or part._forward_pre_hooks:
            return (f"{place} has a forward hook or pre-hook, which FastDecoder, calling no modules, "
                    "would never run")
        if "forward" in part.__dict__:
            return f"{place} has a forward of its own (replaced on the instance)"
        if getattr(part, "_compiled_call_impl", None) is not None:
            return f"{place} was compiled in place (Module.compile), so its modules run the compiled code"
    foreign = _foreign_part(model)
    if foreign is not None:
        place, part = foreign
        return (f"{place} is of type {type(part).__name__}{' with max_norm' if place == 'embed.tokens' else ''}, "
                "not the part DecoderOnlyLM builds there")
    return None


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """A :class:`FastDecoder` for ``model``, or None when its steps must go through the modules
    (:func:`why_not_fast` says why)."""
    return FastDecoder(model) if why_not_fast(model) is None else None


def rms_norm_steps(x: Tensor, weight: Tensor, width: Tensor, eps: Tensor) -> Tensor:
    """float32 :func:`~tutorial_lib.layers.rms_norm` written out as the operations torch's own
    runs on a CPU, in its order: x * rsqrt(sum(x^2) / width + eps) * weight, the same bits
    (tests/test_fast_decode.py). ``width`` (d) and ``eps`` are 0-dim float32 tensors made once by
    the caller: a Python number in an operation costs a conversion to a tensor at every call,
    and at one position per step that conversion costs more than the arithmetic (about 7 µs
    against 9 µs for torch's rms_norm; benchmarks/bench_norms.py)."""
    return x * x.pow(2).sum(-1, keepdim=True).div_(width).add_(eps).rsqrt_() * weight


def _norm(norm: nn.Module, plain_float32_cpu: bool) -> Callable[[Tensor], Tensor]:
    """The norm's forward on its own weights, without the module call and the width check.
    ``plain_float32_cpu``: float32 vectors on a CPU, no autocast; then RMSNorm runs as
    :func:`rms_norm_steps`, the same bits as torch's rms_norm there and
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
    makes one per call). The token's position must lie below max_len: generate refills the
    cache through the modules when the context reaches it.
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
        k, v = layer_cache.append(k, v)  # (B, h_kv, S, d_k)
        if bias is None:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=layer.grouped)  # (B, h, 1, d_k)
        else:
            out = fused_attention_unchecked(q, k, v, None, bias, 0.0, False)
        return F.linear(out.reshape(B, -1), layer.out_weight, layer.out_bias)  # heads merged: (B, h * d_k)
