"""Parameter counts, memory and FLOPs (tutorial_lib.params): against the numbers transformers
reports for its own models built from published config.json files, against our own models
(key by key, over a grid of configs), against hand computations and torch's FLOP counter."""

import dataclasses
import json
import subprocess
import sys
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tutorial_lib import config as C
from tutorial_lib import params as P
from tutorial_lib.config import ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.hf_config import from_hf_config
from tutorial_lib.layers import Embeddings, TransformerBlock
from tutorial_lib.params import (
    CountedConfig,
    block_parameters,
    count_parameters,
    expected_parameters,
    flops_per_token,
    grouped,
    kv_cache_bytes,
    main,
    training_bytes,
    unique_parameter_count,
    weight_bytes,
)
from tutorial_lib.transformer import Encoder, EncoderDecoder

# ---- published config.json files, written out (nothing is downloaded) ----------------------

# "openai-community/gpt2" config.json
GPT2 = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
    "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}
# "meta-llama/Llama-2-7b-hf" config.json
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}
# "meta-llama/Llama-2-13b-hf" and "meta-llama/Llama-2-70b-hf": the shape fields that differ from 7B
LLAMA2_13B = LLAMA2_7B | {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
                          "num_hidden_layers": 40, "num_key_value_heads": 40}
LLAMA2_70B = LLAMA2_7B | {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                          "num_hidden_layers": 80, "num_key_value_heads": 8}
# "google-bert/bert-base-uncased" config.json
BERT_BASE = {
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}
# "google-t5/t5-small" config.json
T5_SMALL = {
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 2048, "d_kv": 64, "d_model": 512,
    "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1, "initializer_factor": 1.0,
    "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
    "num_heads": 8, "num_layers": 6, "output_past": True, "pad_token_id": 0, "relative_attention_num_buckets": 32,
    "task_specific_params": {
        "summarization": {"early_stopping": True, "length_penalty": 2.0, "max_length": 200, "min_length": 30,
                          "no_repeat_ngram_size": 3, "num_beams": 4, "prefix": "summarize: "},
        "translation_en_to_de": {"early_stopping": True, "max_length": 300, "num_beams": 4,
                                 "prefix": "translate English to German: "},
    },
    "vocab_size": 32128,
}
# "google/t5-v1_1-small" config.json: gated GELU, untied head, 8 + 8 layers of 6 heads
T5_V1_1_SMALL = {
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 1024, "d_kv": 64, "d_model": 512,
    "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0, "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06, "model_type": "t5",
    "num_decoder_layers": 8, "num_heads": 6, "num_layers": 8, "output_past": True, "pad_token_id": 0,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 32128,
}
# "mistralai/Mistral-7B-v0.1" config.json: grouped-query attention (8 KV heads), sliding window
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
# "Qwen/Qwen2-0.5B" config.json: biases on Q, K, V (not O), tied embeddings
QWEN2_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
# "google/gemma-7b" config.json: head_dim 256 with 16 heads (16 * 256 != 3072), GeGLU, tied
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0",
    "use_cache": True, "vocab_size": 256000,
}
# "google/gemma-2b" config.json: multi-query attention (one KV head)
GEMMA_2B = GEMMA_7B | {"hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
                       "num_hidden_layers": 18, "num_key_value_heads": 1}
# "microsoft/Phi-3-mini-4k-instruct" config.json (fused QKV and gate/up in transformers; same count)
PHI3_MINI = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False,
    "vocab_size": 32064,
}
# "meta-llama/Llama-3.2-1B" config.json: explicit head_dim, tied embeddings, llama3 RoPE scaling
LLAMA3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}

# name: (config.json, the transformers class, its parameter count). The first six are the
# counts the issue gives; the others are what transformers reports (and, for T5 v1.1, what
# Google's checkpoint list says: "t5.1.1.small (~77 million parameters)").
PUBLISHED = {
    "gpt2": (GPT2, "GPT2LMHeadModel", 124_439_808),
    "llama-2-7b": (LLAMA2_7B, "LlamaForCausalLM", 6_738_415_616),
    "llama-2-13b": (LLAMA2_13B, "LlamaForCausalLM", 13_015_864_320),
    "llama-2-70b": (LLAMA2_70B, "LlamaForCausalLM", 68_976_648_192),
    "bert-base": (BERT_BASE, "BertModel", 109_482_240),
    "t5-small": (T5_SMALL, "T5ForConditionalGeneration", 60_506_624),
    "t5-v1.1-small": (T5_V1_1_SMALL, "T5ForConditionalGeneration", 76_961_152),
    "mistral-7b": (MISTRAL_7B, "MistralForCausalLM", 7_241_732_096),
    "qwen2-0.5b": (QWEN2_0_5B, "Qwen2ForCausalLM", 494_032_768),
    "gemma-7b": (GEMMA_7B, "GemmaForCausalLM", 8_537_680_896),
    "gemma-2b": (GEMMA_2B, "GemmaForCausalLM", 2_506_172_416),
    "phi-3-mini": (PHI3_MINI, "Phi3ForCausalLM", 3_821_079_552),
    "llama-3.2-1b": (LLAMA3_2_1B, "LlamaForCausalLM", 1_235_814_400),
}


def hf_model(hf: dict, class_name: str):
    """transformers' own model for a config.json, built on the meta device (nothing allocated).
    An fp8 quantization_config (DeepSeek-V3) is left out: it says how the checkpoint stores the
    weights, and building the model does not use it."""
    transformers = pytest.importorskip("transformers")
    kwargs = {key: value for key, value in hf.items() if key not in ("model_type", "quantization_config")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    with torch.device("meta"):
        return getattr(transformers, class_name)(config)


@pytest.mark.parametrize("name", PUBLISHED)
def test_count_from_config_equals_transformers_own_model(name):
    hf, class_name, published = PUBLISHED[name]
    ours = expected_parameters(from_hf_config(hf))["total"]
    assert ours == published
    model = hf_model(hf, class_name)
    theirs = sum(p.numel() for p in model.parameters())  # shared tensors once
    if name == "t5-v1.1-small" and model.config.tie_word_embeddings:
        # transformers 5 ties T5's head to the embeddings whatever config.json says (T5Config
        # forces tie_word_embeddings=True); the released v1.1 checkpoints have a separate head.
        assert theirs == ours - hf["vocab_size"] * hf["d_model"]
    else:
        assert theirs == ours


def test_the_blocks_of_each_stack_match_transformers_module_by_module():
    hf = hf_model(LLAMA2_70B, "LlamaForCausalLM")
    ours = expected_parameters(from_hf_config(LLAMA2_70B))
    layers = hf.model.layers
    assert sum(p.numel() for p in layers.parameters()) == sum(
        n for key, n in ours.items() if key.startswith("decoder.") and key != "decoder.final_norm")
    attn = layers[0].self_attn
    assert attn.k_proj.weight.numel() * 80 == ours["decoder.attn.k"] == 80 * 8192 * 1024
    assert hf.lm_head.weight.numel() == ours["head"]
    t5 = hf_model(T5_SMALL, "T5ForConditionalGeneration")
    t5_ours = expected_parameters(from_hf_config(T5_SMALL))
    bias = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
    assert bias.weight.numel() == t5_ours["encoder.position_bias"] == t5_ours["decoder.position_bias"] == 32 * 8


def test_presets_are_what_the_published_configs_say():
    assert from_hf_config(GPT2) == C.GPT2_SMALL
    assert from_hf_config(LLAMA2_7B) == C.LLAMA2_7B
    assert from_hf_config(LLAMA2_13B) == C.LLAMA2_13B
    assert from_hf_config(LLAMA2_70B) == C.LLAMA2_70B
    assert from_hf_config(MISTRAL_7B) == C.MISTRAL_7B
    assert from_hf_config(BERT_BASE) == P.BERT_BASE
    assert from_hf_config(T5_SMALL) == C.T5_SMALL


def test_what_each_family_member_is_read_as():
    qwen = from_hf_config(QWEN2_0_5B)
    assert (qwen.uses_bias("qkv"), qwen.uses_bias("out"), qwen.uses_bias("ffn")) == (True, False, False)
    assert qwen.tie_embeddings and qwen.kv_heads == 2 and qwen.rope_base == 1e6
    gemma = from_hf_config(GEMMA_7B)
    assert gemma.head_dim == 256 and gemma.n_heads * gemma.head_dim == 4096 != gemma.d_model
    assert gemma.ffn == "geglu_tanh" and gemma.scale_embeddings and gemma.tie_embeddings
    llama3 = from_hf_config(LLAMA3_2_1B)
    assert llama3.head_dim == 64 and llama3.to_dict()["head_dim"] is None and llama3.rope_base == 500000.0
    t5 = from_hf_config(T5_V1_1_SMALL)
    assert t5.ffn == "geglu_tanh" and not t5.tie_embeddings and t5.share_embeddings and t5.decoder_layers == 8


@pytest.mark.parametrize("name", ["gpt2", "bert-base", "t5-small", "llama-3.2-1b", "mistral-7b", "qwen2-0.5b",
                                  "gemma-2b", "phi-3-mini"])
def test_transformers_own_serialisation_reads_the_same(name):
    """What this transformers version writes (config.to_dict()) reads as the published file does."""
    hf, class_name, _ = PUBLISHED[name]
    written = hf_model(hf, class_name).config.to_dict()
    assert expected_parameters(from_hf_config(written)) == expected_parameters(from_hf_config(hf))


def test_fields_that_change_no_parameter_are_accepted():
    base = expected_parameters(from_hf_config(LLAMA2_7B))
    for changes in ({"rope_scaling": {"type": "linear", "factor": 2.0}}, {"pretraining_tp": 2},
                    {"attention_dropout": 0.1}):
        assert expected_parameters(from_hf_config(LLAMA2_7B | changes)) == base
    assert expected_parameters(from_hf_config(MISTRAL_7B | {"sliding_window": None})) == \
        expected_parameters(from_hf_config(MISTRAL_7B))


@pytest.mark.parametrize("hf,match", [
    ("not a dict", "expected a config.json dict"),
    ({"model_type": "falcon"}, r"model_type 'falcon' is not supported; supported: \['bert'"),
    ({"model_type": "mixtral"}, "a 'mixtral' config.json needs the field"),  # read since issue 17
    ({"model_type": "qwen3"}, "q_norm, k_norm"),
    (LLAMA2_7B | {"num_local_experts": 8}, "mixture-of-experts fields"),
    (LLAMA2_7B | {"new_field": 1}, r"does not know: \['new_field'\]"),
    (LLAMA2_7B | {"pruned_heads": {"0": [1]}}, "pruned attention heads"),
    (LLAMA2_7B | {"hidden_act": "gelu"}, "unsupported llama hidden_act 'gelu'"),
    (LLAMA2_7B | {"quantization_config": {"bits": 4}}, "quantized"),
    (GPT2 | {"add_cross_attention": True}, "cross-attention layers add parameters"),
    (BERT_BASE | {"position_embedding_type": "relative_key"}, "relative-position variants"),
    (BERT_BASE | {"is_decoder": True}, "causal BERT"),
    (T5_SMALL | {"feed_forward_proj": "gated-relu"}, "unsupported T5 feed_forward_proj"),
    (PHI3_MINI | {"attention_bias": True}, "no attention biases"),
    ({k: v for k, v in LLAMA2_7B.items() if k != "hidden_size"}, "needs the field 'hidden_size'"),
])
def test_configs_that_cannot_be_counted_exactly_are_refused(hf, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)


# ---- our own models: expected == measured, key by key ----------------------------------------

@st.composite
def model_configs(draw, family="decoder"):
    n_heads = draw(st.sampled_from([1, 2, 4]))
    d_k = draw(st.sampled_from([2, 4, 6]))
    explicit_head_dim = draw(st.booleans())
    d_model = draw(st.sampled_from([4, 10, 16])) if explicit_head_dim else n_heads * d_k
    fields = dict(
        family=family, vocab_size=draw(st.integers(3, 40)), d_model=d_model, n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads, n_kv_heads=draw(st.sampled_from([None] + [k for k in (1, 2, 4) if n_heads % k == 0])),
        head_dim=d_k if explicit_head_dim else None, d_ff=draw(st.sampled_from([None, 6, 24])),
        max_len=draw(st.integers(4, 32)), norm=draw(st.sampled_from(C.NORMS)),
        norm_order=draw(st.sampled_from(C.NORM_ORDERS)), final_norm=draw(st.sampled_from([None, True, False])),
        ffn=draw(st.sampled_from(C.FFNS)), positions=draw(st.sampled_from(["learned", "sinusoidal", "rope", "alibi",
                                                                           "relative", "none"])),
        bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
        **{f"{part}_bias": draw(st.sampled_from([None, True, False])) for part in C.BIAS_PARTS},
    )
    if family == "encoder-decoder":
        share = draw(st.booleans())
        fields |= dict(share_embeddings=share, n_decoder_layers=draw(st.sampled_from([None, 1, 2])),
                       src_vocab_size=None if share else draw(st.sampled_from([None, 7, 50])))
    return ModelConfig(**fields)


@settings(max_examples=60, deadline=None)
@given(model_configs())
def test_expected_equals_measured_for_decoder_only_models(cfg):
    with torch.device("meta"):
        model = DecoderOnlyLM(cfg)
    measured = count_parameters(model)
    assert measured == expected_parameters(cfg)
    assert measured["total"] == unique_parameter_count(model)


@settings(max_examples=40, deadline=None)
@given(model_configs("encoder-decoder"))
def test_expected_equals_measured_for_encoder_decoder_models(cfg):
    with torch.device("meta"):
        model = EncoderDecoder(cfg)
    measured = count_parameters(model)
    assert measured == expected_parameters(cfg)
    assert measured["total"] == unique_parameter_count(model)


@settings(max_examples=30, deadline=None)
@given(model_configs("encoder"))
def test_expected_equals_measured_for_encoder_backbones(cfg):
    from tutorial_lib.encoder_only import EncoderBackbone

    with torch.device("meta"):
        model = EncoderBackbone(cfg)
    measured = count_parameters(model)
    assert measured == expected_parameters(cfg)
    assert measured["total"] == unique_parameter_count(model)


def test_the_transformer_of_vaswani_et_al_builds_and_counts_with_one_shared_table():
    with torch.device("meta"):
        model = EncoderDecoder(C.TRANSFORMER_BASE)
    counts = count_parameters(model)
    assert counts == expected_parameters(C.TRANSFORMER_BASE)
    assert counts["embed.source_tokens"] == counts["head"] == 0 and counts["embed.tokens"] == 37000 * 512
    assert counts["total"] == 63_082_496
    assert expected_parameters(C.TRANSFORMER_BIG)["total"] == 214_245_376


def test_a_frontend_is_counted_under_its_own_key_and_unknown_parameters_are_refused():
    cfg = dataclasses.replace(C.TRANSFORMER_BASE, vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                              share_embeddings=False)
    with torch.device("meta"):
        model = EncoderDecoder(cfg, frontend=nn.Linear(5, 16))
    counts = count_parameters(model)
    assert counts["frontend"] == 5 * 16 + 16 and counts["embed.source_tokens"] == 0
    assert counts["total"] == unique_parameter_count(model)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'extra.weight' of shape"):
        count_parameters(model)
    with pytest.raises(ValueError, match="expected a tutorial_lib model"):
        count_parameters(nn.Linear(2, 2))


def test_one_block_by_hand_the_12576_case():
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=128, qkv_bias=False, out_bias=False, ffn_bias=True,
                      norm="layernorm", norm_bias=True)
    block = block_parameters(cfg)
    assert block == {"attn.q": 1024, "attn.k": 1024, "attn.v": 1024, "attn.o": 1024, "ffn.up": 32 * 128 + 128,
                     "ffn.gate": 0, "ffn.down": 128 * 32 + 32, "norms": 2 * 64, "total": 12_576}
    assert sum(p.numel() for p in TransformerBlock(cfg).parameters()) == 12_576
    # the same block from torch.nn parts
    torch_parts = [nn.MultiheadAttention(32, 4, bias=False), nn.Linear(32, 128), nn.Linear(128, 32),
                   nn.LayerNorm(32), nn.LayerNorm(32)]
    assert sum(p.numel() for part in torch_parts for p in part.parameters()) == 12_576


def test_tying_saves_exactly_the_head_and_grouped_query_attention_shrinks_k_and_v():
    tied = expected_parameters(C.GPT2_SMALL)
    untied = expected_parameters(dataclasses.replace(C.GPT2_SMALL, tie_embeddings=False))
    assert untied["total"] - tied["total"] == untied["head"] == 50257 * 768 and tied["head"] == 0
    mha = expected_parameters(dataclasses.replace(C.LLAMA2_70B, n_kv_heads=64))
    gqa = expected_parameters(C.LLAMA2_70B)
    assert mha["decoder.attn.k"] == 8 * gqa["decoder.attn.k"] and mha["decoder.attn.q"] == gqa["decoder.attn.q"]
    assert sum(grouped(gqa).values()) == gqa["total"]


def test_expected_parameters_allocates_almost_nothing_for_a_70b_config():
    tracemalloc.start()
    counts = expected_parameters(C.LLAMA2_70B)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert counts["total"] == 68_976_648_192 and peak < 64 * 1024, f"peak {peak} bytes"


def test_models_refuse_parts_they_do_not_build():
    with pytest.raises(ValueError, match="token-type table"):
        Embeddings(P.BERT_BASE)
    with pytest.raises(ValueError, match="BERT's dense"):
        Encoder(CountedConfig(family="encoder", pooler=True))
    with pytest.raises(ValueError, match="family='encoder'"):
        CountedConfig(pooler=True)
    with pytest.raises(ValueError, match=r"type_vocab_size must be a non-negative int \(an int >= 0\), got -1"):
        CountedConfig(family="encoder", type_vocab_size=-1)
    with pytest.raises(TypeError, match="pooler"):
        ModelConfig(family="encoder", pooler=True)  # the config a model is built from has no such field
    encoder = CountedConfig(family="encoder", d_model=16, n_heads=2, vocab_size=11, max_len=8)
    assert Encoder(encoder).cfg == encoder, "a CountedConfig that asks for no unbuilt part builds"


# ---- memory ---------------------------------------------------------------------------------

def test_weight_and_training_bytes_by_hand():
    n = 6_738_415_616
    assert weight_bytes(C.LLAMA2_7B, "fp32") == 4 * n
    assert weight_bytes(C.LLAMA2_7B, "bf16") == weight_bytes(n, torch.bfloat16) == 2 * n
    assert weight_bytes(n, "int8") == n
    assert training_bytes(n, "fp32") == {"weights": 4 * n, "gradients": 4 * n, "master_weights": 0,
                                         "optimizer_states": 8 * n, "total": 16 * n}
    assert training_bytes(C.LLAMA2_7B)["total"] == 16 * n  # mixed precision: 2 + 2 + 4 + 8
    with pytest.raises(ValueError, match="dtype must be"):
        weight_bytes(n, "int3")
    with pytest.raises(ValueError, match="precision must be"):
        training_bytes(n, "fp8")


def test_kv_cache_bytes_by_hand():
    # keys and values x 32 layers x 4096 positions x 32 heads x 128 values x 2 bytes = 2 GiB
    assert kv_cache_bytes(C.LLAMA2_7B, 1, 4096, "bf16") == 2 * 32 * 4096 * 32 * 128 * 2 == 2**31
    # 70B: 80 layers but only 8 KV heads
    assert kv_cache_bytes(C.LLAMA2_70B, 1, 4096, "bf16") == 2 * 80 * 4096 * 8 * 128 * 2
    # 8 sequences of 1024 positions in fp32 hold 4x one sequence of 4096 in bf16
    assert kv_cache_bytes(C.LLAMA2_70B, 8, 1024, "fp32") == 4 * kv_cache_bytes(C.LLAMA2_70B, 1, 4096, "bf16")
    t5 = kv_cache_bytes(C.T5_SMALL, 2, 10, "fp32", source_len=30)
    assert t5 == 6 * 2 * (10 + 30) * 2 * 8 * 64 * 4
    for args, match in (((P.BERT_BASE, 1, 8), "keeps no KV cache"), ((C.LLAMA2_7B, 1, 4097), "longer than"),
                        ((C.T5_SMALL, 1, 8), "give source_len"), ((C.LLAMA2_7B, 0, 8), "batch must be")):
        with pytest.raises(ValueError, match=match):
            kv_cache_bytes(*args)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa"])
def test_kv_cache_bytes_equal_what_a_real_cache_holds(name):
    cfg = {"gpt": dataclasses.replace(C.GPT_TINY, vocab_size=30, d_model=32, max_len=16),
           "llama-gqa": dataclasses.replace(C.LLAMA_TINY, vocab_size=30, d_model=32, n_kv_heads=1, d_ff=48,
                                            max_len=16)}[name]
    model = DecoderOnlyLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 30, (3, 11)), cache=cache)
    assert cache.nbytes() == kv_cache_bytes(cfg, 3, 11, torch.float32)


def test_kv_cache_bytes_equal_a_real_encoder_decoder_cache():
    cfg = dataclasses.replace(C.TRANSFORMER_BASE, vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                              n_decoder_layers=3)
    model = EncoderDecoder(cfg).eval()
    with torch.no_grad():
        memory = model.encode(torch.randint(0, 20, (2, 9))).x
        cache = model.new_cache()
        model.decode(torch.randint(0, 20, (2, 4)), memory, cache=cache)
    assert cache.self_attn.nbytes() + cache.cross.nbytes() == kv_cache_bytes(cfg, 2, 4, "fp32", source_len=9)


# ---- FLOPs ----------------------------------------------------------------------------------

def test_flops_per_token_by_hand_for_gpt2_small():
    flops = flops_per_token(C.GPT2_SMALL, context=1024)
    matrices = 12 * 12 * 768**2 + 50257 * 768  # 4d^2 + 8d^2 per layer, and the (tied) head
    assert flops["matmul"] == 2 * matrices
    assert flops["attention"] == 12 * 2 * 2 * 1024 * 768
    assert flops["forward"] == 2 * matrices + 4 * 12 * 1024 * 768 and flops["training"] == 3 * flops["forward"]
    with pytest.raises(ValueError, match="encoder-decoder"):
        flops_per_token(C.T5_SMALL)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "moe"])
def test_flops_per_token_equal_torch_flop_counter(name):
    """torch's FlopCounterMode counts 2*m*n*k for every matrix product; on the written-out
    attention path (need_weights=True) that is every product in the model. Dropless routing runs
    each token through exactly k experts (plus the shared one), so for a mixture of experts the
    FLOPs are those of the active parameters: the count is exact, not an average."""
    cfg = {"gpt": dataclasses.replace(C.GPT_TINY, vocab_size=50, d_model=32, max_len=16),
           "llama-gqa": dataclasses.replace(C.LLAMA_TINY, vocab_size=50, d_model=32, n_kv_heads=2, d_ff=48,
                                            max_len=16),
           "moe": dataclasses.replace(C.LLAMA_TINY, vocab_size=50, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1,
                                      d_ff=24, max_len=32, n_experts=5, experts_per_token=2, n_shared_experts=1,
                                      shared_expert_gate=True, dense_layers=(0,))}[name]
    model = DecoderOnlyLM(cfg)
    B, T = 2, 16
    ids = torch.randint(0, 50, (B, T))
    expected = flops_per_token(cfg, context=T)
    with FlopCounterMode(display=False) as counter:
        model(ids, need_weights=True)
    assert counter.get_total_flops() == B * T * expected["forward"]
    with FlopCounterMode(display=False) as counter:
        model(ids, ids, need_weights=True).loss.backward()
    assert counter.get_total_flops() == B * T * expected["training"]


# ---- the command line ---------------------------------------------------------------------------

def test_command_line_prints_the_breakdown_and_memory(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_70B))
    assert main([str(path), "--batch", "2", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "68,976,648,192" in out and "decoder.attn.k" in out and "671,088,640" in out
    assert "bf16 128.48 GiB" in out  # 2 * 68,976,648,192 bytes
    assert "KV cache (bf16, batch 2, 1024 positions): 640.00 MiB" in out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert "neither a config.json file nor a preset" in capsys.readouterr().err


def test_command_line_runs_as_a_module(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    done = subprocess.run([sys.executable, "-m", "tutorial_lib.params", str(path)], capture_output=True, text=True,
                          check=True)
    assert "124,439,808" in done.stdout and "embed.positions" in done.stdout


# ---- plots and the calculator ---------------------------------------------------------------------

def test_breakdown_plot_draws_each_group_share_and_the_totals():
    from tutorial_lib.params import GROUPS
    from tutorial_lib.plotting import plot_parameter_breakdown

    breakdowns = {"GPT-2 small": expected_parameters(C.GPT2_SMALL), "Llama-2-7B": expected_parameters(C.LLAMA2_7B)}
    ax = plot_parameter_breakdown(breakdowns)
    widths = [patch.get_width() for patch in ax.patches]  # group by group, one bar per model
    for g, group in enumerate(GROUPS):
        for m, counts in enumerate(breakdowns.values()):
            assert widths[2 * g + m] == pytest.approx(100 * grouped(counts)[group] / counts["total"])
    assert widths[0] == pytest.approx(100 * (50257 + 1024) * 768 / 124_439_808)  # GPT-2's embeddings
    assert {t.get_text() for t in ax.texts} == {"124.4 M", "6.74 B"}
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    with pytest.raises(ValueError, match="no breakdowns"):
        plot_parameter_breakdown({})


def test_breakdown_plot_writes_small_totals_in_thousands_or_in_full():
    from tutorial_lib.plotting import plot_parameter_breakdown

    tiny = dataclasses.replace(C.GPT_TINY, vocab_size=100, d_model=32, n_layers=3, n_heads=4, max_len=64)
    one_block = ModelConfig(family="decoder", vocab_size=4, d_model=4, n_layers=1, n_heads=1, d_ff=4, max_len=4)
    breakdowns = {"tiny": expected_parameters(tiny), "one block": expected_parameters(one_block)}
    assert breakdowns["tiny"]["total"] == 43_424 and breakdowns["one block"]["total"] < 1000
    ax = plot_parameter_breakdown(breakdowns)
    assert [t.get_text() for t in ax.texts] == ["43.4 k", f"{breakdowns['one block']['total']}"]


def test_growth_plot_stacks_up_to_the_total():
    from tutorial_lib.plotting import plot_parameter_growth

    depths = [1, 2, 4, 8]
    counts = [expected_parameters(dataclasses.replace(C.GPT2_SMALL, n_layers=n)) for n in depths]
    ax = plot_parameter_growth(depths, counts, xlabel="n_layers")
    top = ax.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(counts[-1]["total"] / 1e6)
    assert ax.get_xlabel() == "n_layers" and ax.get_ylabel() and ax.get_title()
    with pytest.raises(ValueError, match="one breakdown per x value"):
        plot_parameter_growth([1, 2], counts, xlabel="n_layers")


def test_calculator_figure_shows_the_computed_memory_and_flops():
    from tutorial_lib.params import GiB
    from tutorial_lib.widgets import render_memory_calculator

    fig = render_memory_calculator(C.LLAMA2_70B, name="Llama-2-70B", batch=4, seq_len=2048, dtype="bf16",
                                   device_gib=80)
    ax_mem, ax_flops = fig.axes
    widths = [patch.get_width() for patch in ax_mem.patches]
    n = 68_976_648_192
    kv = kv_cache_bytes(C.LLAMA2_70B, 4, 2048, "bf16")
    assert widths == pytest.approx([2 * n / GiB, kv / GiB, (2 * n + kv) / GiB, 16 * n / GiB])
    flops = flops_per_token(C.LLAMA2_70B, 2048)
    heights = [patch.get_height() for patch in ax_flops.patches]  # matmul x 2 passes, then attention x 2
    assert heights == pytest.approx([flops["matmul"] / 1e9, 3 * flops["matmul"] / 1e9,
                                     flops["attention"] / 1e9, 3 * flops["attention"] / 1e9])
    assert "68,976,648,192 parameters" in fig._suptitle.get_text()
    assert all(ax.get_xlabel() and ax.get_ylabel() and ax.get_title() for ax in fig.axes)
    bert = render_memory_calculator(P.BERT_BASE, name="BERT")
    assert any("keeps no cache" in t.get_text() for t in bert.axes[0].texts)
    t5 = render_memory_calculator(C.T5_SMALL, name="T5", seq_len=64)
    assert any("not defined" in t.get_text() for t in t5.axes[1].texts)


def test_calculator_widget_rerenders_and_falls_back_to_a_static_figure():
    pytest.importorskip("ipywidgets")
    from matplotlib.figure import Figure

    from tutorial_lib.widgets import MemoryCalculator, memory_calculator

    configs = {"Llama-2-7B": C.LLAMA2_7B, "GPT-2 small": C.GPT2_SMALL}
    calc = MemoryCalculator(configs, device_gib=80)
    assert calc.seq_len.value == 4096
    before = calc.image.value
    calc.config.value = "GPT-2 small"  # a shorter context: the slider is clamped to it
    assert calc.seq_len.max == calc.seq_len.value == 1024 and calc.image.value != before
    before = calc.image.value
    calc.dtype.value = "fp32"
    assert calc.image.value != before
    assert isinstance(memory_calculator(configs, static=True), Figure)
    assert isinstance(memory_calculator(configs, static=False), MemoryCalculator)
    with pytest.raises(ValueError, match="no configs"):
        memory_calculator({}, static=True)
