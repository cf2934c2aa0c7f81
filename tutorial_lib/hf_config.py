"""Reading Hugging Face ``config.json`` files: one reader, two uses.

A ``config.json`` says more than a config of tutorial_lib holds. Every field is sorted into
one of these kinds, per ``model_type``, so that nothing is dropped without a reason:

    read      turned into config fields;
    metadata  bookkeeping, token ids, labels, generation settings (_HF_METADATA);
    ignored   changes what the model computes, or how it is trained, but no parameter shape
              (dropout, how a router picks its experts), named with its reason in the reader;
    required  changes the parameters or the kind of model at any value but the ones allowed;
    VERDICTS  the fields that the two uses below judge differently: one table, with the
              reason for each use.

The two uses:

* **Counting**, :func:`from_hf_config` (notebook 07, :mod:`tutorial_lib.params`): the shape of
  the model, to count its parameters, memory and FLOPs. A field that changes what the model
  computes but no parameter (RoPE scaling, sliding windows) is accepted. Counting is strict
  about what it has never seen: any field no list above names is a ValueError, since it
  cannot tell whether the field changes the count, and it will not guess one. It returns a
  :class:`~tutorial_lib.config.ModelConfig`, or a :class:`~tutorial_lib.params.CountedConfig`
  when the model has parts tutorial_lib counts but does not build (BERT's token types and
  pooler, Qwen3's query/key norms, DeepSeek's latent attention).

* **Loading**, :func:`decoder_config` (:func:`tutorial_lib.pretrained.load_pretrained`,
  :func:`tutorial_lib.convert.from_hf_model`): the config the course's model is built from to
  take a checkpoint's weights, which must then compute what the original computes. It
  refuses what would change the computation: the entries of VERDICTS at the values their
  ``loading_refuses`` picks (scaled or interleaved RoPE, partial rotary, GPT-2's attention
  scaling variants, quantized weights), and everything counting refuses but unknown fields.
  A field it has never seen (real files carry such metadata: ``transformers.js_config`` and
  the like) gets a warning naming it, not a refusal: every tensor's name and shape is checked
  against the model before a weight is read, so such a field cannot change a parameter
  unnoticed, and transformers' models ignore a field their config class does not define; what
  the loader cannot check is whether the field changes the computation, hence the warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import fields, replace
from typing import NamedTuple

from .config import ModelConfig
from .params import COUNTED_FIELDS, CountedConfig

# ---- what any config.json may carry ----------------------------------------------------------------

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


# ---- the fields that counting and loading judge differently --------------------------------------------


def _never(value) -> bool:
    return False


def _rope_type(rope) -> str:
    """The RoPE variant of a rope_scaling or rope_parameters value ("default": plain RoPE)."""
    if rope is None:
        return "default"
    if not isinstance(rope, dict):
        return repr(rope)
    return rope.get("rope_type", rope.get("type", "default"))


def _block_fp8(quantization) -> bool:
    """DeepSeek-V3's block-wise fp8 (quant_method "fp8" with a weight_block_size): every weight
    keeps its shape, one byte a value, plus one float32 scale per block that is not a parameter."""
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8" \
        and bool(quantization.get("weight_block_size"))


class Verdict(NamedTuple):
    """How counting and loading judge one config.json field, each with its reason.

    ``counting``: why counting accepts the field (and, where ``counting_refuses`` picks some
    values, why it refuses those). ``loading``: why loading refuses the values
    ``loading_refuses`` picks, because the course's model would compute something else, or,
    where it refuses none, what loading does with the field."""

    counting: str
    loading: str
    loading_refuses: Callable[[object], bool] = _never
    counting_refuses: Callable[[object], bool] = _never


_WINDOW_COUNTING = "a sliding-window mask changes which keys are attended, not the parameters"
_WINDOW_LOADING = ("an active window W shorter than the context becomes the context limit (max_len = W), where "
                   "it changes nothing: every query sees at most W keys")

VERDICTS = {
    "rope_scaling": Verdict(
        counting="RoPE scaling changes the rotation frequencies, not the parameters",
        loading="scaled RoPE (linear, dynamic, YaRN, llama3, ...) rotates by other angles than the course's "
                "RotaryEmbedding, which has no scaling",
        loading_refuses=lambda rope: _rope_type(rope) != "default"),
    "rope_parameters": Verdict(
        counting="read for rope_theta; its scaling keys change the rotation frequencies, not the parameters",
        loading="read for rope_theta; a rope_type other than 'default' is scaled RoPE, which rotates by other "
                "angles than the course's RotaryEmbedding",
        loading_refuses=lambda rope: _rope_type(rope) != "default"),
    "rope_interleaved": Verdict(
        counting="which dimensions RoPE rotates together, not a parameter (SmolLM2's config says false)",
        loading="true rotates adjacent pairs of dimensions, where the course's RoPE rotates the two halves of "
                "each head together",
        loading_refuses=bool),
    "partial_rotary_factor": Verdict(
        counting="how much of each head RoPE rotates, not a parameter",
        loading="a factor below 1 rotates only part of each head, where the course's RoPE rotates all of it",
        loading_refuses=lambda factor: factor not in (None, 1, 1.0)),
    "scale_attn_by_inverse_layer_idx": Verdict(
        counting="how attention scores are scaled, not a parameter",
        loading="true also divides the scores of layer i by i + 1, which the course's attention does not",
        loading_refuses=bool),
    "scale_attn_weights": Verdict(
        counting="how attention scores are scaled, not a parameter",
        loading="false leaves out the 1/sqrt(d_k) of the scores, which the course's attention applies",
        loading_refuses=lambda scale: scale is False),
    "sliding_window": Verdict(counting=_WINDOW_COUNTING, loading=_WINDOW_LOADING),
    "use_sliding_window": Verdict(counting=_WINDOW_COUNTING, loading="whether Qwen2's sliding_window is active"),
    "max_window_layers": Verdict(
        counting=_WINDOW_COUNTING,
        loading="which layers use the window; the context limit of an active window covers them all"),
    "layer_types": Verdict(
        counting="per-layer attention kinds (full or sliding window) share one parameter layout",
        loading="a 'sliding_attention' layer makes the window active, and the context limit of the window "
                "covers the other layers too"),
    "quantization_config": Verdict(
        counting="block-wise fp8 (quant_method 'fp8' with a weight_block_size, as DeepSeek-V3's) keeps every "
                 "weight's shape, one byte a value, plus scales that are not parameters, so it is counted; "
                 "other quantized checkpoints store weights in packed formats, which a config does not describe",
        loading="a quantized checkpoint stores its weights in packed formats or with scale tensors; "
                "load_pretrained reads unquantized weights",
        loading_refuses=lambda quantization: quantization is not None,
        counting_refuses=lambda quantization: quantization is not None and not _block_fp8(quantization)),
}
_VERDICTS_EVERY_TYPE = ("quantization_config",)  # known to counting for every model_type


def _counting(*names: str) -> dict[str, str]:
    """The counting reasons of some VERDICTS entries, as the "ignored" part of a reader's fields."""
    return {name: VERDICTS[name].counting for name in names}


_ROPE_IGNORED = _counting("rope_scaling") | {
    "pretraining_tp": "tensor-parallel slicing of the matrices at pre-training; same shapes, same function",
}
_WINDOW_IGNORED = _counting("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


# ---- the readers, one per model_type: config.json -> config fields ----------------------------------


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


def _gpt2_values(hf: dict) -> dict:
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu"}.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise ValueError(f"unsupported GPT-2 activation_function {hf.get('activation_function')!r}; "
                         "expected gelu_new, gelu_pytorch_tanh, gelu or relu")
    get = lambda key: _hf_get(hf, key, "gpt2")
    return dict(
        family="decoder", vocab_size=get("vocab_size"), d_model=get("n_embd"), n_layers=get("n_layer"),
        n_heads=get("n_head"), d_ff=hf.get("n_inner"), max_len=get("n_positions"), norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), ffn=activation, positions="learned", bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


_GPT2_FIELDS = {
    "read": {"vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "activation_function",
             "layer_norm_epsilon", "tie_word_embeddings"},
    "ignored": _DROPOUTS | _counting("scale_attn_weights", "scale_attn_by_inverse_layer_idx") | {
        "n_ctx": "an old copy of n_positions that transformers no longer reads",
        "summary_type": "the classification head of GPT2DoubleHeadsModel, not part of the language model",
        "summary_use_proj": "the classification head of GPT2DoubleHeadsModel",
        "summary_activation": "the classification head of GPT2DoubleHeadsModel",
        "summary_proj_to_labels": "the classification head of GPT2DoubleHeadsModel",
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


def _llama_like_values(hf: dict) -> dict:
    model_type = hf["model_type"]
    act_field, activations, tie_default = _LLAMA_LIKE[model_type]
    act = hf.get("hidden_activation") or hf.get(act_field) or next(iter(activations))
    if act not in activations:
        raise ValueError(f"unsupported {model_type} {act_field} {act!r}; expected one of {sorted(activations)}")
    get = lambda key: _hf_get(hf, key, model_type)
    d, h = get("hidden_size"), get("num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and d % h == 0 and head_dim == d // h:
        head_dim = None  # the default, d / h: derived, so that a replaced d_model carries through
    if model_type == "qwen2":  # Qwen2 always has biases on Q, K and V, and none on O
        qkv_bias, out_bias = True, False
    elif model_type == "qwen2_moe":  # ... and Qwen2-MoE unless qkv_bias says otherwise
        qkv_bias, out_bias = bool(hf.get("qkv_bias", True)), False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
    return dict(
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
_LLAMA_IGNORED = _DROPOUTS | _ROPE_IGNORED | _counting("rope_interleaved") | {
    "is_llama_config": "a flag of the nanotron trainer (SmolLM2) saying the file describes a LLaMA",
}


def _llama_fields(read=(), ignored=None, required=None) -> dict:
    return {"read": _LLAMA_READ | set(read), "ignored": _LLAMA_IGNORED | (ignored or {}), "required": required or {}}


def _bert_values(hf: dict) -> dict:
    act = hf.get("hidden_act", "gelu")
    ffn = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh"}.get(act)
    if ffn is None:
        raise ValueError(f"unsupported BERT hidden_act {act!r}; expected gelu, gelu_new or relu")
    get = lambda key: _hf_get(hf, key, "bert")
    return dict(
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


def _t5_values(hf: dict) -> dict:
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in _T5_FFNS:
        raise ValueError(f"unsupported T5 feed_forward_proj {proj!r}; expected one of {sorted(_T5_FFNS)}")
    get = lambda key: _hf_get(hf, key, "t5")
    n_layers = get("num_layers")
    n_decoder = hf.get("num_decoder_layers")
    return dict(
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


def _mixtral_values(hf: dict) -> dict:
    """Mixtral: Mistral's attention; every layer's FFN is num_local_experts experts of width
    intermediate_size, each token going to num_experts_per_tok of them (renormalised)."""
    get = lambda key: _hf_get(hf, key, "mixtral")
    return _llama_like_values(hf) | dict(n_experts=get("num_local_experts"),
                                         experts_per_token=get("num_experts_per_tok"))


def _qwen_moe_values(hf: dict) -> dict:
    """Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE: experts of width moe_intermediate_size; Qwen2-MoE
    adds one shared expert of width shared_expert_intermediate_size behind a sigmoid gate, Qwen3
    an RMSNorm on each head's queries and keys (counted, not built). A layer keeps a dense FFN
    of width intermediate_size when it is in mlp_only_layers or when (layer + 1) is not a
    multiple of decoder_sparse_step (transformers' rule)."""
    model_type = hf["model_type"]
    get = lambda key: _hf_get(hf, key, model_type)
    n_experts = hf.get("num_experts") or get("num_local_experts")  # Qwen3-MoE: either name
    step, only_mlp = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    n_layers = get("num_hidden_layers")
    dense = tuple(i for i in range(n_layers) if i in only_mlp or (i + 1) % step)
    shared = {}
    if model_type == "qwen2_moe":
        shared = dict(n_shared_experts=1, shared_d_ff=get("shared_expert_intermediate_size"), shared_expert_gate=True)
    return _llama_like_values(hf) | dict(
        n_experts=n_experts, experts_per_token=get("num_experts_per_tok"), expert_d_ff=get("moe_intermediate_size"),
        renormalise_topk=bool(hf.get("norm_topk_prob", False)), dense_layers=dense,
        qk_norm=model_type == "qwen3_moe", **shared)


def _deepseek_values(hf: dict) -> dict:
    """DeepSeek-V2 and -V3: multi-head latent attention (counted, not built); the first
    first_k_dense_replace layers keep a dense FFN of width intermediate_size, the others have
    n_routed_experts experts of width moe_intermediate_size plus n_shared_experts shared ones
    of the same width."""
    model_type = hf["model_type"]
    get = lambda key: _hf_get(hf, key, model_type)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported {model_type} hidden_act {act!r}; expected 'silu'")
    return dict(
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
    "gpt2": (_gpt2_values, _GPT2_FIELDS),
    "bert": (_bert_values, _BERT_FIELDS),
    "t5": (_t5_values, _T5_FIELDS),
    "llama": (_llama_like_values, _llama_fields(read={"attention_bias", "mlp_bias"})),
    "mistral": (_llama_like_values, _llama_fields(ignored=_WINDOW_IGNORED)),
    "qwen2": (_llama_like_values, _llama_fields(ignored=_WINDOW_IGNORED)),
    "gemma": (_llama_like_values, _llama_fields(
        read={"attention_bias", "hidden_activation"},
        required={"use_bidirectional_attention": ((False, None), "a bidirectional Gemma is an encoder")})),
    "phi3": (_llama_like_values, _llama_fields(
        ignored=_WINDOW_IGNORED | _counting("partial_rotary_factor") | {
            "original_max_position_embeddings": "the context length RoPE scaling starts from"},
        # transformers' Phi3 builds its fused QKV projection without a bias whatever this says
        required={"attention_bias": ((False, None), "Phi3ForCausalLM has no attention biases")})),
    "mixtral": (_mixtral_values, _moe_fields(read={"num_local_experts"})),
    "qwen2_moe": (_qwen_moe_values, _moe_fields(read=_QWEN_MOE_READ | {"shared_expert_intermediate_size", "qkv_bias"})),
    "qwen3_moe": (_qwen_moe_values, _moe_fields(read=_QWEN_MOE_READ | {"num_local_experts", "attention_bias"})),
    "deepseek_v2": (_deepseek_values, _DEEPSEEK_FIELDS),
    "deepseek_v3": (_deepseek_values, _DEEPSEEK_FIELDS),
}

_COUNTED_DEFAULTS = {f.name: f.default for f in fields(CountedConfig) if f.name in COUNTED_FIELDS}


def _config(values: dict) -> ModelConfig:
    """A CountedConfig when ``values`` ask for a part tutorial_lib counts but does not build,
    else a ModelConfig (which has no field for such parts)."""
    if any(values.get(name, default) != default for name, default in _COUNTED_DEFAULTS.items()):
        return CountedConfig(**values)
    return ModelConfig(**{name: value for name, value in values.items() if name not in COUNTED_FIELDS})


def _check_fields(hf: dict, model_type: str, spec: dict) -> list[str]:
    """Refuse what changes the parameters in a way a config does not describe; return the
    fields that no list of this model_type names (unknown)."""
    moe = [key for key in _MOE_FIELDS if hf.get(key)]
    if moe and not spec.get("moe"):
        readers = sorted(name for name, (_, fields_) in _FROM_HF.items() if fields_.get("moe"))
        raise ValueError(f"{model_type} config has mixture-of-experts fields {moe}; a {model_type} model is "
                         f"dense. Mixtures of experts are read as the model types {readers}")
    required = _HF_REQUIRED_COMMON | spec["required"]
    for key, (allowed, why) in required.items():
        if key in hf and hf[key] not in allowed:
            raise ValueError(f"{model_type} config has {key}={hf[key]!r}; tutorial_lib supports only "
                             f"{' or '.join(map(repr, allowed))} ({why})")
    known = _HF_METADATA | spec["read"] | set(spec["ignored"]) | set(required) | set(_VERDICTS_EVERY_TYPE)
    for key in sorted(known & set(VERDICTS)):
        if key in hf and VERDICTS[key].counting_refuses(hf[key]):
            raise ValueError(f"{model_type} config has {key}={hf[key]!r}, which is not counted: "
                             f"{VERDICTS[key].counting}")
    return sorted(set(hf) - known)


def _reader(hf) -> tuple[str, Callable[[dict], dict], dict]:
    if not isinstance(hf, dict):
        raise ValueError(f"expected a config.json dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type in _UNSUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: it has {_UNSUPPORTED_TYPES[model_type]}, "
                         f"which ModelConfig does not describe; supported: {sorted(_FROM_HF)}")
    if model_type not in _FROM_HF:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(_FROM_HF)}")
    build, spec = _FROM_HF[model_type]
    return model_type, build, spec


# ---- counting -----------------------------------------------------------------------------------


def from_hf_config(hf: dict) -> ModelConfig:
    """The config of a Hugging Face ``config.json`` dict, for counting (``model_type`` decides
    how it is read): a ModelConfig, or a :class:`~tutorial_lib.params.CountedConfig` when the
    model has parts tutorial_lib counts but does not build.

    Supported: ``gpt2``, ``bert`` (BertModel: embeddings, encoder, pooler), ``t5``
    (T5ForConditionalGeneration), the LLaMA family ``llama``, ``mistral``, ``qwen2``,
    ``gemma``, ``phi3``, and the mixtures of experts ``mixtral``, ``qwen2_moe`` (Qwen1.5-MoE),
    ``qwen3_moe``, ``deepseek_v2`` and ``deepseek_v3``. Fields that change the computation but
    no parameter (dropout, RoPE scaling, sliding windows, how a router scores and picks its
    experts: DeepSeek's sigmoid scores, expert groups and scaling factor) are accepted and not
    described by the result. A field that would change the parameters in a way a config does
    not describe (pruned heads, cross-attention in a decoder, quantization other than
    block-wise fp8), or any field this reader does not know, raises a ValueError rather than
    giving a wrong count: counting is strict, because it cannot check a count against weights.
    To load a checkpoint, use :func:`decoder_config`, which judges some fields differently
    (:data:`VERDICTS`).
    """
    model_type, build, spec = _reader(hf)
    unknown = _check_fields(hf, model_type, spec)
    if unknown:
        raise ValueError(f"{model_type} config has fields tutorial_lib does not know: {unknown}; it cannot "
                         "tell whether they change the architecture, so it will not guess a count")
    return _config(build(hf))


# ---- loading ------------------------------------------------------------------------------------

# The model types whose checkpoints load_pretrained and convert.from_hf_model load
# (tutorial_lib.convert.hf_tensor_map holds their tensor maps).
DECODER_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3")


def decoder_config(hf: dict) -> ModelConfig:
    """The ModelConfig of a decoder-only Hugging Face model, to load its weights into.

    Loading is not counting: the model built from this config must compute what the original
    computes. Refused (ValueError): a model type the loader has no tensor map for; whatever
    counting refuses (pruned heads, cross-attention, ...) but an unknown field; and the
    :data:`VERDICTS` entries at the values their ``loading_refuses`` picks, which counting
    accepts: scaled or interleaved RoPE, partial rotary, GPT-2's attention-scaling variants,
    quantized weights. The message gives both reasons from the table. An active sliding window
    W becomes max_len = W, where it changes nothing (every query sees at most W keys).

    A field it has never seen is a warning naming it, not a refusal: the loaders check every
    tensor's name and shape against the model before reading a weight, so it cannot change a
    parameter unnoticed, and transformers' models ignore a field their config class does not
    define. Called on its own, this function checks no tensors; the warning still comes.
    """
    model_type, build, spec = _reader(hf)
    unknown = _check_fields(hf, model_type, spec)
    cfg = _config(build(hf))
    if model_type not in DECODER_TYPES:
        if cfg.family != "decoder":
            what = f"an {cfg.family} model, not a decoder-only one"  # "encoder" or "encoder-decoder"
        elif cfg.n_experts:
            what = "a mixture of experts, whose expert weights this loader has no map for"
        else:
            what = "a decoder-only type this loader has no map for"
        raise ValueError(f"model_type {model_type!r} is {what}; load_pretrained maps the model types "
                         f"{', '.join(DECODER_TYPES)}")
    for key, verdict in VERDICTS.items():
        if key in hf and verdict.loading_refuses(hf[key]):
            raise ValueError(f"config.json has {key}={hf[key]!r}: {verdict.loading}, so tutorial_lib's model "
                             f"would give other outputs; load_pretrained refuses it. (Counting parameters, "
                             f"from_hf_config: {verdict.counting}.)")
    if unknown:
        warnings.warn(f"{model_type} config.json has fields tutorial_lib has not seen: {', '.join(unknown)}. "
                      "They are taken as metadata (every tensor's name and shape is checked against the model, "
                      "so they change no parameter); if one changes what the model computes, its outputs will "
                      "differ from the original's. Counting (from_hf_config) refuses them.", stacklevel=3)
    window = hf.get("sliding_window")
    active = bool(hf.get("use_sliding_window")) if model_type == "qwen2" else model_type in ("mistral", "phi3")
    active = active or "sliding_attention" in (hf.get("layer_types") or ())
    if window and active and window < cfg.max_len:
        cfg = replace(cfg, max_len=int(window))
    return cfg
