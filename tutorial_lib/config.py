"""One frozen dataclass that describes a model's shape and choices, and named presets.

Change a preset with ``dataclasses.replace(GPT_TINY, d_model=128)``: fields left as ``None``
(``n_kv_heads``, ``head_dim``, ``d_ff``, the per-part biases) are resolved by the properties
below every time they are read, so a replaced ``d_model`` or ``bias`` carries through.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

FAMILIES = ("encoder", "decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_ORDERS = ("pre", "post")
FFNS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh")
GATED_FFNS = ("swiglu", "geglu", "geglu_tanh")  # three matrices: gate, up, down
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
BIAS_PARTS = ("qkv", "out", "ffn", "norm")


_OPTIONAL_BOOL_FIELDS = ("final_norm", "qkv_bias", "out_bias", "ffn_bias", "norm_bias")
_BOOL_FIELDS = ("bias", "tie_embeddings", "scale_embeddings", "share_embeddings", "embedding_norm", "pooler",
                "zero_init_out", "scale_residual_init", "shared_expert_gate", "renormalise_topk",
                "qk_norm") + _OPTIONAL_BOOL_FIELDS


@dataclass(frozen=True)
class ModelConfig:
    """Shape and choices of a Transformer. Validated on construction.

    family: "encoder" (BERT-like), "decoder" (GPT/LLaMA-like) or "encoder-decoder".
    n_kv_heads < n_heads gives grouped-query attention; head_dim defaults to d_model / n_heads;
    d_ff defaults to 4 * d_model. ``bias`` switches every bias; ``qkv_bias``, ``out_bias``,
    ``ffn_bias`` and ``norm_bias`` override it for one part.

    ``positions="relative"`` is T5's learned relative-position bias: one table of
    ``relative_buckets`` x ``n_heads`` per self-attention stack, shared by its layers
    (:class:`tutorial_lib.positions.RelativePositionBias`). T5 itself also leaves out the
    1/sqrt(d_k) of attention; tutorial_lib keeps it (T5's W_Q times sqrt(d_k) gives the same
    scores).

    A few fields describe parts of published models that :mod:`tutorial_lib.params` counts but
    this package does not build: BERT's token-type table, embedding norm and pooler
    (``family="encoder"`` only). ``Embeddings`` and ``Encoder`` refuse a config that asks for
    them, rather than silently leaving them out; there is no encoder-only model to build a
    pooler.

    Mixtures of experts (decoder-only; built by :mod:`tutorial_lib.moe`): with ``n_experts > 0``
    every layer not in ``dense_layers`` replaces its feed-forward network by ``n_experts``
    routed experts of inner width ``expert_d_ff`` (default d_ff), of which each token uses
    ``experts_per_token``, plus ``n_shared_experts`` of width ``shared_d_ff`` that every token
    uses (scaled by a sigmoid gate when ``shared_expert_gate``). ``renormalise_topk``: the k
    chosen router probabilities are divided by their sum (Mixtral); otherwise they keep the
    values of the softmax over all experts (Qwen1.5-MoE, DeepSeek-V2). Layers in
    ``dense_layers`` keep a dense FFN of width d_ff.

    Two more attention variants are counted but not built: ``qk_norm`` (an RMSNorm over each
    head's queries and keys, one weight vector of d_k shared by the heads, as in Qwen3) and
    multi-head latent attention (DeepSeek-V2/V3), switched on by ``kv_lora_rank``: keys and
    values are rebuilt per head from one compressed latent of ``kv_lora_rank`` values per
    token, queries from one of ``q_lora_rank`` (None: a full-rank W_Q), and each query and
    key head adds ``rope_head_dim`` rotary dimensions (the key's shared by all heads) to its
    ``head_dim`` plain ones; value heads are ``v_head_dim`` wide (default head_dim).
    ``mtp_modules`` counts DeepSeek-V3's multi-token-prediction modules, which sit outside
    the model that predicts the next token (see :func:`tutorial_lib.params.mtp_parameters`).
    """

    family: str = "decoder"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_len: int = 256
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_order: str = "pre"
    final_norm: bool | None = None  # None: a final norm for pre-LN stacks only
    ffn: str = "gelu"
    positions: str = "learned"
    rope_base: float = 10000.0
    bias: bool = True
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    ffn_bias: bool | None = None
    norm_bias: bool | None = None
    tie_embeddings: bool = True
    dropout: float = 0.0
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    # encoder-decoder only
    n_decoder_layers: int | None = None
    src_vocab_size: int | None = None  # None: same as vocab_size
    share_embeddings: bool = False  # one table for source and target tokens
    # parts of published models that tutorial_lib.params counts (see the class docstring)
    type_vocab_size: int = 0  # BERT's token-type (segment) table; 0: none
    embedding_norm: bool = False  # a norm over the summed embeddings (BERT)
    pooler: bool = False  # BERT's dense + tanh layer over the first position
    relative_buckets: int = 32  # positions="relative" (T5): buckets of relative distance
    relative_max_distance: int = 128  # ... distances from this one on share the last bucket
    # mixture of experts (see the class docstring); n_experts=0: a dense FFN in every layer
    n_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 2  # k: the routed experts each token goes to
    expert_d_ff: int | None = None  # inner width of one routed expert; None: d_ff
    n_shared_experts: int = 0  # experts every token goes to, besides its k routed ones
    shared_d_ff: int | None = None  # inner width of one shared expert; None: expert_d_ff
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(w . x) scales the shared experts' output
    renormalise_topk: bool = True  # the k chosen router probabilities divided by their sum
    dense_layers: tuple[int, ...] = ()  # layers (0-based) that keep a dense FFN of width d_ff
    # counted by tutorial_lib.params, not built (see the class docstring)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys
    kv_lora_rank: int | None = None  # multi-head latent attention: width of the key/value latent
    q_lora_rank: int | None = None  # ... width of the query latent; None: a full-rank W_Q
    rope_head_dim: int = 0  # ... rotary dimensions added to each query and key head
    v_head_dim: int | None = None  # ... width of a value head; None: head_dim
    mtp_modules: int = 0  # DeepSeek-V3's multi-token-prediction modules (outside the total)
    # initialisation (see tutorial_lib.layers.init_weights)
    init_std: float = 0.02
    qk_gain: float = 1.0  # multiplies the initial W_Q and W_K
    zero_init_out: bool = False  # residual-branch output projections start at zero
    scale_residual_init: bool = False  # ... or scaled by 1/sqrt(residual branches): layers.init_weights

    def __post_init__(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "relative_buckets",
                     "relative_max_distance"):
            positive(name)
        for name in ("n_kv_heads", "head_dim", "d_ff", "n_decoder_layers", "src_vocab_size"):
            if getattr(self, name) is not None:
                positive(name)
        choice("family", FAMILIES)
        choice("norm", NORMS)
        choice("norm_order", NORM_ORDERS)
        choice("ffn", FFNS)
        choice("positions", POSITIONS)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), "
                             "or give head_dim explicitly")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.positions == "rope" and self.kv_lora_rank is None and self.d_k % 2:
            raise ValueError(f"RoPE needs an even head width, got d_k = {self.d_k}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        for name in ("norm_eps", "rope_base", "init_std", "qk_gain", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in _OPTIONAL_BOOL_FIELDS):
                allowed = "True, False or None" if name in _OPTIONAL_BOOL_FIELDS else "True or False"
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.qk_gain <= 0:
            raise ValueError("norm_eps, init_std and qk_gain must be positive, got "
                             f"{self.norm_eps}, {self.init_std}, {self.qk_gain}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base must be > 1 (the rotation frequencies are base^(-2i/d_k)), "
                             f"got {self.rope_base}")
        if self.zero_init_out and self.scale_residual_init:
            raise ValueError("choose zero_init_out or scale_residual_init, not both")
        if self.family != "encoder-decoder" and (self.n_decoder_layers is not None or self.share_embeddings
                                                 or self.src_vocab_size is not None):
            raise ValueError("n_decoder_layers, src_vocab_size and share_embeddings belong to "
                             f"encoder-decoder models, not family={self.family!r}")
        if isinstance(self.type_vocab_size, bool) or not isinstance(self.type_vocab_size, int) \
                or self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be an int >= 0, got {self.type_vocab_size!r}")
        if self.family != "encoder" and (self.type_vocab_size or self.embedding_norm or self.pooler):
            raise ValueError("type_vocab_size, embedding_norm and pooler describe BERT-style encoders "
                             f"(family='encoder'), not family={self.family!r}")
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            raise ValueError("shared embeddings need one vocabulary: src_vocab_size "
                             f"{self.src_vocab_size} != vocab_size {self.vocab_size}")
        self._check_experts()
        self._check_latent_attention()

    def _check_experts(self) -> None:
        def count(name):  # an int >= 0
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

        count("n_experts")
        count("n_shared_experts")
        count("mtp_modules")
        for name in ("expert_d_ff", "shared_d_ff"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if isinstance(self.dense_layers, (list, range)):  # from JSON or from_dict: keep the field hashable
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if not isinstance(self.dense_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.dense_layers):
            raise ValueError(f"dense_layers must be a tuple of layer indices, got {self.dense_layers!r}")
        if self.n_experts == 0:
            asked = [name for name in ("n_shared_experts", "expert_d_ff", "shared_d_ff", "shared_expert_gate",
                                       "dense_layers") if getattr(self, name)]
            if asked:
                raise ValueError(f"{', '.join(asked)} describe a mixture of experts, but n_experts=0; "
                                 "give n_experts, the number of routed experts")
            return
        if self.family != "decoder":
            raise ValueError(f"mixtures of experts are built for decoder-only models (family='decoder'), "
                             f"got family={self.family!r}")
        k = self.experts_per_token
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_experts:
            raise ValueError(f"experts_per_token must be an int in [1, n_experts={self.n_experts}], got {k!r}")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ValueError("shared_expert_gate scales the shared experts, but n_shared_experts=0")
        if self.shared_d_ff is not None and not self.n_shared_experts:
            raise ValueError("shared_d_ff is the width of a shared expert, but n_shared_experts=0")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ValueError(f"dense_layers must hold distinct layer indices in [0, {self.n_layers - 1}], "
                             f"got {self.dense_layers}")
        if len(self.dense_layers) == self.n_layers:
            raise ValueError(f"dense_layers lists all {self.n_layers} layers, which leaves no mixture of experts; "
                             "for a dense model set n_experts=0")

    def _check_latent_attention(self) -> None:
        if self.qk_norm and self.family != "decoder":
            raise ValueError(f"qk_norm is counted for decoder-only models, not family={self.family!r}")
        if self.kv_lora_rank is None:
            if self.q_lora_rank is not None or self.rope_head_dim or self.v_head_dim is not None:
                raise ValueError("q_lora_rank, rope_head_dim and v_head_dim describe multi-head latent "
                                 "attention; give kv_lora_rank as well")
            return
        for name in ("kv_lora_rank", "q_lora_rank", "v_head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        r = self.rope_head_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2:
            raise ValueError(f"rope_head_dim must be an even int >= 0, got {r!r}")
        if self.family != "decoder" or self.positions != "rope":
            raise ValueError("multi-head latent attention (kv_lora_rank) is counted for decoder-only models "
                             f"with positions='rope', got family={self.family!r}, positions={self.positions!r}")
        if self.kv_heads != self.n_heads:
            raise ValueError("multi-head latent attention rebuilds keys and values for every head: leave "
                             f"n_kv_heads unset (got {self.n_kv_heads} for {self.n_heads} heads)")
        if self.uses_bias("qkv") or self.uses_bias("out"):
            raise ValueError("multi-head latent attention is counted without attention biases: set "
                             "qkv_bias=False and out_bias=False")

    # ---- resolved values ------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads (plain multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_k(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def ffn_dim(self) -> int:
        """Inner width of the feed-forward network."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def gated(self) -> bool:
        """SwiGLU and GeGLU (exact or tanh GELU) have three matrices (gate, up, down), not two."""
        return self.ffn in GATED_FFNS

    @property
    def expert_dim(self) -> int:
        """Inner width of one routed expert."""
        return self.ffn_dim if self.expert_d_ff is None else self.expert_d_ff

    @property
    def shared_dim(self) -> int:
        """Inner width of one shared expert."""
        return self.expert_dim if self.shared_d_ff is None else self.shared_d_ff

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward network is a mixture of experts (none for a dense model)."""
        if not self.n_experts:
            return ()
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of (grouped-query) attention."""
        return self.kv_lora_rank is not None

    @property
    def value_dim(self) -> int:
        """Width of one value head: v_head_dim under latent attention, else d_k."""
        return self.d_k if self.v_head_dim is None else self.v_head_dim

    @property
    def has_final_norm(self) -> bool:
        return self.norm_order == "pre" if self.final_norm is None else self.final_norm

    @property
    def decoder_layers(self) -> int:
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    @property
    def source_vocab_size(self) -> int:
        return self.vocab_size if self.src_vocab_size is None else self.src_vocab_size

    def uses_bias(self, part: str) -> bool:
        """Whether ``part`` ("qkv", "out", "ffn" or "norm") has a bias vector."""
        if part not in BIAS_PARTS:
            raise ValueError(f"part must be one of {BIAS_PARTS}, got {part!r}")
        if part == "norm" and self.norm == "rmsnorm":
            return False  # RMSNorm has a scale only
        override = getattr(self, f"{part}_bias")
        return self.bias if override is None else override

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """A ModelConfig from a Hugging Face ``config.json`` dict: see :func:`from_hf_config`."""
        return from_hf_config(hf)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


# ---- presets ----------------------------------------------------------------------------------
# Tiny models for the notebooks (vocab_size is replaced by the tokenizer's), and the real
# shapes of two published models, for counting parameters and memory.

GPT_TINY = ModelConfig(
    family="decoder", vocab_size=128, d_model=128, n_layers=4, n_heads=4, max_len=128,
    norm="layernorm", ffn="gelu_tanh", positions="learned", bias=True, tie_embeddings=True,
)

LLAMA_TINY = ModelConfig(
    family="decoder", vocab_size=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
    d_ff=344, max_len=128, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", positions="rope",
    bias=False, tie_embeddings=False,
)

# GPT-2 small (Radford et al., 2019; Hugging Face "gpt2" config.json).
GPT2_SMALL = ModelConfig(
    family="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_len=1024,
    norm="layernorm", ffn="gelu_tanh", positions="learned", bias=True, tie_embeddings=True,
)

# Llama-2-7B (Touvron et al., 2023; "meta-llama/Llama-2-7b-hf" config.json).
LLAMA2_7B = ModelConfig(
    family="decoder", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
    d_ff=11008, max_len=4096, norm="rmsnorm", norm_eps=1e-5, ffn="swiglu", positions="rope",
    bias=False, tie_embeddings=False,
)

# ---- published shapes for counting (notebook 07, tutorial_lib.params) ------------------------
# Each is what from_hf_config reads from the model's Hugging Face config.json (tests check
# that), except the two Transformers of Vaswani et al. (2017), which come from the paper.

LLAMA2_13B = replace(LLAMA2_7B, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824)

# Llama-2-70B: grouped-query attention with 8 key/value heads.
LLAMA2_70B = replace(LLAMA2_7B, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)

# Mistral-7B-v0.1 (Jiang et al., 2023; "mistralai/Mistral-7B-v0.1" config.json). Its sliding
# window of 4096 changes the attention mask, not the parameters.
MISTRAL_7B = replace(LLAMA2_7B, n_kv_heads=8, d_ff=14336, max_len=32768)

# BERT-base (Devlin et al., 2019; "google-bert/bert-base-uncased" config.json), without task head.
BERT_BASE = ModelConfig(
    family="encoder", vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_len=512,
    norm="layernorm", norm_eps=1e-12, norm_order="post", ffn="gelu", positions="learned", bias=True,
    type_vocab_size=2, embedding_norm=True, pooler=True,
)

# T5-small (Raffel et al., 2020; "google-t5/t5-small" config.json). T5 also leaves out the
# 1/sqrt(d_k) of attention (folded into the initialisation), which changes no parameter.
T5_SMALL = ModelConfig(
    family="encoder-decoder", vocab_size=32128, d_model=512, n_layers=6, n_heads=8, head_dim=64,
    d_ff=2048, max_len=512, norm="rmsnorm", norm_eps=1e-6, ffn="relu", positions="relative",
    relative_buckets=32, relative_max_distance=128, bias=False, tie_embeddings=True,
    share_embeddings=True,
)

# The Transformer of Vaswani et al. (2017), Table 3, for English-German: a shared
# source-target vocabulary of "about 37000 tokens" (section 5.1), one matrix for both
# embeddings and the pre-softmax projection (section 3.4), embeddings times sqrt(d_model).
# The paper does not say which projections carry biases; these have them all.
TRANSFORMER_BASE = ModelConfig(
    family="encoder-decoder", vocab_size=37000, d_model=512, n_layers=6, n_heads=8, d_ff=2048,
    max_len=512, norm="layernorm", norm_order="post", ffn="relu", positions="sinusoidal", bias=True,
    tie_embeddings=True, share_embeddings=True, scale_embeddings=True, dropout=0.1,
)  # max_len changes no parameter here: the sinusoidal table is computed, not learned
TRANSFORMER_BIG = replace(TRANSFORMER_BASE, d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)

# ---- mixtures of experts (counted in notebook 07; each is what from_hf_config reads) -----------

# Mixtral-8x7B-v0.1 (Jiang et al., 2024; "mistralai/Mixtral-8x7B-v0.1" config.json): Mistral-7B's
# attention, and in every layer 8 SwiGLU experts of Mistral's width, 2 per token.
MIXTRAL_8X7B = replace(MISTRAL_7B, rope_base=1e6, n_experts=8, experts_per_token=2)

# Qwen3-30B-A3B ("Qwen/Qwen3-30B-A3B" config.json): 128 narrow experts, 8 per token, no shared one.
QWEN3_30B_A3B = ModelConfig(
    family="decoder", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    d_ff=6144, max_len=40960, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", positions="rope", rope_base=1e6,
    bias=False, tie_embeddings=False, n_experts=128, experts_per_token=8, expert_d_ff=768, qk_norm=True,
)

# DeepSeek-V3 (DeepSeek-AI, 2024; "deepseek-ai/DeepSeek-V3" config.json): multi-head latent
# attention, 3 dense layers, then 256 routed experts (8 per token) and 1 shared in each layer.
DEEPSEEK_V3 = ModelConfig(
    family="decoder", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, head_dim=128, d_ff=18432,
    max_len=163840, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", positions="rope", rope_base=10000.0, bias=False,
    tie_embeddings=False, n_experts=256, experts_per_token=8, expert_d_ff=2048, n_shared_experts=1,
    dense_layers=(0, 1, 2), kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128, mtp_modules=1,
)

PRESETS = {"gpt-tiny": GPT_TINY, "llama-tiny": LLAMA_TINY, "gpt2-small": GPT2_SMALL,
           "llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B,
           "mistral-7b": MISTRAL_7B, "bert-base": BERT_BASE, "t5-small": T5_SMALL,
           "transformer-base": TRANSFORMER_BASE, "transformer-big": TRANSFORMER_BIG,
           "mixtral-8x7b": MIXTRAL_8X7B, "qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3}


def preset(name: str, **changes) -> ModelConfig:
    """A named preset, optionally with some fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"no preset named {name!r}; the presets are {sorted(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {unknown}; known fields are {sorted(known)}")
    return replace(PRESETS[name], **changes)


# ---- Hugging Face config.json -----------------------------------------------------------------
# A config.json says more than a ModelConfig can hold. Every field is sorted into one of four
# kinds, so that nothing is dropped without a reason:
#   read      turned into ModelConfig fields;
#   metadata  bookkeeping, token ids, labels, generation settings (_HF_METADATA);
#   ignored   changes what the model computes but no parameter shape (dropout, RoPE scaling,
#             sliding windows): fine for counting, and named with its reason in the reader;
#   required  changes the parameters or the kind of model at any value but the one allowed.
# Any other field raises a ValueError: we cannot tell whether it changes the count.

_HF_METADATA = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "auto_map", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class",
    "prefix", "task_specific_params", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "initializer_range", "initializer_factor", "gradient_checkpointing",
})

# Fields any model type may carry that change the parameters at other values:
# field -> (the values that are fine, why another value is refused).
_HF_REQUIRED_COMMON = {
    "pruned_heads": (({}, None), "pruned attention heads change the projection shapes"),
    "add_cross_attention": ((False, None), "cross-attention layers add parameters"),
    "cross_attention_hidden_size": ((None,), "cross-attention layers add parameters"),
    "tie_encoder_decoder": ((False, None), "tying encoder and decoder weights changes the count"),
    "quantization_config": ((None,), "quantized checkpoints store weights in packed formats"),
}

# Model types close to supported ones, with what keeps them out.
_UNSUPPORTED_TYPES = {
    "gemma2": "four norms per layer (around both sublayers) and logit soft-capping",
    "qwen3": "an RMSNorm on each head's queries and keys (q_norm, k_norm)",
}

_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")

_DROPOUTS = {name: "dropout has no parameters" for name in (
    "attention_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "classifier_dropout", "dropout_rate", "summary_first_dropout")}

_ROPE_IGNORED = {
    "rope_scaling": "RoPE scaling changes the rotation frequencies, not the parameters",
    "pretraining_tp": "tensor-parallel slicing of the matrices at pre-training; same shapes, same function",
}
_WINDOW_IGNORED = {
    "sliding_window": "a sliding-window mask changes which keys are attended, not the parameters",
    "use_sliding_window": "a sliding-window mask changes which keys are attended, not the parameters",
    "max_window_layers": "a sliding-window mask changes which keys are attended, not the parameters",
    "layer_types": "per-layer attention kinds (full or sliding window) share one parameter layout",
}


def _hf_get(hf: dict, key: str, model_type: str):
    if key not in hf or hf[key] is None:
        raise ValueError(f"a {model_type!r} config.json needs the field {key!r}; it is missing")
    return hf[key]


def _rope_theta(hf: dict) -> float:
    """RoPE's base: ``rope_theta`` (transformers 4) or ``rope_parameters["rope_theta"]`` (5)."""
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _override(value: bool, default: bool) -> bool | None:
    """A per-part bias flag, or None when it equals the model-wide ``bias``."""
    return None if value == default else value


def _gpt2_config(hf: dict) -> ModelConfig:
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu"}.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise ValueError(f"unsupported GPT-2 activation_function {hf.get('activation_function')!r}; "
                         "expected gelu_new, gelu_pytorch_tanh, gelu or relu")
    get = lambda key: _hf_get(hf, key, "gpt2")
    return ModelConfig(
        family="decoder", vocab_size=get("vocab_size"), d_model=get("n_embd"), n_layers=get("n_layer"),
        n_heads=get("n_head"), d_ff=hf.get("n_inner"), max_len=get("n_positions"), norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), ffn=activation, positions="learned", bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


_GPT2_FIELDS = {
    "read": {"vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "activation_function",
             "layer_norm_epsilon", "tie_word_embeddings"},
    "ignored": _DROPOUTS | {
        "n_ctx": "an old copy of n_positions that transformers no longer reads",
        "summary_type": "the classification head of GPT2DoubleHeadsModel, not part of the language model",
        "summary_use_proj": "the classification head of GPT2DoubleHeadsModel",
        "summary_activation": "the classification head of GPT2DoubleHeadsModel",
        "summary_proj_to_labels": "the classification head of GPT2DoubleHeadsModel",
        "scale_attn_weights": "how attention scores are scaled, not a parameter",
        "scale_attn_by_inverse_layer_idx": "how attention scores are scaled, not a parameter",
        "reorder_and_upcast_attn": "float precision of the attention scores, not a parameter",
    },
    "required": {},
}


# The LLaMA family: RMSNorm, RoPE, a gated FFN, grouped-query attention, no biases by default.
# The members differ in which biases they have, how they tie, and their gate's activation.
_LLAMA_LIKE = {
    #           activation field,  allowed values -> ffn,                         tie default
    "llama": ("hidden_act", {"silu": "swiglu"}, False),
    "mistral": ("hidden_act", {"silu": "swiglu"}, False),
    "qwen2": ("hidden_act", {"silu": "swiglu"}, False),
    "phi3": ("hidden_act", {"silu": "swiglu"}, False),
    # Gemma's released configs say "gelu" but mean the tanh approximation; transformers reads
    # it that way too (GemmaConfig replaces it with "gelu_pytorch_tanh").
    "gemma": ("hidden_act", {"gelu": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh"}, True),
    # mixtures of experts whose attention, norms and embeddings are the family's (read below)
    "mixtral": ("hidden_act", {"silu": "swiglu"}, False),
    "qwen2_moe": ("hidden_act", {"silu": "swiglu"}, False),
    "qwen3_moe": ("hidden_act", {"silu": "swiglu"}, False),
}


def _llama_like_config(hf: dict) -> ModelConfig:
    model_type = hf["model_type"]
    act_field, activations, tie_default = _LLAMA_LIKE[model_type]
    act = hf.get("hidden_activation") or hf.get(act_field) or next(iter(activations))
    if act not in activations:
        raise ValueError(f"unsupported {model_type} {act_field} {act!r}; expected one of {sorted(activations)}")
    get = lambda key: _hf_get(hf, key, model_type)
    d, h = get("hidden_size"), get("num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and d % h == 0 and head_dim == d // h:
        head_dim = None  # the default, d / h
    if model_type == "qwen2":  # Qwen2 always has biases on Q, K and V, and none on O
        qkv_bias, out_bias = True, False
    elif model_type == "qwen2_moe":  # ... and Qwen2-MoE unless qkv_bias says otherwise
        qkv_bias, out_bias = bool(hf.get("qkv_bias", True)), False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        family="decoder", vocab_size=get("vocab_size"), d_model=d, n_layers=get("num_hidden_layers"),
        n_heads=h, n_kv_heads=hf.get("num_key_value_heads") or h, head_dim=head_dim,
        d_ff=get("intermediate_size"), max_len=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), ffn=activations[act], positions="rope",
        rope_base=_rope_theta(hf), bias=False, qkv_bias=_override(qkv_bias, False),
        out_bias=_override(out_bias, False), ffn_bias=_override(bool(hf.get("mlp_bias", False)), False),
        tie_embeddings=hf.get("tie_word_embeddings", tie_default),
        scale_embeddings=model_type == "gemma",  # Gemma multiplies embeddings by sqrt(d_model)
    )


_LLAMA_READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
               "rope_theta", "rope_parameters", "tie_word_embeddings"}
_LLAMA_IGNORED = _DROPOUTS | _ROPE_IGNORED | {
    "rope_interleaved": "which dimensions RoPE rotates together, not a parameter (SmolLM2's config says false)",
    "is_llama_config": "a flag of the nanotron trainer (SmolLM2) saying the file describes a LLaMA",
}


def _llama_fields(read=(), ignored=None, required=None) -> dict:
    return {"read": _LLAMA_READ | set(read), "ignored": _LLAMA_IGNORED | (ignored or {}), "required": required or {}}


def _bert_config(hf: dict) -> ModelConfig:
    act = hf.get("hidden_act", "gelu")
    ffn = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh"}.get(act)
    if ffn is None:
        raise ValueError(f"unsupported BERT hidden_act {act!r}; expected gelu, gelu_new or relu")
    get = lambda key: _hf_get(hf, key, "bert")
    return ModelConfig(
        family="encoder", vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"), d_ff=get("intermediate_size"),
        max_len=get("max_position_embeddings"), norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_order="post", ffn=ffn, positions="learned", bias=True, type_vocab_size=hf.get("type_vocab_size", 2),
        embedding_norm=True, pooler=True,
    )


_BERT_FIELDS = {
    "read": {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps"},
    "ignored": _DROPOUTS | {"tie_word_embeddings": "BertModel has no output head to tie"},
    "required": {
        "position_embedding_type": (("absolute",), "relative-position variants add other tables"),
        "is_decoder": ((False, None), "a causal BERT is a different kind of model"),
    },
}

_T5_FFNS = {"relu": "relu", "gelu": "gelu", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu"}


def _t5_config(hf: dict) -> ModelConfig:
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in _T5_FFNS:
        raise ValueError(f"unsupported T5 feed_forward_proj {proj!r}; expected one of {sorted(_T5_FFNS)}")
    get = lambda key: _hf_get(hf, key, "t5")
    n_layers = get("num_layers")
    n_decoder = hf.get("num_decoder_layers")
    return ModelConfig(
        family="encoder-decoder", vocab_size=get("vocab_size"), d_model=get("d_model"), n_layers=n_layers,
        n_decoder_layers=None if n_decoder in (None, n_layers) else n_decoder, n_heads=get("num_heads"),
        head_dim=get("d_kv"), d_ff=get("d_ff"), max_len=hf.get("n_positions", 512), norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), ffn=_T5_FFNS[proj], positions="relative",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128), bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", True), share_embeddings=True,
    )


_T5_FIELDS = {
    "read": {"vocab_size", "d_model", "num_layers", "num_decoder_layers", "num_heads", "d_kv", "d_ff",
             "n_positions", "layer_norm_epsilon", "feed_forward_proj", "relative_attention_num_buckets",
             "relative_attention_max_distance", "tie_word_embeddings"},
    "ignored": _DROPOUTS | {
        "dense_act_fn": "derived by transformers from feed_forward_proj",
        "is_gated_act": "derived by transformers from feed_forward_proj",
        "output_past": "an old generation setting",
        "scale_decoder_outputs": "scales the tied head's input, not a parameter",
    },
    "required": {"is_decoder": ((False, None), "T5ForConditionalGeneration has both stacks")},
}

# ---- mixtures of experts ----------------------------------------------------------------------

_ROUTER_IGNORED = {
    "output_router_logits": "whether the model returns its router logits, not a parameter",
    "router_aux_loss_coef": "the weight of the load-balancing loss in training, not a parameter",
    "router_jitter_noise": "noise on the router's input during training, not a parameter",
}


def _mixtral_config(hf: dict) -> ModelConfig:
    """Mixtral: Mistral's attention; every layer's FFN is num_local_experts experts of width
    intermediate_size, each token going to num_experts_per_tok of them (renormalised)."""
    get = lambda key: _hf_get(hf, key, "mixtral")
    return replace(_llama_like_config(hf), n_experts=get("num_local_experts"),
                   experts_per_token=get("num_experts_per_tok"))


def _qwen_moe_config(hf: dict) -> ModelConfig:
    """Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE: experts of width moe_intermediate_size; Qwen2-MoE
    adds one shared expert of width shared_expert_intermediate_size behind a sigmoid gate, Qwen3
    an RMSNorm on each head's queries and keys. A layer keeps a dense FFN of width
    intermediate_size when it is in mlp_only_layers or when (layer + 1) is not a multiple of
    decoder_sparse_step (transformers' rule)."""
    model_type = hf["model_type"]
    get = lambda key: _hf_get(hf, key, model_type)
    n_experts = hf.get("num_experts") or get("num_local_experts")  # Qwen3-MoE: either name
    step, only_mlp = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    n_layers = get("num_hidden_layers")
    dense = tuple(i for i in range(n_layers) if i in only_mlp or (i + 1) % step)
    shared = {}
    if model_type == "qwen2_moe":
        shared = dict(n_shared_experts=1, shared_d_ff=get("shared_expert_intermediate_size"), shared_expert_gate=True)
    return replace(_llama_like_config(hf), n_experts=n_experts, experts_per_token=get("num_experts_per_tok"),
                   expert_d_ff=get("moe_intermediate_size"), renormalise_topk=bool(hf.get("norm_topk_prob", False)),
                   dense_layers=dense, qk_norm=model_type == "qwen3_moe", **shared)


def _deepseek_config(hf: dict) -> ModelConfig:
    """DeepSeek-V2 and -V3: multi-head latent attention; the first first_k_dense_replace layers
    keep a dense FFN of width intermediate_size, the others have n_routed_experts experts of
    width moe_intermediate_size plus n_shared_experts shared ones of the same width."""
    model_type = hf["model_type"]
    get = lambda key: _hf_get(hf, key, model_type)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported {model_type} hidden_act {act!r}; expected 'silu'")
    return ModelConfig(
        family="decoder", vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=get("num_attention_heads"), head_dim=get("qk_nope_head_dim"), d_ff=get("intermediate_size"),
        max_len=hf.get("max_position_embeddings", 4096), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        ffn="swiglu", positions="rope", rope_base=_rope_theta(hf), bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        n_experts=get("n_routed_experts"), experts_per_token=get("num_experts_per_tok"),
        expert_d_ff=get("moe_intermediate_size"), n_shared_experts=hf.get("n_shared_experts") or 0,
        renormalise_topk=bool(hf.get("norm_topk_prob", False)),
        dense_layers=tuple(range(hf.get("first_k_dense_replace") or 0)),
        kv_lora_rank=get("kv_lora_rank"), q_lora_rank=hf.get("q_lora_rank"), rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), mtp_modules=hf.get("num_nextn_predict_layers") or 0,
    )


def _moe_fields(read, ignored=None, required=None) -> dict:
    return _llama_fields(read=set(read) | {"num_experts_per_tok"}, ignored=_WINDOW_IGNORED | _ROUTER_IGNORED
                         | (ignored or {}), required=required) | {"moe": True}


_QWEN_MOE_READ = {"num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}

_DEEPSEEK_FIELDS = {
    "read": {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "qk_nope_head_dim",
             "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "rope_theta",
             "rope_parameters", "tie_word_embeddings", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size", "n_shared_experts", "norm_topk_prob", "first_k_dense_replace", "kv_lora_rank",
             "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers"},
    "ignored": _DROPOUTS | _ROPE_IGNORED | _ROUTER_IGNORED | {
        "num_key_value_heads": "latent attention rebuilds keys and values for every head",
        "head_dim": "transformers' copy of qk_rope_head_dim, for its rotary embedding",
        "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim, derived",
        "rope_interleave": "the order in which RoPE pairs dimensions, not a parameter",
        "routed_scaling_factor": "a constant that multiplies the routed experts' weights",
        "scoring_func": "the router's score function (softmax or sigmoid), not a parameter",
        "topk_method": "how the router picks experts (greedy, within groups), not a parameter",
        "n_group": "expert groups for group-limited routing, not a parameter",
        "topk_group": "expert groups for group-limited routing, not a parameter",
        "aux_loss_alpha": "the weight of the balancing loss in training, not a parameter",
        "seq_aux": "whether the balancing loss is taken per sequence, not a parameter",
        "ep_size": "expert parallelism in training: the same weights, spread over devices",
    },
    "required": {
        "attention_bias": ((False, None), "biases on the latent attention's projections are not counted"),
        "mlp_bias": ((False, None), "the experts are counted without biases"),
        # transformers builds experts in every layer from first_k_dense_replace on; DeepSeek's
        # own code also skips layers whose index is not a multiple of moe_layer_freq
        "moe_layer_freq": ((1, None), "experts in only every moe_layer_freq-th layer"),
    },
    "moe": True,
}

_FROM_HF = {
    "gpt2": (_gpt2_config, _GPT2_FIELDS),
    "bert": (_bert_config, _BERT_FIELDS),
    "t5": (_t5_config, _T5_FIELDS),
    "llama": (_llama_like_config, _llama_fields(read={"attention_bias", "mlp_bias"})),
    "mistral": (_llama_like_config, _llama_fields(ignored=_WINDOW_IGNORED)),
    "qwen2": (_llama_like_config, _llama_fields(ignored=_WINDOW_IGNORED)),
    "gemma": (_llama_like_config, _llama_fields(
        read={"attention_bias", "hidden_activation"},
        required={"use_bidirectional_attention": ((False, None), "a bidirectional Gemma is an encoder")})),
    "phi3": (_llama_like_config, _llama_fields(
        ignored=_WINDOW_IGNORED | {
            "original_max_position_embeddings": "the context length RoPE scaling starts from",
            "partial_rotary_factor": "how much of each head RoPE rotates, not a parameter"},
        # transformers' Phi3 builds its fused QKV projection without a bias whatever this says
        required={"attention_bias": ((False, None), "Phi3ForCausalLM has no attention biases")})),
    "mixtral": (_mixtral_config, _moe_fields(read={"num_local_experts"})),
    "qwen2_moe": (_qwen_moe_config, _moe_fields(read=_QWEN_MOE_READ | {"shared_expert_intermediate_size", "qkv_bias"})),
    "qwen3_moe": (_qwen_moe_config, _moe_fields(read=_QWEN_MOE_READ | {"num_local_experts", "attention_bias"})),
    "deepseek_v2": (_deepseek_config, _DEEPSEEK_FIELDS),
    "deepseek_v3": (_deepseek_config, _DEEPSEEK_FIELDS),
}


def _block_fp8(quantization) -> bool:
    """DeepSeek-V3's block-wise fp8 (quant_method "fp8" with a weight_block_size): every weight
    keeps its shape, one byte a value, plus one float32 scale per block that is not a parameter."""
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8" \
        and bool(quantization.get("weight_block_size"))


def _check_fields(hf: dict, model_type: str, spec: dict) -> None:
    moe = [key for key in _MOE_FIELDS if hf.get(key)]
    if moe and not spec.get("moe"):
        readers = sorted(name for name, (_, fields) in _FROM_HF.items() if fields.get("moe"))
        raise ValueError(f"{model_type} config has mixture-of-experts fields {moe}; a {model_type} model is "
                         f"dense. Mixtures of experts are read as the model types {readers}")
    required = _HF_REQUIRED_COMMON | spec["required"]
    for key, (allowed, why) in required.items():
        if key == "quantization_config" and _block_fp8(hf.get(key)):
            continue
        if key in hf and hf[key] not in allowed:
            raise ValueError(f"{model_type} config has {key}={hf[key]!r}; tutorial_lib supports only "
                             f"{' or '.join(map(repr, allowed))} ({why})")
    known = _HF_METADATA | spec["read"] | set(spec["ignored"]) | set(required)
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ValueError(f"{model_type} config has fields tutorial_lib does not know: {unknown}; it cannot "
                         "tell whether they change the architecture, so it will not guess a count")


def from_hf_config(hf: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` dict (``model_type`` decides how it is read).

    Supported: ``gpt2``, ``bert`` (BertModel: embeddings, encoder, pooler), ``t5``
    (T5ForConditionalGeneration), the LLaMA family ``llama``, ``mistral``, ``qwen2``,
    ``gemma``, ``phi3``, and the mixtures of experts ``mixtral``, ``qwen2_moe`` (Qwen1.5-MoE),
    ``qwen3_moe``, ``deepseek_v2`` and ``deepseek_v3``. Fields that change the computation but
    no parameter (dropout, RoPE scaling, sliding windows, how a router scores and picks its
    experts: DeepSeek's sigmoid scores, expert groups and scaling factor) are accepted and not
    described by the result. A field that would change the parameters in a way ModelConfig
    does not describe (pruned heads, cross-attention in a decoder, quantization other than
    block-wise fp8), or any field this reader does not know, raises a ValueError rather than
    giving a wrong count.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"expected a config.json dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type in _UNSUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: it has {_UNSUPPORTED_TYPES[model_type]}, "
                         f"which ModelConfig does not describe; supported: {sorted(_FROM_HF)}")
    if model_type not in _FROM_HF:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(_FROM_HF)}")
    build, spec = _FROM_HF[model_type]
    _check_fields(hf, model_type, spec)
    return build(hf)
