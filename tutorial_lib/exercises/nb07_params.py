"""Exercises of notebook 07 (parameter counter): counting a block, a whole GPT, the KV cache and
the FLOPs of a training step; and, for the going-further notebook 07a, the parameters a mixture
of experts uses per token (07.active_params). Answers are exact integers."""

from __future__ import annotations

from dataclasses import replace

from ..config import MIXTRAL_8X7B, ModelConfig
from .core import Exercise, Mistake

# ---- 07.block_parameters: one decoder block with grouped-query attention ---------------------


def block_count(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    """Q and O: d x d; K and V: d x (n_kv_heads * d_k); FFN: 2 or 3 matrices; two norms.
    bias=True: every projection has a bias and the norms are LayerNorms (scale and shift);
    bias=False: no biases and RMSNorms (scale only)."""
    d_k = d_model // n_heads
    kv_width = n_kv_heads * d_k
    attention = 2 * d_model * d_model + 2 * d_model * kv_width
    n_matrices = 3 if gated else 2
    ffn = n_matrices * d_model * d_ff
    if bias:
        attention += 2 * d_model + 2 * kv_width
        ffn += (n_matrices - 1) * d_ff + d_model
    norms = 2 * (2 * d_model if bias else d_model)
    return attention + ffn + norms


def _block_cases():
    #       d,   h, kv, d_ff, gated, bias
    return [(32, 4, 4, 128, False, True),    # GPT-like
            (64, 8, 2, 172, True, False),    # LLaMA-like with grouped-query attention
            (48, 6, 3, 96, True, True),      # gated, biased, grouped
            (16, 4, 1, 64, False, False)]    # multi-query, plain FFN


def _block_ignores_gqa(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    return block_count(d_model, n_heads, n_heads, d_ff, gated, bias)


def _block_no_gate(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    return block_count(d_model, n_heads, n_kv_heads, d_ff, False, bias)


def _block_no_norms(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    return block_count(d_model, n_heads, n_kv_heads, d_ff, gated, bias) - 2 * (2 * d_model if bias else d_model)


def _block_norm_scale_only(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    return block_count(d_model, n_heads, n_kv_heads, d_ff, gated, bias) - (2 * d_model if bias else 0)


# ---- 07.gpt_parameters: a whole GPT-2-shaped model ------------------------------------------------


def gpt_parameters(vocab_size, context, d_model, n_layers):
    """GPT-2's layout: token and learned position tables, n_layers pre-LN blocks (biases
    everywhere, d_ff = 4 d, two LayerNorms), a final LayerNorm, a head tied to the tokens."""
    d = d_model
    per_block = 12 * d * d + 13 * d  # 4d^2 + 4d attention, 8d^2 + 5d FFN, 4d norms
    return vocab_size * d + context * d + n_layers * per_block + 2 * d


def _gpt_cases():
    return [(50257, 1024, 768, 12), (100, 16, 32, 2), (40478, 512, 768, 12), (1000, 64, 48, 3)]


def _gpt_head_twice(vocab_size, context, d_model, n_layers):
    return gpt_parameters(vocab_size, context, d_model, n_layers) + vocab_size * d_model


def _gpt_no_positions(vocab_size, context, d_model, n_layers):
    return gpt_parameters(vocab_size, context, d_model, n_layers) - context * d_model


def _gpt_no_biases(vocab_size, context, d_model, n_layers):
    return gpt_parameters(vocab_size, context, d_model, n_layers) - n_layers * 9 * d_model


def _gpt_no_final_norm(vocab_size, context, d_model, n_layers):
    return gpt_parameters(vocab_size, context, d_model, n_layers) - 2 * d_model


# ---- 07.kv_cache_bytes ------------------------------------------------------------------------------


def cache_bytes(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value):
    """Keys and values of n_kv_heads heads, per layer, position and sequence."""
    return 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * bytes_per_value


def _kv_cases():
    #       L,  B,  T,    h,  kv, d_k, bytes
    return [(32, 1, 4096, 32, 32, 128, 2),   # Llama-2-7B
            (80, 4, 2048, 64, 8, 128, 2),    # Llama-2-70B
            (2, 3, 10, 4, 2, 8, 4),
            (12, 2, 100, 12, 12, 64, 1)]


def _kv_no_values(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value):
    return cache_bytes(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value) // 2


def _kv_query_heads(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value):
    return cache_bytes(n_layers, batch, seq_len, n_heads, n_heads, head_dim, bytes_per_value)


def _kv_one_layer(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value):
    return cache_bytes(1, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value)


# ---- 07.training_flops ---------------------------------------------------------------------------


def training_flops(matrix_params, n_layers, context, d_attn):
    """FLOPs to train on one token: 2 per weight-matrix entry forward, plus attention's
    q.k scores and weighted sum of values (2 * context * d_attn each, per layer); the
    backward pass costs twice the forward."""
    forward = 2 * matrix_params + n_layers * 2 * 2 * context * d_attn
    return 3 * forward


def _flops_cases():
    return [(6_476_005_376 + 131_072_000, 32, 4096, 4096), (84_934_656 + 38_597_376, 12, 1024, 768),
            (1000, 2, 10, 8)]


def _flops_forward_only(matrix_params, n_layers, context, d_attn):
    return training_flops(matrix_params, n_layers, context, d_attn) // 3


def _flops_one_per_multiply_add(matrix_params, n_layers, context, d_attn):
    return training_flops(matrix_params, n_layers, context, d_attn) // 2


def _flops_scores_only(matrix_params, n_layers, context, d_attn):
    return 3 * (2 * matrix_params + n_layers * 2 * context * d_attn)


def _flops_no_attention(matrix_params, n_layers, context, d_attn):
    return 6 * matrix_params


# ---- 07.active_params: the parameters one token uses in a mixture of experts --------------------


def active_count(cfg):
    """One token's path through a LLaMA-style decoder (no biases, RMSNorms, SwiGLU FFNs,
    grouped-query attention, no position table): the token table, every layer's attention and
    two norms, the dense FFN of each dense layer, and in each MoE layer the router, the
    experts_per_token routed experts and the shared experts; the final norm; the head unless
    it is tied to the token table."""
    d = cfg.d_model
    attention = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.kv_heads * cfg.head_dim  # W_Q, W_O; W_K, W_V
    moe_ffn = (d * cfg.n_experts  # the router
               + cfg.experts_per_token * 3 * d * cfg.expert_dim + cfg.n_shared_experts * 3 * d * cfg.shared_dim)
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.n_layers - n_moe
    table = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else table
    return (table + cfg.n_layers * (attention + 2 * d) + n_dense * 3 * d * cfg.ffn_dim + n_moe * moe_ffn
            + d + head)


def _moe(**fields):
    llama_style = dict(norm="rmsnorm", ffn="swiglu", positions="rope", bias=False, tie_embeddings=False)
    return ModelConfig(**(llama_style | fields))


def _active_cases():
    return [
        # Mixtral-shaped: every layer a mixture, 2 of 4 experts as wide as the dense FFN
        (_moe(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4,
              experts_per_token=2),),
        # DeepSeek-shaped: a dense first layer, narrow experts, two shared ones
        (_moe(vocab_size=120, d_model=48, n_layers=4, n_heads=6, n_kv_heads=2, d_ff=128, n_experts=8,
              experts_per_token=2, expert_d_ff=32, n_shared_experts=2, dense_layers=(0,)),),
        # Switch-shaped, tied head: 1 of 8 experts, a dense layer in the middle
        (_moe(vocab_size=64, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, n_experts=8,
              experts_per_token=1, expert_d_ff=40, dense_layers=(1,), tie_embeddings=True),),
        # a shared expert wider than the routed ones (as in Qwen1.5-MoE)
        (_moe(vocab_size=80, d_model=24, n_layers=2, n_heads=3, n_kv_heads=3, d_ff=96, n_experts=6,
              experts_per_token=3, expert_d_ff=16, n_shared_experts=1, shared_d_ff=48),),
        (MIXTRAL_8X7B,),  # 12,879,925,248
    ]


def _unused_experts(cfg):
    return len(cfg.moe_layers) * (cfg.n_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.expert_dim


def _active_every_expert(cfg):
    return active_count(cfg) + _unused_experts(cfg)


def _active_no_router(cfg):
    return active_count(cfg) - len(cfg.moe_layers) * cfg.d_model * cfg.n_experts


def _active_no_shared(cfg):
    return active_count(cfg) - len(cfg.moe_layers) * cfg.n_shared_experts * 3 * cfg.d_model * cfg.shared_dim


def _active_every_layer_moe(cfg):
    return active_count(replace(cfg, dense_layers=()))


def _active_experts_at_dense_width(cfg):
    shared = cfg.shared_dim if cfg.n_shared_experts else None  # the shared experts keep their width
    return active_count(replace(cfg, expert_d_ff=cfg.ffn_dim, shared_d_ff=shared))


def _active_without_token_table(cfg):
    return active_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


def _active_tied_head_twice(cfg):
    return active_count(cfg) + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)


# Building a model (or a config) and letting the library or PyTorch count it hands in the answer.
_COUNTERS = ("block_parameters", "expected_parameters", "count_parameters", "unique_parameter_count", "numel",
             "from_hf_config", "ModelConfig")

EXERCISES = [
    Exercise(
        name="07.block_parameters",
        task="block_parameters(d_model, n_heads, n_kv_heads, d_ff, gated, bias): the parameters of one "
             "pre-LN decoder block with grouped-query attention (d_k = d_model / n_heads), an FFN with "
             "2 matrices (3 when gated), biases on every projection and LayerNorms when bias=True, no "
             "biases and RMSNorms when bias=False.",
        cases=_block_cases,
        reference=block_count,
        forbidden=_COUNTERS,
        mistakes={
            "K and V counted with every query head": Mistake(
                _block_ignores_gqa, "With grouped-query attention K and V have only n_kv_heads heads: "
                                    "each is d_model x (n_kv_heads * d_k), not d_model x d_model."),
            "forgot the gate matrix": Mistake(
                _block_no_gate, "A gated FFN (SwiGLU, GeGLU) has three matrices: gate and up "
                                "(d_model x d_ff each) and down (d_ff x d_model)."),
            "forgot the norms": Mistake(
                _block_no_norms, "A pre-LN block has two norms, each with d_model scales (and d_model "
                                 "shifts for LayerNorm)."),
            "LayerNorm counted without its shift": Mistake(
                _block_norm_scale_only, "LayerNorm learns a scale and a shift, 2 * d_model; only RMSNorm "
                                        "has the scale alone."),
        },
    ),
    Exercise(
        name="07.gpt_parameters",
        task="gpt_parameters(vocab_size, context, d_model, n_layers): the parameters of a GPT-2-shaped "
             "model: token and learned position tables, blocks with biases everywhere, d_ff = 4 d and "
             "two LayerNorms, a final LayerNorm, and an output head tied to the token table.",
        cases=_gpt_cases,
        reference=gpt_parameters,
        forbidden=_COUNTERS,
        mistakes={
            "counted the tied head twice": Mistake(
                _gpt_head_twice, "The head is the token table itself (tied): its V x d entries are "
                                 "counted once."),
            "forgot the position table": Mistake(
                _gpt_no_positions, "GPT-2 learns a vector per position: context x d_model more."),
            "forgot the biases": Mistake(
                _gpt_no_biases, "Every Linear has a bias: 3d (Q, K, V) + d (O) + 4d (FFN up) + d (FFN "
                                "down) = 9d per block."),
            "forgot the final LayerNorm": Mistake(
                _gpt_no_final_norm, "A pre-LN stack ends with one more LayerNorm (2 * d_model) before "
                                    "the head."),
        },
    ),
    Exercise(
        name="07.kv_cache_bytes",
        task="kv_cache_bytes(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value): "
             "the bytes of the key/value cache of a decoder-only model.",
        cases=_kv_cases,
        reference=cache_bytes,
        forbidden=("kv_cache_bytes", "KVCache", "nbytes", "new_cache"),
        mistakes={
            "forgot the values (or the keys)": Mistake(
                _kv_no_values, "The cache holds keys and values: a factor of 2."),
            "used the query heads": Mistake(
                _kv_query_heads, "Only the key/value heads are cached; with grouped-query attention "
                                 "there are n_kv_heads of them, fewer than n_heads."),
            "counted one layer": Mistake(
                _kv_one_layer, "Every layer keeps its own keys and values: multiply by n_layers."),
        },
    ),
    Exercise(
        name="07.training_flops",
        task="training_flops(matrix_params, n_layers, context, d_attn): FLOPs to train on one token: "
             "2 per weight-matrix entry in the forward pass, plus attention's scores and weighted sum "
             "over `context` keys (2 * context * d_attn each, per layer), and a backward pass that "
             "costs twice the forward.",
        cases=_flops_cases,
        reference=training_flops,
        forbidden=("flops_per_token", "FlopCounterMode", "get_total_flops"),
        mistakes={
            "forward pass only": Mistake(
                _flops_forward_only, "Training also runs the backward pass, about twice the forward "
                                     "(gradients for the inputs and for the weights): 3x in all."),
            "one FLOP per multiply-add": Mistake(
                _flops_one_per_multiply_add, "A multiply-add is two floating-point operations: a matrix "
                                             "entry costs 2 FLOPs per token, not 1."),
            "counted the scores but not the weighted sum": Mistake(
                _flops_scores_only, "Attention multiplies twice: q.k for the scores and weights @ v "
                                    "for the output, 2 * context * d_attn each."),
            "forgot attention": Mistake(
                _flops_no_attention, "The weight matrices are not all: each token is scored against "
                                     "`context` keys in every layer."),
        },
    ),
    Exercise(
        name="07.active_params",
        task="active_params(cfg): the parameters one token uses in the mixture of experts `cfg` (a "
             "LLaMA-style decoder: no biases, RMSNorms, SwiGLU FFNs and experts, grouped-query "
             "attention, no position table): the token table, each layer's attention and two norms, "
             "a dense FFN in the dense layers, and in each MoE layer the router and the "
             "experts_per_token routed experts plus the shared experts; the final norm; the head "
             "unless tied.",
        cases=_active_cases,
        reference=active_count,
        # every library counter, and building the model, hands in the answer
        forbidden=("expected_parameters", "active_parameters", "block_parameters", "expert_parameters",
                   "count_parameters", "unique_parameter_count", "numel", "flops_per_token", "report",
                   "DecoderOnlyLM", "MoEFeedForward"),
        mistakes={
            "counted every routed expert": Mistake(
                _active_every_expert, "That is the total, what memory holds. A token goes through only "
                                      "experts_per_token of the n_experts routed experts in each MoE layer."),
            "forgot the router": Mistake(
                _active_no_router, "Every token is scored against every expert: each MoE layer's router, "
                                   "d_model x n_experts, is on its path."),
            "forgot the shared experts": Mistake(
                _active_no_shared, "Shared experts see every token, besides its routed ones: "
                                   "n_shared_experts FFNs of width cfg.shared_dim in each MoE layer."),
            "treated the dense layers as mixtures": Mistake(
                _active_every_layer_moe, "The layers in cfg.dense_layers keep one dense FFN of width "
                                         "cfg.ffn_dim; only cfg.moe_layers have a router and experts."),
            "gave the experts the dense FFN's width": Mistake(
                _active_experts_at_dense_width, "A routed expert is cfg.expert_dim wide (and a shared one "
                                                "cfg.shared_dim), often much narrower than cfg.ffn_dim."),
            "left out the token table": Mistake(
                _active_without_token_table, "A token reads one row of the table, but the published "
                                             "active counts, and this course, count the table whole."),
            "counted the tied head twice": Mistake(
                _active_tied_head_twice, "With tie_embeddings the head is the token table: count it once."),
        },
    ),
]
