"""A decoder-only language model: the GPT flavour and the LLaMA flavour from the same code.

GPT (Radford et al., 2019): learned positions, LayerNorm, GELU, biases, tied embeddings.
LLaMA (Touvron et al., 2023): RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases,
an untied output head. Which one you get is decided by the :class:`ModelConfig` alone.
With ``n_experts > 0`` the feed-forward networks become mixtures of experts
(:mod:`tutorial_lib.moe`, as in Mixtral), and the output carries their load-balancing loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, check_mask
from .checks import IdRange, check_id_tensor, check_id_values, check_ignore_index, check_length
from .config import ModelConfig
from .layers import (
    Embeddings,
    TransformerBlock,
    init_weights,
    make_norm,
    make_relative_bias,
    make_rotary,
    position_bias,
    stack_weights,
)
from .moe import MoEFeedForward, load_balancing_loss


class LMOutput(NamedTuple):
    logits: Tensor  # (B, T, V)
    loss: Tensor | None  # mean cross-entropy over targets != ignore_index
    attn: Tensor | None  # (L, B, h, T, S) when need_weights=True
    aux_loss: Tensor | None = None  # mixture of experts: load-balancing loss, mean over MoE layers


class DecoderOnlyLM(nn.Module):
    """Token ids -> next-token logits, with a causal mask (or the mask you give)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.family != "decoder":
            raise ValueError(f"DecoderOnlyLM needs family='decoder', got {cfg.family!r}")
        self.cfg = cfg
        self.embed = Embeddings(cfg)
        self.rotary = make_rotary(cfg)
        self.relative_bias = make_relative_bias(cfg, bidirectional=False)  # T5's bias, causal buckets
        moe = set(cfg.moe_layers)  # empty for a dense model
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg, self.rotary, ffn=MoEFeedForward(cfg) if i in moe else None)
            for i in range(cfg.n_layers))
        self.final_norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tokens.weight  # one matrix: embedding in, logits out

    def new_cache(self) -> KVCache:
        # room for max_len positions from the start: no cache is ever copied to grow it
        return KVCache(self.cfg.n_layers, capacity=self.cfg.max_len)

    def _check_inputs(self, ids: Tensor, targets: Tensor | None, mask: Tensor | None, offset: int,
                      ignore_index: int, check_ids: bool) -> None:
        """Every argument check of :meth:`forward`: shapes, dtypes and the context length from
        metadata, then the values of ids and targets in one host sync (:func:`check_id_values`).
        ``check_ids=False`` leaves out the checks of ``ids``, not those of targets or mask."""
        ranges = []
        if check_ids:
            check_id_tensor("ids", ids)
            check_length("ids", ids.size(1), self.cfg.max_len, offset)
            ranges.append(IdRange("ids", ids, self.cfg.vocab_size))
        B, T = ids.shape
        if targets is not None:
            check_id_tensor("targets", targets, what="target ids")
            if targets.shape != ids.shape:
                raise ValueError(f"targets must have the shape of ids {tuple(ids.shape)}, got {tuple(targets.shape)}")
            ranges.append(IdRange("targets", targets, self.cfg.vocab_size, check_ignore_index(ignore_index)))
        if mask is not None:
            check_mask("mask", mask, (B, self.cfg.n_heads, T, offset + T), ids.device)
        if ranges:
            check_id_values(*ranges)  # one host sync for ids and targets together

    def forward(self, ids: Tensor, targets: Tensor | None = None, *, cache: KVCache | None = None,
                need_weights: bool = False, mask: Tensor | None = None,
                ignore_index: int = -100, check_ids: bool = True) -> LMOutput:
        """ids: (B, T). targets: (B, T) next tokens, ``ignore_index`` where there is none.

        cache: a :class:`KVCache`; the ids then sit at positions len(cache).. and their keys
        and values are appended. mask: a boolean mask (True = may attend) broadcastable to
        (B, h, T, len(cache) + T) used *instead of* the causal mask (e.g. a prefix-LM mask).

        A mixture of experts also returns ``aux_loss``, the load-balancing loss of
        :func:`tutorial_lib.moe.load_balancing_loss` averaged over its MoE layers (computed over
        every position, with or without targets); ``loss`` stays the cross-entropy alone.
        Train on ``loss + coefficient * aux_loss`` (:func:`tutorial_lib.train.loss_with_aux`).

        ``check_ids=False`` skips the checks of ``ids`` (shape, dtype, length, values) for a
        caller that has made sure of them: :func:`tutorial_lib.sampling.generate` checks the
        prompt once, and every token it appends is an id by construction. The value check
        reads the ids on the host, a device sync at every decoding step otherwise.
        """
        offset = 0 if cache is None else len(cache)
        self._check_inputs(ids, targets, mask, offset, ignore_index, check_ids)
        T = ids.size(1)
        x = self.embed(ids, offset, check_ids=False)  # (B, T, d): ids checked above
        bias = position_bias(self.cfg, T, offset + T, x.device, self.relative_bias)  # (1, h, T, S): ALiBi, T5
        weights, balance = [], []
        layer_caches = [None] * len(self.blocks) if cache is None else cache.layers
        for block, layer_cache in zip(self.blocks, layer_caches):
            x, w, routing = block(x, mask, is_causal=mask is None, bias=bias, cache=layer_cache,
                                  need_weights=need_weights)
            weights.append(w)
            if routing is not None:
                balance.append(load_balancing_loss(routing.logits, self.cfg.experts_per_token))
        logits = self.head(self.final_norm(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)
        aux_loss = torch.stack(balance).mean() if balance else None
        return LMOutput(logits, loss, stack_weights(weights), aux_loss)
