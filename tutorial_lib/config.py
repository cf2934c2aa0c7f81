"""The frozen dataclass a model is built from (:class:`ModelConfig`), its validation, and
named presets.

Every field of a ModelConfig is one that tutorial_lib's models build. Parts of published
models that are counted but not built here (BERT's token-type table, embedding norm and
pooler; Qwen3's query/key norms; DeepSeek's latent attention and multi-token prediction) live
where counting is described, in the subclass :class:`tutorial_lib.params.CountedConfig`; a
model's constructor refuses a config that asks for one of them, naming it
(:meth:`ModelConfig.unbuilt_parts`), so that no model is silently built without a part its
config describes. Reading Hugging Face ``config.json`` files is :mod:`tutorial_lib.hf_config`.

Change a preset with ``dataclasses.replace(GPT_TINY, d_model=128)``.

One name for the head width: ``head_dim``. Left out (or None) it is d_model / n_heads, and
the config holds that value from construction on, so ``cfg.head_dim`` is the width the model
uses. Such a computed value is a :class:`Derived` int: ``dataclasses.replace`` hands every
field back to the constructor, which computes a Derived one again from the new fields, so a
replaced d_model or n_heads carries through to the head width, while a head width given
explicitly (Gemma's 256 with d_model 3072 and 16 heads) is kept. :meth:`ModelConfig.to_dict`
writes a Derived value as None, as it was given. (Prose and shape comments call the head
width d_k, the papers' symbol; code reads head_dim.)

The other fields left as ``None`` (``n_kv_heads``, ``d_ff``, the per-part biases, ...) are
overrides: None means "the default", and the properties below (``kv_heads``, ``ffn_dim``,
``uses_bias``) resolve it when read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .checks import check_count, check_number

FAMILIES = ("encoder", "decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_ORDERS = ("pre", "post")
FFNS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh")
GATED_FFNS = ("swiglu", "geglu", "geglu_tanh")  # three matrices: gate, up, down
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
BIAS_PARTS = ("qkv", "out", "ffn", "norm")


_OPTIONAL_BOOL_FIELDS = ("final_norm", "qkv_bias", "out_bias", "ffn_bias", "norm_bias")
_BOOL_FIELDS = ("bias", "tie_embeddings", "scale_embeddings", "share_embeddings", "zero_init_out",
                "scale_residual_init", "shared_expert_gate", "renormalise_topk") + _OPTIONAL_BOOL_FIELDS


class Derived(int):
    """An int that a config computed from its other fields rather than was given (head_dim =
    d_model // n_heads). It reads, computes and compares as the plain int. The constructor
    computes a Derived field again from the other fields, which is what makes
    ``dataclasses.replace(cfg, d_model=...)`` carry through to it."""

    __slots__ = ()


@dataclass(frozen=True)
class ModelConfig:
    """Shape and choices of a Transformer that tutorial_lib builds. Validated on construction.

    family: "encoder" (BERT-like), "decoder" (GPT/LLaMA-like) or "encoder-decoder".
    n_kv_heads < n_heads gives grouped-query attention; head_dim (one head's width) defaults to
    d_model / n_heads and holds that value once the config is made (see the module docstring);
    d_ff defaults to 4 * d_model. ``bias`` switches every bias; ``qkv_bias``, ``out_bias``,
    ``ffn_bias`` and ``norm_bias`` override it for one part.

    ``positions="relative"`` is T5's learned relative-position bias: one table of
    ``relative_buckets`` x ``n_heads`` per self-attention stack, shared by its layers
    (:class:`tutorial_lib.positions.RelativePositionBias`). T5 itself also leaves out the
    1/sqrt(d_k) of attention; tutorial_lib keeps it (T5's W_Q times sqrt(d_k) gives the same
    scores).

    Mixtures of experts (decoder-only; built by :mod:`tutorial_lib.moe`): with ``n_experts > 0``
    every layer not in ``dense_layers`` replaces its feed-forward network by ``n_experts``
    routed experts of inner width ``expert_d_ff`` (default d_ff), of which each token uses
    ``experts_per_token``, plus ``n_shared_experts`` of width ``shared_d_ff`` that every token
    uses (scaled by a sigmoid gate when ``shared_expert_gate``). ``renormalise_topk``: the k
    chosen router probabilities are divided by their sum (Mixtral); otherwise they keep the
    values of the softmax over all experts (Qwen1.5-MoE, DeepSeek-V2). Layers in
    ``dense_layers`` keep a dense FFN of width d_ff.

    Parts that published models have and tutorial_lib counts but does not build are fields of
    :class:`tutorial_lib.params.CountedConfig`, not of this class.
    """

    family: str = "decoder"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None  # None: d_model // n_heads, held as a Derived int from construction on
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
    # initialisation (see tutorial_lib.layers.init_weights)
    init_std: float = 0.02
    qk_gain: float = 1.0  # multiplies the initial W_Q and W_K
    zero_init_out: bool = False  # residual-branch output projections start at zero
    scale_residual_init: bool = False  # ... or scaled by 1/sqrt(residual branches): layers.init_weights

    def __post_init__(self) -> None:
        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "relative_buckets",
                     "relative_max_distance"):
            check_count(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "d_ff", "n_decoder_layers", "src_vocab_size"):
            check_count(name, getattr(self, name), optional=True)
        choice("family", FAMILIES)
        choice("norm", NORMS)
        choice("norm_order", NORM_ORDERS)
        choice("ffn", FFNS)
        choice("positions", POSITIONS)
        if self.head_dim is None or isinstance(self.head_dim, Derived):  # not given: computed (again)
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), "
                                 "or give head_dim explicitly")
            object.__setattr__(self, "head_dim", Derived(self.d_model // self.n_heads))
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        self._check_rope()
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        for name in ("norm_eps", "rope_base", "init_std", "qk_gain", "dropout"):
            check_number(name, getattr(self, name))
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
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            raise ValueError("shared embeddings need one vocabulary: src_vocab_size "
                             f"{self.src_vocab_size} != vocab_size {self.vocab_size}")
        self._check_experts()

    def _check_rope(self) -> None:
        """RoPE rotates pairs of a head's dimensions: it needs an even head width.
        (CountedConfig's latent attention rotates other dimensions and checks those.)"""
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head width, got head_dim = {self.head_dim}")

    def _check_experts(self) -> None:
        for name in ("n_experts", "n_shared_experts"):
            check_count(name, getattr(self, name), 0)
        for name in ("expert_d_ff", "shared_d_ff"):
            check_count(name, getattr(self, name), optional=True)
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
        check_count("experts_per_token", self.experts_per_token, maximum=self.n_experts, bound_name="n_experts")
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

    def unbuilt_parts(self) -> list[str]:
        """The parts this config asks for that tutorial_lib does not build, each as
        "field=value (what it is)": none for a ModelConfig. The model classes refuse a config
        for which this is not empty (:func:`tutorial_lib.layers.refuse_unbuilt_parts`)."""
        return []

    # ---- resolved values ------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads (plain multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

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

    def to_dict(self) -> dict:
        """The fields as given: a Derived value (computed, not given) is written as None, so
        that ``type(cfg).from_dict(cfg.to_dict())`` is the same config, also under replace."""
        return {name: None if isinstance(value, Derived) else value for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


def from_hf_config(hf: dict) -> ModelConfig:
    """The config of a Hugging Face ``config.json`` dict, for counting: see
    :func:`tutorial_lib.hf_config.from_hf_config`, where reading config.json lives. Kept here
    because the frozen tests/test_bad_inputs.py imports it from this module."""
    from .hf_config import from_hf_config as read  # hf_config imports this module: imported on use

    return read(hf)


# ---- presets ----------------------------------------------------------------------------------
# Tiny models for the notebooks (vocab_size is replaced by the tokenizer's), and the real
# shapes of published models, for counting parameters and memory. Published models with parts
# tutorial_lib does not build (BERT-base, Qwen3-30B-A3B, DeepSeek-V3) are presets of
# tutorial_lib.params, where counting lives.

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
# Each is what tutorial_lib.hf_config.from_hf_config reads from the model's Hugging Face
# config.json (tests check that), except the two Transformers of Vaswani et al. (2017), which
# come from the paper.

LLAMA2_13B = replace(LLAMA2_7B, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824)

# Llama-2-70B: grouped-query attention with 8 key/value heads.
LLAMA2_70B = replace(LLAMA2_7B, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)

# Mistral-7B-v0.1 (Jiang et al., 2023; "mistralai/Mistral-7B-v0.1" config.json). Its sliding
# window of 4096 changes the attention mask, not the parameters.
MISTRAL_7B = replace(LLAMA2_7B, n_kv_heads=8, d_ff=14336, max_len=32768)

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

# ---- mixtures of experts (counted in notebook 07a; each is what from_hf_config reads) -----------

# Mixtral-8x7B-v0.1 (Jiang et al., 2024; "mistralai/Mixtral-8x7B-v0.1" config.json): Mistral-7B's
# attention, and in every layer 8 SwiGLU experts of Mistral's width, 2 per token.
MIXTRAL_8X7B = replace(MISTRAL_7B, rope_base=1e6, n_experts=8, experts_per_token=2)

PRESETS = {"gpt-tiny": GPT_TINY, "llama-tiny": LLAMA_TINY, "gpt2-small": GPT2_SMALL,
           "llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B,
           "mistral-7b": MISTRAL_7B, "t5-small": T5_SMALL,
           "transformer-base": TRANSFORMER_BASE, "transformer-big": TRANSFORMER_BIG,
           "mixtral-8x7b": MIXTRAL_8X7B}


def preset(name: str, **changes) -> ModelConfig:
    """A named preset, optionally with some fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"no preset named {name!r}; the presets are {sorted(PRESETS)} (tutorial_lib.params.PRESETS "
                         "adds the published models with parts that are counted, not built)")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {unknown}; known fields are {sorted(known)}")
    return replace(PRESETS[name], **changes)
