"""How many parameters a Transformer has, and what they cost: memory for the weights, for
training and for the KV cache, and floating-point operations per token.

:func:`expected_parameters` counts from a :class:`ModelConfig` alone, with integer arithmetic
(nothing is allocated, so a 70B config takes microseconds); :func:`count_parameters` measures
a built model. Both return the same breakdown, one key per component, summed over the layers
of a stack, plus ``"total"``:

    embed.tokens, embed.positions            token table, learned position table (0 otherwise)
    embed.source_tokens, embed.source_positions   encoder-decoder: the source side (0 when shared)
    embed.token_types, embed.norm            encoder (BERT): token-type table, embedding norm
    <stack>.attn.q / .k / .v / .o            self-attention projections with their biases;
                                             K and V have n_kv_heads heads (grouped-query)
    decoder.cross.q / .k / .v / .o           encoder-decoder: cross-attention
    <stack>.ffn.up / .gate / .down           feed-forward matrices and biases (gate: 0 unless gated);
                                             in a mixture of experts, those of its dense layers only
    <stack>.norms                            the norms inside the layers
    <stack>.position_bias                    T5's relative-position table, one per stack
    <stack>.final_norm                       the norm after the last layer (pre-LN stacks)
    head                                     output projection, 0 when tied to embed.tokens
    pooler                                   encoder (BERT): dense layer over the first position

``<stack>`` is ``decoder`` for decoder-only models, ``encoder`` for encoders, both for
encoder-decoder models. Configs with the parts below get their keys as well:

    decoder.ffn.router                       mixture of experts: the routers (d x E each)
    decoder.ffn.experts.up / .gate / .down   ... the routed experts, all of them
    decoder.ffn.shared.up / .gate / .down    ... the shared experts
    decoder.ffn.shared_gate                  ... Qwen2-MoE's gate on the shared expert (d x 1)
    decoder.attn.qk_norm                     Qwen3: the norms of queries and keys (2 d_k a layer)
    decoder.attn.q_a / .q_norm / .q_b        latent attention (DeepSeek): the query's down-
                                             projection, its norm and up-projection (or .q when
                                             the query is not compressed)
    decoder.attn.kv_a / .kv_norm / .kv_b     ... the key/value latent (plus the shared RoPE key),
                                             its norm, and the up-projection to keys and values

A mixture of experts has two sizes, and its breakdown two summary keys:

    "total"    every parameter the model holds: what memory for the weights is sized by.
    "active"   the parameters one token's computation uses: the embeddings, the attention,
               the norms, the dense layers, and in each MoE layer its router, the
               experts_per_token routed experts the token goes to and the shared experts, and
               the head. That is the total less (n_experts - experts_per_token) routed experts
               in every MoE layer; the compute per token follows it. (The embedding table is
               counted whole, as the published figures do, although a token reads one row.)

Run ``python -m tutorial_lib.params config.json`` for the table.

**Configs that only count.** Every function here takes a :class:`~tutorial_lib.config.ModelConfig`,
the config a model is built from. Published models also have parts that tutorial_lib counts
but does not build: BERT's token-type table, embedding norm and pooler; Qwen3's norms on each
head's queries and keys; DeepSeek's multi-head latent attention and multi-token-prediction
modules. Their fields are those of :class:`CountedConfig`, a ModelConfig subclass defined
here, where counting is described, and nowhere in the config a model is built from. So a
model's constructor never receives a field it cannot build: given a CountedConfig that asks
for such a part, it raises a ValueError naming the fields
(:meth:`CountedConfig.unbuilt_parts`), and a ModelConfig has no such field to ask with.
:func:`tutorial_lib.hf_config.from_hf_config` returns a CountedConfig only when the
``config.json`` needs one of these fields, a ModelConfig otherwise. The published shapes that
need one are the presets :data:`BERT_BASE`, :data:`QWEN3_30B_A3B` and :data:`DEEPSEEK_V3`;
:data:`PRESETS` is every preset that can be counted (those of tutorial_lib.config and these).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from . import config as C
from .checks import check_count
from .config import Derived, ModelConfig
from .moe import MoEFeedForward

# ---- configs that count parts tutorial_lib does not build --------------------------------------


@dataclass(frozen=True)
class CountedConfig(ModelConfig):
    """A ModelConfig with the parts of published models that tutorial_lib counts but does not
    build (see the module docstring). Every field left at its default describes a model that
    can be built; the model classes refuse a CountedConfig that sets one of them.

    BERT (``family="encoder"`` only): ``type_vocab_size`` rows of a token-type (segment) table,
    ``embedding_norm`` (a norm over the summed embeddings) and ``pooler`` (a dense + tanh layer
    over the first position).

    ``qk_norm`` (decoder-only): an RMSNorm over each head's queries and keys, one weight vector
    of head_dim shared by the heads, as in Qwen3.

    Multi-head latent attention (DeepSeek-V2/V3, decoder-only with RoPE), switched on by
    ``kv_lora_rank``: keys and values are rebuilt per head from one compressed latent of
    ``kv_lora_rank`` values per token, queries from one of ``q_lora_rank`` (None: a full-rank
    W_Q), and each query and key head adds ``rope_head_dim`` rotary dimensions (the key's
    shared by all heads) to its ``head_dim`` plain ones. Value heads are ``v_head_dim`` wide:
    left out it is head_dim, held as a Derived int as head_dim is (one name for the value
    width). ``mtp_modules`` counts DeepSeek-V3's multi-token-prediction modules, which sit
    outside the model that predicts the next token (:func:`mtp_parameters`).
    """

    type_vocab_size: int = 0  # BERT's token-type (segment) table; 0: none
    embedding_norm: bool = False  # a norm over the summed embeddings (BERT)
    pooler: bool = False  # BERT's dense + tanh layer over the first position
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys
    kv_lora_rank: int | None = None  # multi-head latent attention: width of the key/value latent
    q_lora_rank: int | None = None  # ... width of the query latent; None: a full-rank W_Q
    rope_head_dim: int = 0  # ... rotary dimensions added to each query and key head
    v_head_dim: int | None = None  # width of a value head; None: head_dim, held as a Derived int
    mtp_modules: int = 0  # DeepSeek-V3's multi-token-prediction modules (outside the total)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("embedding_norm", "pooler", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("type_vocab_size", "mtp_modules"):
            check_count(name, getattr(self, name), 0)
        if self.family != "encoder" and (self.type_vocab_size or self.embedding_norm or self.pooler):
            raise ValueError("type_vocab_size, embedding_norm and pooler describe BERT-style encoders "
                             f"(family='encoder'), not family={self.family!r}")
        if self.qk_norm and self.family != "decoder":
            raise ValueError(f"qk_norm is counted for decoder-only models, not family={self.family!r}")
        self._check_latent_attention()

    def _check_rope(self) -> None:
        if self.kv_lora_rank is None:  # latent attention rotates rope_head_dim dimensions instead
            super()._check_rope()

    def _check_latent_attention(self) -> None:
        given_v = self.v_head_dim is not None and not isinstance(self.v_head_dim, Derived)
        if self.kv_lora_rank is None:
            if self.q_lora_rank is not None or self.rope_head_dim or given_v:
                raise ValueError("q_lora_rank, rope_head_dim and v_head_dim describe multi-head latent "
                                 "attention; give kv_lora_rank as well")
        else:
            for name in ("kv_lora_rank", "q_lora_rank", "v_head_dim"):
                check_count(name, getattr(self, name), optional=True)
            if check_count("rope_head_dim", self.rope_head_dim, 0) % 2:
                raise ValueError(f"rope_head_dim must be even (RoPE rotates pairs of dimensions), "
                                 f"got {self.rope_head_dim}")
            if self.family != "decoder" or self.positions != "rope":
                raise ValueError("multi-head latent attention (kv_lora_rank) is counted for decoder-only models "
                                 f"with positions='rope', got family={self.family!r}, positions={self.positions!r}")
            if self.kv_heads != self.n_heads:
                raise ValueError("multi-head latent attention rebuilds keys and values for every head: leave "
                                 f"n_kv_heads unset (got {self.n_kv_heads} for {self.n_heads} heads)")
            if self.uses_bias("qkv") or self.uses_bias("out"):
                raise ValueError("multi-head latent attention is counted without attention biases: set "
                                 "qkv_bias=False and out_bias=False")
        if not given_v:  # not given: the value heads are as wide as the query and key heads
            object.__setattr__(self, "v_head_dim", Derived(self.head_dim))

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of (grouped-query) attention."""
        return self.kv_lora_rank is not None

    def unbuilt_parts(self) -> list[str]:
        parts = {
            "type_vocab_size": f"type_vocab_size={self.type_vocab_size} (BERT's token-type table)",
            "embedding_norm": "embedding_norm=True (BERT's embedding norm)",
            "pooler": "pooler=True (BERT's dense + tanh layer over the first position)",
            "qk_norm": "qk_norm=True (Qwen3's norm on each head's queries and keys)",
            "kv_lora_rank": f"kv_lora_rank={self.kv_lora_rank} (DeepSeek's multi-head latent attention)",
            "mtp_modules": f"mtp_modules={self.mtp_modules} (DeepSeek-V3's multi-token-prediction modules)",
        }
        return [text for name, text in parts.items() if getattr(self, name)]


COUNTED_FIELDS = tuple(f.name for f in fields(CountedConfig) if f.name not in {g.name for g in fields(ModelConfig)})


def counted(cfg: ModelConfig) -> CountedConfig:
    """``cfg`` as a CountedConfig: itself if it is one, else the same model with none of the
    counted-only parts (what every counting function here reads)."""
    if isinstance(cfg, CountedConfig):
        return cfg
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"expected a ModelConfig, got {type(cfg).__name__}")
    return CountedConfig(**cfg.to_dict())


# ---- presets with parts that are counted, not built ---------------------------------------------
# Each is what tutorial_lib.hf_config.from_hf_config reads from the model's config.json (tests check it).

# BERT-base (Devlin et al., 2019; "google-bert/bert-base-uncased" config.json), without task head.
BERT_BASE = CountedConfig(
    family="encoder", vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_len=512,
    norm="layernorm", norm_eps=1e-12, norm_order="post", ffn="gelu", positions="learned", bias=True,
    type_vocab_size=2, embedding_norm=True, pooler=True,
)

# Qwen3-30B-A3B ("Qwen/Qwen3-30B-A3B" config.json): 128 narrow experts, 8 per token, no shared one.
QWEN3_30B_A3B = CountedConfig(
    family="decoder", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    d_ff=6144, max_len=40960, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", positions="rope", rope_base=1e6,
    bias=False, tie_embeddings=False, n_experts=128, experts_per_token=8, expert_d_ff=768, qk_norm=True,
)

# DeepSeek-V3 (DeepSeek-AI, 2024; "deepseek-ai/DeepSeek-V3" config.json): multi-head latent
# attention, 3 dense layers, then 256 routed experts (8 per token) and 1 shared in each layer.
DEEPSEEK_V3 = CountedConfig(
    family="decoder", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, head_dim=128, d_ff=18432,
    max_len=163840, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", positions="rope", rope_base=10000.0, bias=False,
    tie_embeddings=False, n_experts=256, experts_per_token=8, expert_d_ff=2048, n_shared_experts=1,
    dense_layers=(0, 1, 2), kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128, mtp_modules=1,
)

# Every preset that can be counted (the command line takes these names).
PRESETS = C.PRESETS | {"bert-base": BERT_BASE, "qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3}

# ---- counting from the config ---------------------------------------------------------------


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _norm(cfg: ModelConfig) -> int:
    """One norm over d_model features: a scale, and a shift for LayerNorm with bias."""
    return cfg.d_model * (2 if cfg.uses_bias("norm") else 1)


def _latent_attention(cfg: ModelConfig, prefix: str) -> dict[str, int]:
    """Multi-head latent attention (DeepSeek-V2, section 2.1): queries and keys of h heads of
    d_k plain + rope_head_dim rotary dimensions, values of v_head_dim; keys and values come up
    from one latent of kv_lora_rank per token, whose down-projection also makes the rotary key
    that all heads share; queries come up from a latent of q_lora_rank (or straight from x)."""
    d, h, rope = cfg.d_model, cfg.n_heads, cfg.rope_head_dim
    qk_width, kv_rank = h * (cfg.head_dim + rope), cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        counts = {f"{prefix}.q": d * qk_width}
    else:  # RMSNorm on the query latent: a scale of q_lora_rank
        counts = {f"{prefix}.q_a": d * cfg.q_lora_rank, f"{prefix}.q_norm": cfg.q_lora_rank,
                  f"{prefix}.q_b": cfg.q_lora_rank * qk_width}
    return counts | {f"{prefix}.kv_a": d * (kv_rank + rope), f"{prefix}.kv_norm": kv_rank,
                     f"{prefix}.kv_b": kv_rank * h * (cfg.head_dim + cfg.v_head_dim),
                     f"{prefix}.o": h * cfg.v_head_dim * d}


def _attention(cfg: ModelConfig, prefix: str) -> dict[str, int]:
    if cfg.latent_attention:
        return _latent_attention(cfg, prefix)
    d, qkv_bias = cfg.d_model, cfg.uses_bias("qkv")
    q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim  # grouped-query: kv_heads <= n_heads
    counts = {f"{prefix}.q": _linear(d, q_width, qkv_bias), f"{prefix}.k": _linear(d, kv_width, qkv_bias),
              f"{prefix}.v": _linear(d, kv_width, qkv_bias), f"{prefix}.o": _linear(q_width, d, cfg.uses_bias("out"))}
    if cfg.qk_norm:  # Qwen3: one RMSNorm scale of d_k for queries, one for keys, shared by the heads
        counts[f"{prefix}.qk_norm"] = 2 * cfg.head_dim
    return counts


def _ffn(cfg: ModelConfig, width: int, prefix: str) -> dict[str, int]:
    """A feed-forward network of inner width ``width``: up, gate (0 unless gated), down."""
    d, bias = cfg.d_model, cfg.uses_bias("ffn")
    return {f"{prefix}.up": _linear(d, width, bias), f"{prefix}.gate": _linear(d, width, bias) if cfg.gated else 0,
            f"{prefix}.down": _linear(width, d, bias)}


def expert_parameters(cfg: ModelConfig) -> int:
    """The parameters of one routed expert (an FFN of width ``cfg.expert_dim``)."""
    return sum(_ffn(cfg, cfg.expert_dim, "ffn").values())


def block_parameters(cfg: ModelConfig, cross_attention: bool = False, *, moe: bool = False) -> dict[str, int]:
    """The parameters of one layer: self-attention, cross-attention when asked for (a decoder
    layer of an encoder-decoder model), the feed-forward network and the norms, and "total".
    ``moe=True``: a mixture-of-experts layer of the config (router, routed and shared experts)."""
    cfg = counted(cfg)
    if moe and not cfg.n_experts:
        raise ValueError("moe=True needs a config with n_experts > 0")
    counts = _attention(cfg, "attn")
    if cross_attention:
        counts |= _attention(cfg, "cross")
    if not moe:
        counts |= _ffn(cfg, cfg.ffn_dim, "ffn")
    else:
        d, E = cfg.d_model, cfg.n_experts
        counts["ffn.router"] = d * E
        counts |= {key: E * n for key, n in _ffn(cfg, cfg.expert_dim, "ffn.experts").items()}
        shared = _ffn(cfg, cfg.n_shared_experts * cfg.shared_dim, "ffn.shared")
        counts |= {key: n if cfg.n_shared_experts else 0 for key, n in shared.items()}
        counts["ffn.shared_gate"] = d if cfg.shared_expert_gate else 0
    counts["norms"] = (3 if cross_attention else 2) * _norm(cfg)
    counts["total"] = sum(counts.values())
    return counts


def _stacks(cfg: ModelConfig) -> list[tuple[str, int, bool]]:
    """(name, number of layers, has cross-attention) for each stack of the model."""
    if cfg.family == "encoder-decoder":
        return [("encoder", cfg.n_layers, False), ("decoder", cfg.decoder_layers, True)]
    return [(cfg.family, cfg.n_layers, False)]


def _stack_layers(cfg: ModelConfig, stack: str, n_layers: int, cross: bool) -> dict[str, int]:
    """One stack's layers summed, key by key (without "total"): dense layers, and for a
    mixture of experts its MoE layers too (the dense layers' ffn keys stay, 0 when none)."""
    n_moe = len(cfg.moe_layers)
    kinds = [(n_layers - n_moe, False), (n_moe, True)] if n_moe else [(n_layers, False)]
    counts: dict[str, int] = {}
    for n, moe in kinds:
        for key, value in block_parameters(cfg, cross, moe=moe).items():
            if key != "total":
                counts[f"{stack}.{key}"] = counts.get(f"{stack}.{key}", 0) + n * value
    counts[f"{stack}.norms"] = counts.pop(f"{stack}.norms")  # listed after the feed-forward keys
    return counts


def expected_parameters(cfg: ModelConfig) -> dict[str, int]:
    """The parameter count of the model ``cfg`` describes, by component (see the module
    docstring for the keys), computed from the config alone. Tied matrices count once.

    ``"total"`` sums the components. A mixture of experts also gets ``"active"``: the
    parameters one token's forward pass uses (the module docstring defines it)."""
    cfg = counted(cfg)  # a ModelConfig is counted as a CountedConfig without the counted-only parts
    d = cfg.d_model
    positions = cfg.max_len * d if cfg.positions == "learned" else 0  # sinusoidal: computed, not learned
    counts: dict[str, int] = {}
    if cfg.family == "encoder-decoder":
        counts["embed.source_tokens"] = 0 if cfg.share_embeddings else cfg.source_vocab_size * d
        counts["embed.source_positions"] = positions
    counts["embed.tokens"] = cfg.vocab_size * d
    counts["embed.positions"] = positions
    if cfg.family == "encoder":
        counts["embed.token_types"] = cfg.type_vocab_size * d
        counts["embed.norm"] = _norm(cfg) if cfg.embedding_norm else 0
    for stack, n_layers, cross in _stacks(cfg):
        counts |= _stack_layers(cfg, stack, n_layers, cross)
        # T5: one learned bias per (bucket, head), shared by the stack's self-attention layers
        counts[f"{stack}.position_bias"] = cfg.relative_buckets * cfg.n_heads if cfg.positions == "relative" else 0
        counts[f"{stack}.final_norm"] = _norm(cfg) if cfg.has_final_norm else 0
    if cfg.family == "encoder":
        counts["pooler"] = _linear(d, d, True) if cfg.pooler else 0
    else:
        counts["head"] = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    counts["total"] = sum(counts.values())
    if cfg.n_experts:  # each token skips all but experts_per_token routed experts in every MoE layer
        unused = (cfg.n_experts - cfg.experts_per_token) * expert_parameters(cfg)
        counts["active"] = counts["total"] - len(cfg.moe_layers) * unused
    return counts


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass uses: ``expected_parameters(cfg)["active"]`` for a
    mixture of experts, the total for a dense model."""
    counts = expected_parameters(cfg)
    return counts.get("active", counts["total"])


def mtp_parameters(cfg: ModelConfig) -> dict[str, int]:
    """DeepSeek-V3's multi-token-prediction (MTP) modules, which its checkpoint holds besides
    the main model (DeepSeek-V3 report, section 2.2; the repository's README_WEIGHTS.md). Each
    predicts one token further ahead from the main model's last hidden state and the next
    token's embedding: two RMSNorms (``enorm``, ``hnorm``), a projection ``eh_proj`` from the
    two concatenated (2d -> d), one transformer layer like the main model's MoE layers, and a
    final RMSNorm. Its embedding table and output head are the main model's (shared), so they
    are not counted here. ``transformers`` does not build these modules; they are not in
    :func:`expected_parameters`. Keys: "layer", "projection", "norms", "total"."""
    cfg = counted(cfg)
    if not cfg.mtp_modules:
        raise ValueError("this config has no multi-token-prediction modules (mtp_modules=0)")
    layer = block_parameters(cfg, moe=bool(cfg.n_experts))["total"]
    counts = {"layer": cfg.mtp_modules * layer, "projection": cfg.mtp_modules * 2 * cfg.d_model * cfg.d_model,
              "norms": cfg.mtp_modules * 3 * _norm(cfg)}
    counts["total"] = sum(counts.values())
    return counts


SUMMARY_KEYS = ("total", "active")  # breakdown keys that are not components

GROUPS = ("embeddings", "attention", "feed-forward", "norms", "head")


def group_of(key: str) -> str:
    """Which of :data:`GROUPS` a breakdown key belongs to (for plots and summaries)."""
    if key == "embed.norm" or key.endswith(("norms", "final_norm")):
        return "norms"
    if key.startswith("embed."):
        return "embeddings"
    if ".attn." in key or ".cross." in key or key.endswith("position_bias"):
        return "attention"
    if ".ffn." in key:
        return "feed-forward"
    if key in ("head", "pooler", "frontend"):
        return "head"
    raise ValueError(f"unknown breakdown key {key!r}")


def grouped(counts: dict[str, int]) -> dict[str, int]:
    """A breakdown summed into :data:`GROUPS` (embeddings, attention, feed-forward, norms, head)."""
    out = dict.fromkeys(GROUPS, 0)
    for key, n in counts.items():
        if key not in SUMMARY_KEYS:
            out[group_of(key)] += n
    return out


# ---- measuring a built model ----------------------------------------------------------------

_STACK = r"(?P<stack>blocks|encoder\.layers|decoder\.layers)\.\d+"
_RULES = [
    (re.compile(r"(?:embed|tgt_embed)\.tokens\."), "embed.tokens"),
    (re.compile(r"(?:embed|tgt_embed)\.positions\."), "embed.positions"),
    (re.compile(r"src_embed\.tokens\."), "embed.source_tokens"),
    (re.compile(r"src_embed\.positions\."), "embed.source_positions"),
    (re.compile(_STACK + r"\.(?P<attn>attn|self_attn|cross_attn)\.(?P<proj>qkv|out)\."), "{stack}.{attn}"),
    (re.compile(_STACK + r"\.ffn\.(?P<part>up|gate|down)\."), "{stack}.ffn.{part}"),
    (re.compile(_STACK + r"\.ffn\.experts\.\d+\.(?P<part>up|gate|down)\."), "{stack}.ffn.experts.{part}"),
    (re.compile(_STACK + r"\.ffn\.shared\.(?P<part>up|gate|down)\."), "{stack}.ffn.shared.{part}"),
    (re.compile(_STACK + r"\.ffn\.(?P<part>router|shared_gate)\."), "{stack}.ffn.{part}"),
    (re.compile(_STACK + r"\.\w+_sublayer\.norm\."), "{stack}.norms"),
    (re.compile(r"(?:(?P<stack>encoder|decoder)\.)?final_norm\."), "{stack}.final_norm"),
    (re.compile(r"(?:(?P<stack>encoder|decoder)\.)?relative_bias\."), "{stack}.position_bias"),
    (re.compile(r"head\."), "head"),
    (re.compile(r"frontend\."), "frontend"),
]
_STACK_NAMES = {"blocks": "decoder", "encoder.layers": "encoder", "decoder.layers": "decoder", None: "decoder",
                "encoder": "encoder", "decoder": "decoder"}
_ATTENTION_NAMES = {"attn": "attn", "self_attn": "attn", "cross_attn": "cross"}


def _attention_split(model: nn.Module, name: str, param: nn.Parameter, match) -> dict[str, int]:
    """Split a fused [Q; K; V] projection (rows q_size, kv_size, kv_size) into its three parts."""
    prefix = f"{_STACK_NAMES[match['stack']]}.{_ATTENTION_NAMES[match['attn']]}"
    if match["proj"] == "out":
        return {f"{prefix}.o": param.numel()}
    module = model.get_submodule(name.rsplit(".", 2)[0])  # the MultiHeadAttention
    per_row = param.numel() // param.shape[0]  # d_model for the weight, 1 for the bias
    return {f"{prefix}.q": module.q_size * per_row, f"{prefix}.k": module.kv_size * per_row,
            f"{prefix}.v": module.kv_size * per_row}


def count_parameters(model: nn.Module) -> dict[str, int]:
    """The measured parameter count of a tutorial_lib model (DecoderOnlyLM, EncoderDecoder, or
    the encoder-only EncoderBackbone), by component, with the keys of
    :func:`expected_parameters`. A tied matrix counts once, under the first name it was
    registered with (the embedding). A model with a ``frontend`` gets a ``"frontend"`` key.
    Works on models built on the meta device (only shapes are read).

    For a mixture of experts, ``"active"`` is measured too: the total less, in each
    :class:`~tutorial_lib.moe.MoEFeedForward`, the parameters of the experts a token skips."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(model, nn.Module) or not isinstance(cfg, ModelConfig):
        raise ValueError(f"expected a tutorial_lib model with a .cfg ModelConfig, got {type(model).__name__}")
    counts = {key: 0 for key in expected_parameters(cfg) if key not in SUMMARY_KEYS}
    for name, param in model.named_parameters():  # each shared Parameter once
        for pattern, key in _RULES:
            match = pattern.match(name)
            if match is None:
                continue
            if "{attn}" in key:
                parts = _attention_split(model, name, param, match)
            else:
                stack = _STACK_NAMES.get(match.groupdict().get("stack"))
                parts = {key.format(stack=stack, part=match.groupdict().get("part")): param.numel()}
            for part, n in parts.items():
                counts[part] = counts.get(part, 0) + n
            break
        else:
            raise ValueError(f"parameter {name!r} of shape {tuple(param.shape)} belongs to no known "
                             "component; count_parameters knows DecoderOnlyLM, EncoderDecoder and "
                             "EncoderBackbone")
    counts["total"] = sum(counts.values())
    if cfg.n_experts:
        counts["active"] = counts["total"] - sum(
            (len(m.experts) - m.k) * sum(p.numel() for p in m.experts[0].parameters())
            for m in model.modules() if isinstance(m, MoEFeedForward))
    return counts


def unique_parameter_count(model: nn.Module) -> int:
    """sum(p.numel()) over a model's parameters, each shared (tied) tensor once: what
    ``transformers`` reports for its own models."""
    return sum(p.numel() for p in model.parameters())


# ---- memory -----------------------------------------------------------------------------------

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1}
GiB = 2**30


def dtype_bytes(dtype) -> int:
    """Bytes per value: a name from :data:`DTYPE_BYTES` or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be a torch dtype or one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def _n_params(params) -> int:
    if isinstance(params, ModelConfig):
        return expected_parameters(params)["total"]
    return check_count("params", params, 0, why="a parameter count, or else a ModelConfig")


def weight_bytes(params, dtype="bf16") -> int:
    """Bytes to hold the weights: a ModelConfig or a parameter count, in ``dtype``."""
    return _n_params(params) * dtype_bytes(dtype)


def training_bytes(params, precision: str = "mixed") -> dict[str, int]:
    """Bytes for weights, gradients and AdamW's two moment estimates, without activations.

    ``"fp32"``: weights, gradients and both moments in float32: 4 + 4 + 8 = 16 bytes a parameter.
    ``"mixed"``: 16-bit weights and gradients, plus a float32 master copy of the weights and
    float32 moments: 2 + 2 + 4 + 8 = 16 bytes a parameter (Rajbhandari et al., 2020, "ZeRO",
    section 3.1). Activations depend on batch, length and recomputation, and are not included.
    """
    n = _n_params(params)
    if precision == "fp32":
        parts = {"weights": 4 * n, "gradients": 4 * n, "master_weights": 0, "optimizer_states": 8 * n}
    elif precision == "mixed":
        parts = {"weights": 2 * n, "gradients": 2 * n, "master_weights": 4 * n, "optimizer_states": 8 * n}
    else:
        raise ValueError(f"precision must be 'fp32' or 'mixed', got {precision!r}")
    parts["total"] = sum(parts.values())
    return parts


def kv_cache_bytes(cfg: ModelConfig, batch: int, seq_len: int, dtype="bf16", *,
                   source_len: int | None = None) -> int:
    """Bytes of the key/value cache when ``batch`` sequences hold ``seq_len`` positions each.

    Per decoder layer and position: keys and values of n_kv_heads heads of d_k values, so
    grouped-query attention shrinks it by n_heads / n_kv_heads. An encoder-decoder model also
    keeps the cross-attention keys and values of ``source_len`` encoder positions per layer.

    Multi-head latent attention keeps, per layer and position, the key/value latent
    (kv_lora_rank values) and the rotary key shared by the heads (rope_head_dim values):
    (d_c + d_h^R) per token and layer, as in the DeepSeek-V2 paper's Table 1. That is what
    DeepSeek's inference code caches (keys and values are rebuilt from the latent, or the
    up-projections are folded into the query and output); ``transformers``' implementation
    caches the rebuilt per-head keys and values instead, which takes more memory.
    """
    cfg = counted(cfg)
    check_count("batch", batch)
    check_count("seq_len", seq_len)
    if cfg.family == "encoder":
        raise ValueError("an encoder reads its whole input at once and keeps no KV cache; "
                         "use a decoder or encoder-decoder config")
    if seq_len > cfg.max_len:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context, max_len={cfg.max_len}")
    if cfg.latent_attention:  # the latent and the shared rotary key, one layer
        per_position = (cfg.kv_lora_rank + cfg.rope_head_dim) * dtype_bytes(dtype)
    else:
        per_position = 2 * cfg.kv_heads * cfg.head_dim * dtype_bytes(dtype)  # keys and values, one layer
    positions = seq_len
    if cfg.family == "encoder-decoder":
        if source_len is None:
            raise ValueError("an encoder-decoder cache also holds the encoder's keys and values: give source_len")
        positions += check_count("source_len", source_len)
    return cfg.decoder_layers * batch * positions * per_position


# ---- FLOPs ------------------------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, context: int | None = None) -> dict[str, int]:
    """Floating-point operations to process one token, forward and for training.

    Every weight matrix the token passes through costs 2 FLOPs per entry (a multiply and an
    add); that includes the output head, tied or not, but not the embedding lookup, biases,
    norms or the softmax, which are small. Attention adds, per layer, the scores q.k against
    ``context`` keys and the weighted sum of ``context`` values: 2 * 2 * context * n_heads * d_k.
    Training is 3x the forward pass: the backward pass costs twice the forward (gradients with
    respect to the inputs and to the weights). This is the counting of Kaplan et al. (2020),
    "Scaling Laws for Neural Language Models", Table 1, which however counts the attention
    term once (2 * n_layer * n_ctx * d_attn), and of Hoffmann et al. (2022), "Training
    Compute-Optimal Large Language Models", Appendix F, which counts both products as here.

    ``context``: the number of keys each query is scored against (default max_len). A dense
    pass over T tokens computes all T (and masks afterwards); decoding position t needs t + 1.

    A mixture of experts counts the matrices a token goes through: the router, its
    experts_per_token routed experts and the shared experts, i.e. the *active* parameters
    (:func:`active_parameters`). Latent attention counts its down- and up-projections as
    written (keys and values rebuilt per head), and scores over d_k + rope_head_dim
    dimensions, values of v_head_dim.
    """
    if cfg.family == "encoder-decoder":
        raise ValueError("flops_per_token counts tokens through one stack; an encoder-decoder model has "
                         "source and target tokens with different costs")
    cfg = counted(cfg)
    context = cfg.max_len if context is None else check_count("context", context)
    d = cfg.d_model
    if cfg.latent_attention:  # its projections, without the two norms (it has no biases)
        attn_matrices = sum(n for key, n in _latent_attention(cfg, "attn").items() if not key.endswith("norm"))
    else:  # W_Q, W_O (d x h d_k) and W_K, W_V (d x h_kv d_k)
        attn_matrices = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.kv_heads * cfg.head_dim
    per_ffn = (3 if cfg.gated else 2) * d  # matrix entries per unit of inner width
    n_moe = len(cfg.moe_layers)
    ffn_matrices = (cfg.n_layers - n_moe) * per_ffn * cfg.ffn_dim
    if n_moe:  # the router, k routed experts, the shared experts and their gate
        ffn_matrices += n_moe * (d * cfg.n_experts + per_ffn * cfg.experts_per_token * cfg.expert_dim
                                 + per_ffn * cfg.n_shared_experts * cfg.shared_dim
                                 + (d if cfg.shared_expert_gate else 0))
    head = cfg.vocab_size * d if cfg.family == "decoder" else 0
    matmul = 2 * (cfg.n_layers * attn_matrices + ffn_matrices + head)
    qk_dim = cfg.head_dim + (cfg.rope_head_dim if cfg.latent_attention else 0)
    attention = cfg.n_layers * 2 * context * cfg.n_heads * (qk_dim + cfg.v_head_dim)
    forward = matmul + attention
    return {"matmul": matmul, "attention": attention, "forward": forward, "training": 3 * forward}


# ---- reading and printing ----------------------------------------------------------------------


def load_config(source) -> ModelConfig:
    """A ModelConfig (or CountedConfig) from a config, a preset name of :data:`PRESETS`, a
    config.json dict or a path to one. A config.json is read for counting
    (:func:`tutorial_lib.hf_config.from_hf_config`): a field it does not know is refused."""
    from .hf_config import from_hf_config  # hf_config imports CountedConfig from here: imported on use

    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict):
        return from_hf_config(source)
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"{source!r} is neither a config.json file nor a preset; presets: {sorted(PRESETS)}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path.name} is not valid JSON: {err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{path.name} is not a UTF-8 text file ({err.reason} at byte {err.start}); "
                         "a config.json is UTF-8 JSON") from err
    return from_hf_config(hf)


def format_count(n: int) -> str:
    """6738415616 -> '6,738,415,616 (6.74 B)'."""
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,}"


def format_bytes(n: float) -> str:
    """Bytes in GiB (2^30) or MiB (2^20)."""
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / 2**20:,.2f} MiB"


def format_breakdown(counts: dict[str, int], *, skip_zero: bool = True) -> str:
    """A text table of a breakdown: component, parameters, share of the total."""
    total = counts["total"]
    rows = [(key, n) for key, n in counts.items() if key not in SUMMARY_KEYS and (n or not skip_zero)]
    width = max(len(key) for key, _ in rows + [("component", 0), ("active per token", 0)])
    lines = [f"{'component':<{width}}  {'parameters':>15}  {'share':>7}"]
    lines += [f"{key:<{width}}  {n:>15,}  {100 * n / total:6.2f}%" for key, n in rows]
    lines.append(f"{'total':<{width}}  {total:>15,}  {100.0:6.2f}%")
    if "active" in counts:
        lines.append(f"{'active per token':<{width}}  {counts['active']:>15,}  {100 * counts['active'] / total:6.2f}%")
    return "\n".join(lines)


def report(cfg: ModelConfig, *, batch: int = 1, seq_len: int | None = None, dtype="bf16",
           source_len: int | None = None) -> str:
    """The breakdown table and the memory and FLOPs figures, as the command line prints them."""
    cfg = counted(cfg)
    seq_len = cfg.max_len if seq_len is None else seq_len
    if source_len is not None and cfg.family != "encoder-decoder":
        raise ValueError(f"source_len (--source-len) counts encoder positions of an encoder-decoder model; this is "
                         f"a {cfg.family} model")
    counts = expected_parameters(cfg)
    n = counts["total"]
    lines = [f"{cfg.family} model, {format_count(n)} parameters"]
    if cfg.n_experts:
        lines.append(f"mixture of experts: {cfg.n_experts} routed experts, {cfg.experts_per_token} per token"
                     + (f", {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "")
                     + f", in {len(cfg.moe_layers)} of {cfg.n_layers} layers; {format_count(counts['active'])} "
                     "parameters active per token. Memory holds the total; compute follows the active.")
    if cfg.latent_attention:
        lines.append(f"multi-head latent attention: the cache keeps a latent of {cfg.kv_lora_rank} and a rotary "
                     f"key of {cfg.rope_head_dim} values per token and layer")
    if cfg.mtp_modules:
        lines.append(f"multi-token prediction: {cfg.mtp_modules} module(s) in the checkpoint besides this total, "
                     f"{format_count(mtp_parameters(cfg)['total'])} parameters (embedding and head shared)")
    lines += ["", format_breakdown(counts), "",
              "weights:  " + "   ".join(f"{name} {format_bytes(weight_bytes(n, name))}"
                                         for name in ("fp32", "bf16", "int8"))]
    lines.append(f"training with AdamW (weights, gradients, two moments; 16 bytes a parameter in fp32 or mixed "
                 f"precision; activations not included): {format_bytes(training_bytes(n)['total'])}")
    if cfg.family != "encoder":
        source = (seq_len if source_len is None else source_len) if cfg.family == "encoder-decoder" else None
        where = f" + {source} source positions" if source else ""
        lines.append(f"KV cache ({dtype}, batch {batch}, {seq_len} positions{where}): "
                     f"{format_bytes(kv_cache_bytes(cfg, batch, seq_len, dtype, source_len=source))}")
    if cfg.family != "encoder-decoder":
        flops = flops_per_token(cfg, seq_len)
        through = " (through the active parameters)" if cfg.n_experts else ""
        lines.append(f"FLOPs per token at a context of {seq_len}{through}: forward {flops['forward'] / 1e9:,.2f} G "
                     f"(attention {flops['attention'] / 1e9:,.2f} G), training {flops['training'] / 1e9:,.2f} G")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.params",
        description="Parameter breakdown, memory and FLOPs of a model from its Hugging Face config.json.")
    parser.add_argument("config", help=f"path to a config.json, or a preset: {', '.join(sorted(PRESETS))}")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the KV cache (default 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="positions per sequence (default: max_len)")
    parser.add_argument("--source-len", type=int, default=None,
                        help="encoder positions for an encoder-decoder cache (default: seq-len)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="KV-cache dtype")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        text = report(cfg, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype, source_len=args.source_len)
    except ValueError as err:
        parser.error(str(err))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
