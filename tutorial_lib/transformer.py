"""The encoder, the decoder and the encoder-decoder model (Vaswani et al., 2017).

Encoder layer: self-attention (padding mask) + FFN. Decoder layer: masked self-attention
(causal + padding mask) + cross-attention (queries from the target, keys and values from
the encoder output) + FFN. Either norm order, from the config.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, LayerKVCache, MultiHeadAttention, check_mask
from .checks import IdRange, check_id_tensor, check_id_values, check_ignore_index, check_number, check_vectors
from .config import ModelConfig
from .layers import (
    Embeddings,
    FeedForward,
    Residual,
    TransformerBlock,
    init_weights,
    make_norm,
    make_relative_bias,
    make_rotary,
    position_bias,
    refuse_unbuilt_parts,
    stack_weights,
)
from .masks import causal_mask, combine

# An encoder layer is the generic block: self-attention + FFN, each in a residual sublayer.
EncoderLayer = TransformerBlock


class StackOutput(NamedTuple):
    x: Tensor  # (B, T, d)
    weights: Tensor | None  # (L, B, h, T, S) when asked for


class Encoder(nn.Module):
    """A stack of encoder layers over vectors (B, S, d), with a final norm for pre-LN stacks.
    With ``positions="relative"`` the stack holds T5's bidirectional bias table, shared by its
    layers."""

    def __init__(self, cfg: ModelConfig, n_layers: int | None = None):
        super().__init__()
        refuse_unbuilt_parts(cfg, "encoder")
        self.cfg = cfg
        self.rotary = make_rotary(cfg)
        self.relative_bias = make_relative_bias(cfg, bidirectional=True)
        self.layers = nn.ModuleList(EncoderLayer(cfg, self.rotary)
                                    for _ in range(cfg.n_layers if n_layers is None else n_layers))
        self.final_norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()

    def _check_inputs(self, x: Tensor) -> None:
        """The input vectors' shape and dtype (metadata only); each layer checks the mask."""
        check_vectors("x", x, self.cfg.d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, need_weights: bool = False) -> StackOutput:
        """x: (B, S, d); mask: boolean, True = may attend, e.g. a (B, 1, 1, S) padding mask."""
        self._check_inputs(x)
        bias = position_bias(self.cfg, x.size(1), x.size(1), x.device, self.relative_bias)  # (1, h, S, S) or None
        weights = []
        for layer in self.layers:
            x, w, _ = layer(x, mask, bias=bias, need_weights=need_weights)  # no routing: encoders are dense
            weights.append(w)
        return StackOutput(self.final_norm(x), stack_weights(weights))


class DecoderLayerOutput(NamedTuple):
    x: Tensor  # (B, T, d)
    self_weights: Tensor | None  # (B, h, T, T)
    cross_weights: Tensor | None  # (B, h, T, S)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, FFN; each sublayer residual.

    The order matters: a position first gathers what the target says so far (self-attention),
    then uses that to ask the source a question (cross-attention), then transforms the answer
    (FFN).
    """

    def __init__(self, cfg: ModelConfig, rotary: nn.Module | None = None):
        super().__init__()
        refuse_unbuilt_parts(cfg, "layers")

        def attention(rot):
            return MultiHeadAttention(cfg.d_model, cfg.n_heads, n_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                      bias=cfg.uses_bias("qkv"), out_bias=cfg.uses_bias("out"),
                                      dropout=cfg.dropout, rotary=rot)

        self.self_attn = attention(rotary)
        self.cross_attn = attention(None)  # positions are the encoder's business (no RoPE, no bias)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.ffn, bias=cfg.uses_bias("ffn"), dropout=cfg.dropout)
        self.self_sublayer = Residual(make_norm(cfg), cfg.norm_order, cfg.dropout)
        self.cross_sublayer = Residual(make_norm(cfg), cfg.norm_order, cfg.dropout)
        self.ffn_sublayer = Residual(make_norm(cfg), cfg.norm_order, cfg.dropout)

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, *, is_causal: bool = True, bias: Tensor | None = None,
                cache: tuple[LayerKVCache, LayerKVCache] | None = None,
                need_weights: bool = False) -> DecoderLayerOutput:
        """x: (B, T, d) target vectors; memory: (B, S, d) encoder output. ``is_causal`` adds the
        causal mask to ``self_mask``; ``memory_mask`` is the source padding, (B, 1, 1, S)."""
        check_vectors("x", x, self.self_attn.d_model)
        check_vectors("memory", memory, self.cross_attn.d_model)
        self_cache, cross_cache = (None, None) if cache is None else cache
        self_w = cross_w = None

        def self_attend(h):
            nonlocal self_w
            out, self_w = self.self_attn(h, mask=self_mask, is_causal=is_causal, bias=bias,
                                         cache=self_cache, need_weights=need_weights)
            return out

        def cross_attend(h):
            nonlocal cross_w
            out, cross_w = self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache,
                                           need_weights=need_weights)
            return out

        x = self.self_sublayer(x, self_attend)
        x = self.cross_sublayer(x, cross_attend)
        x = self.ffn_sublayer(x, self.ffn)
        return DecoderLayerOutput(x, self_w, cross_w)


class DecoderCache:
    """What a decoder keeps between generation steps: per layer, the growing self-attention
    keys/values, and the cross-attention keys/values of the encoder output (computed once)."""

    def __init__(self, n_layers: int):
        self.self_attn = KVCache(n_layers)
        self.cross = KVCache(n_layers)

    def __len__(self) -> int:
        return len(self.self_attn)

    def __getitem__(self, i: int) -> tuple[LayerKVCache, LayerKVCache]:
        return self.self_attn[i], self.cross[i]


class DecoderOutput(NamedTuple):
    x: Tensor  # (B, T, d)
    self_weights: Tensor | None  # (L, B, h, T, T)
    cross_weights: Tensor | None  # (L, B, h, T, S)


class Decoder(nn.Module):
    """A stack of decoder layers, with a final norm for pre-LN stacks. With
    ``positions="relative"`` the stack holds T5's causal bias table, shared by its layers'
    self-attention (cross-attention gets no position bias)."""

    def __init__(self, cfg: ModelConfig, n_layers: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.rotary = make_rotary(cfg)
        self.relative_bias = make_relative_bias(cfg, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary)
                                    for _ in range(cfg.decoder_layers if n_layers is None else n_layers))
        self.final_norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()

    def _check_inputs(self, x: Tensor, memory: Tensor) -> None:
        """The target vectors' and the encoder output's shapes and dtypes (metadata only)."""
        check_vectors("x", x, self.cfg.d_model)
        check_vectors("memory", memory, self.cfg.d_model)

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, *, cache: DecoderCache | None = None,
                need_weights: bool = False) -> DecoderOutput:
        self._check_inputs(x, memory)
        offset = 0 if cache is None else len(cache)
        T = x.size(1)
        bias = position_bias(self.cfg, T, offset + T, x.device, self.relative_bias)  # (1, h, T, offset + T) or None
        self_ws, cross_ws = [], []
        for i, layer in enumerate(self.layers):
            x, sw, cw = layer(x, memory, self_mask, memory_mask, is_causal=True, bias=bias,
                              cache=None if cache is None else cache[i], need_weights=need_weights)
            self_ws.append(sw)
            cross_ws.append(cw)
        return DecoderOutput(self.final_norm(x), stack_weights(self_ws), stack_weights(cross_ws))


class Seq2SeqAttention(NamedTuple):
    encoder: Tensor  # (L_enc, B, h, S, S)
    decoder: Tensor  # (L_dec, B, h, T, T)
    cross: Tensor  # (L_dec, B, h, T, S)


class Seq2SeqOutput(NamedTuple):
    logits: Tensor  # (B, T, V)
    loss: Tensor | None
    attn: Seq2SeqAttention | None


class EncoderDecoder(nn.Module):
    """The encoder-decoder Transformer.

    ``frontend``: an optional module that replaces the source token embedding for continuous
    inputs, mapping (B, S, features) to (B, S, d_model) (for example a linear projection of
    audio frames); positions are added to its output as to token embeddings.
    """

    def __init__(self, cfg: ModelConfig, frontend: nn.Module | None = None):
        super().__init__()
        if cfg.family != "encoder-decoder":
            raise ValueError(f"EncoderDecoder needs family='encoder-decoder', got {cfg.family!r}")
        self.cfg = cfg
        self.frontend = frontend
        self.tgt_embed = Embeddings(cfg)
        if cfg.share_embeddings and frontend is not None:
            raise ValueError("share_embeddings needs token inputs on both sides, not a frontend")
        self.src_embed = Embeddings(cfg, 0 if frontend is not None else cfg.source_vocab_size)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)  # before tying, so a shared table is initialised once
        if cfg.share_embeddings:
            self.src_embed.tokens = self.tgt_embed.tokens
        if cfg.tie_embeddings:
            self.head.weight = self.tgt_embed.tokens.weight

    def encode(self, src: Tensor, src_mask: Tensor | None = None, *, need_weights: bool = False) -> StackOutput:
        """src: token ids (B, S), or features (B, S, F) with a frontend -> memory (B, S, d)."""
        self._check_src(src, src_mask)
        return self._encode(src, src_mask, need_weights, check_ids=True)

    def _check_src(self, src: Tensor, src_mask: Tensor | None) -> None:
        """Shapes and dtypes of the source and its padding mask (no tensor data is read)."""
        if self.frontend is not None:
            if not isinstance(src, Tensor) or src.dim() != 3 or not src.is_floating_point():
                got = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, Tensor) else type(src).__name__
                raise ValueError(f"with a frontend, src must be float features (B, S, F), got {got}")
        else:
            check_id_tensor("src", src, shape="(B, S)")
        if src_mask is not None:
            B, S = src.shape[:2]
            check_mask("src_mask", src_mask, (B, self.cfg.n_heads, 1, S), src.device)
            if src_mask.size(-2) != 1:
                raise ValueError(f"src_mask must be a key-padding mask (B, 1, 1, S={S}) (it serves the encoder's "
                                 f"queries and the decoder's alike), got shape {tuple(src_mask.shape)}")

    def _encode(self, src: Tensor, src_mask: Tensor | None, need_weights: bool, check_ids: bool) -> StackOutput:
        if self.frontend is not None:
            x = self.src_embed.add_positions(self.frontend(src), name="src")  # (B, S, d)
        else:
            x = self.src_embed(src, name="src", check_ids=check_ids)  # (B, S, d)
        return self.encoder(x, src_mask, need_weights=need_weights)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, *, cache: DecoderCache | None = None,
               need_weights: bool = False) -> DecoderOutput:
        """Decoder pass over target ids (B, T) given the encoder output; returns vectors (B, T, d).

        With ``cache``, tgt_in holds only the new positions: they sit at len(cache).., the
        self-attention keys/values grow in the cache, and the cross-attention keys/values of
        ``memory`` are projected on the first call and reused afterwards.
        """
        self._check_tgt(tgt_in, tgt_mask, 0 if cache is None else len(cache))
        return self._decode(tgt_in, memory, src_mask, tgt_mask, cache, need_weights, check_ids=True)

    def _check_tgt(self, tgt_in: Tensor, tgt_mask: Tensor | None, offset: int) -> None:
        check_id_tensor("tgt_in", tgt_in)
        if tgt_mask is not None:
            B, T = tgt_in.shape
            check_mask("tgt_mask", tgt_mask, (B, self.cfg.n_heads, T, offset + T), tgt_in.device)

    def _decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None, tgt_mask: Tensor | None,
                cache: DecoderCache | None, need_weights: bool, check_ids: bool) -> DecoderOutput:
        offset = 0 if cache is None else len(cache)
        y = self.tgt_embed(tgt_in, offset, name="tgt_in", check_ids=check_ids)  # (B, T, d)
        return self.decoder(y, memory, tgt_mask, src_mask, cache=cache, need_weights=need_weights)

    def new_cache(self) -> DecoderCache:
        return DecoderCache(len(self.decoder.layers))

    def _check_inputs(self, src: Tensor, tgt_in: Tensor, targets: Tensor | None, src_mask: Tensor | None,
                      tgt_mask: Tensor | None, ignore_index: int, label_smoothing: float) -> None:
        """Every argument check of :meth:`forward`: shapes, dtypes and settings from metadata,
        then the values of every id and target of the pass in one host sync."""
        self._check_src(src, src_mask)
        self._check_tgt(tgt_in, tgt_mask, 0)
        if src.size(0) != tgt_in.size(0):
            raise ValueError(f"src and tgt_in must hold the same examples, got batch sizes {src.size(0)} and "
                             f"{tgt_in.size(0)}")
        check_number("label_smoothing", label_smoothing, low=0.0, high=1.0, high_open=True)
        ranges = [IdRange("tgt_in", tgt_in, self.cfg.vocab_size)]
        if self.frontend is None:
            ranges.insert(0, IdRange("src", src, self.cfg.source_vocab_size))
        if targets is not None:
            check_id_tensor("targets", targets, what="target ids")
            if targets.shape != tgt_in.shape:
                raise ValueError(f"targets must have the shape of tgt_in {tuple(tgt_in.shape)}, "
                                 f"got {tuple(targets.shape)}")
            ranges.append(IdRange("targets", targets, self.cfg.vocab_size, check_ignore_index(ignore_index)))
        check_id_values(*ranges)  # one host sync for every id and target of the pass

    def forward(self, src: Tensor, tgt_in: Tensor, targets: Tensor | None = None, *,
                src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                ignore_index: int = -100, label_smoothing: float = 0.0,
                need_weights: bool = False) -> Seq2SeqOutput:
        """Teacher-forced pass. tgt_in: (B, T) target ids shifted right (BOS first); targets:
        (B, T) the ids to predict, ``ignore_index`` at padding. The causal mask is always
        applied; ``tgt_mask`` adds target padding, ``src_mask`` is the source padding."""
        self._check_inputs(src, tgt_in, targets, src_mask, tgt_mask, ignore_index, label_smoothing)
        memory, enc_w = self._encode(src, src_mask, need_weights, check_ids=False)  # checked above
        y, self_w, cross_w = self._decode(tgt_in, memory, src_mask, tgt_mask, None, need_weights, check_ids=False)
        logits = self.head(y)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index,
                                   label_smoothing=label_smoothing)
        attn = Seq2SeqAttention(enc_w, self_w, cross_w) if need_weights else None
        return Seq2SeqOutput(logits, loss, attn)


def seq2seq_masks(src_keep: Tensor, tgt_keep: Tensor) -> tuple[Tensor, Tensor]:
    """From keep flags (True = real token) of the source (B, S) and target input (B, T):
    the source padding mask (B, 1, 1, S) and the target self-attention mask (B, 1, T, T)
    (causal AND target padding)."""
    src_mask = src_keep[:, None, None, :]
    T = tgt_keep.size(1)
    tgt_mask = combine(causal_mask(T, device=tgt_keep.device), tgt_keep[:, None, None, :])
    return src_mask, tgt_mask
