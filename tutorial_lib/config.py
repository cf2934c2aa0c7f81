"""One frozen dataclass that describes a model's shape and choices, and named presets.

Change a preset with ``dataclasses.replace(GPT_TINY, d_model=128)``: fields left as ``None``
(``n_kv_heads``, ``head_dim``, ``d_ff``, the per-part biases) are resolved by the properties
below every time they are read, so a replaced ``d_model`` or ``bias`` carries through.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

FAMILIES = ("encoder", "decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_ORDERS = ("pre", "post")
FFNS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
BIAS_PARTS = ("qkv", "out", "ffn", "norm")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and choices of a Transformer. Validated on construction.

    family: "encoder" (BERT-like), "decoder" (GPT/LLaMA-like) or "encoder-decoder".
    n_kv_heads < n_heads gives grouped-query attention; head_dim defaults to d_model / n_heads;
    d_ff defaults to 4 * d_model. ``bias`` switches every bias; ``qkv_bias``, ``out_bias``,
    ``ffn_bias`` and ``norm_bias`` override it for one part.
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
    # initialisation (see tutorial_lib.layers.init_weights)
    init_std: float = 0.02
    qk_gain: float = 1.0  # multiplies the initial W_Q and W_K
    zero_init_out: bool = False  # residual-branch output projections start at zero
    scale_residual_init: bool = False  # ... or scaled by 1/sqrt(2 * n_layers)

    def __post_init__(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
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
        if self.positions == "rope" and self.d_k % 2:
            raise ValueError(f"RoPE needs an even head width, got d_k = {self.d_k}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.qk_gain <= 0:
            raise ValueError("norm_eps, init_std and qk_gain must be positive, got "
                             f"{self.norm_eps}, {self.init_std}, {self.qk_gain}")
        if self.zero_init_out and self.scale_residual_init:
            raise ValueError("choose zero_init_out or scale_residual_init, not both")
        if self.family != "encoder-decoder" and (self.n_decoder_layers is not None or self.share_embeddings
                                                 or self.src_vocab_size is not None):
            raise ValueError("n_decoder_layers, src_vocab_size and share_embeddings belong to "
                             f"encoder-decoder models, not family={self.family!r}")
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            raise ValueError("shared embeddings need one vocabulary: src_vocab_size "
                             f"{self.src_vocab_size} != vocab_size {self.vocab_size}")

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
        """SwiGLU and GeGLU have three matrices (gate, up, down) instead of two."""
        return self.ffn in ("swiglu", "geglu")

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

PRESETS = {"gpt-tiny": GPT_TINY, "llama-tiny": LLAMA_TINY, "gpt2-small": GPT2_SMALL,
           "llama2-7b": LLAMA2_7B}


def preset(name: str, **changes) -> ModelConfig:
    """A named preset, optionally with some fields replaced."""
    from dataclasses import replace

    if name not in PRESETS:
        raise ValueError(f"no preset named {name!r}; the presets are {sorted(PRESETS)}")
    return replace(PRESETS[name], **changes)


# ---- Hugging Face config.json ---------------------------------------------------------------


def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _gpt2_config(hf: dict) -> ModelConfig:
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu"}.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise ValueError(f"unsupported GPT-2 activation_function {hf.get('activation_function')!r}")
    return ModelConfig(
        family="decoder", vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"],
        n_heads=hf["n_head"], d_ff=hf.get("n_inner"), max_len=hf["n_positions"], norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), ffn=activation, positions="learned", bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def _llama_config(hf: dict) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported LLaMA hidden_act {hf.get('hidden_act')!r} (expected 'silu')")
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        family="decoder", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim=hf.get("head_dim"),
        d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), ffn="swiglu", positions="rope", rope_base=_rope_theta(hf),
        bias=False, qkv_bias=attention_bias, out_bias=attention_bias, ffn_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


_FROM_HF = {"gpt2": _gpt2_config, "llama": _llama_config}


def from_hf_config(hf: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` dict (``model_type`` decides how it is read)."""
    if not isinstance(hf, dict):
        raise ValueError(f"expected a config.json dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in _FROM_HF:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(_FROM_HF)}")
    return _FROM_HF[model_type](hf)
