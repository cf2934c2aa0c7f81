"""Counting mixtures of experts and latent attention (tutorial_lib.params): totals against the
count transformers reports for its own models built on the meta device from published
config.json files, active counts against derivations written out here, the published headline
figures, the KV cache of multi-head latent attention, the command line and the calculator."""

import json
import math

import pytest
from test_params import hf_model

from tutorial_lib import config as C
from tutorial_lib import params as P
from tutorial_lib.hf_config import from_hf_config
from tutorial_lib.params import (
    GiB,
    active_parameters,
    expected_parameters,
    flops_per_token,
    format_bytes,
    kv_cache_bytes,
    main,
    mtp_parameters,
)

# ---- published config.json files, written out (nothing is downloaded) ----------------------

# "mistralai/Mixtral-8x7B-v0.1" config.json
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}
# "Qwen/Qwen1.5-MoE-A2.7B" config.json: 60 experts, 4 per token, one gated shared expert
QWEN1_5_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# "Qwen/Qwen3-30B-A3B" config.json: 128 experts, 8 per token, norms on queries and keys
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# "Qwen/Qwen3-235B-A22B": the shape fields that differ from 30B-A3B
QWEN3_235B_A22B = QWEN3_30B_A3B | {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                                   "num_attention_heads": 64, "num_hidden_layers": 94, "max_window_layers": 94}
# "deepseek-ai/DeepSeek-V2" config.json (DeepSeek-V2.5 has the same): latent attention,
# one dense layer, 160 routed experts (6 per token) and 2 shared ones
DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1536,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 160, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 128, "num_experts_per_tok": 6, "num_hidden_layers": 60, "num_key_value_heads": 128,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 3, "topk_method": "group_limited_greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.39.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
# "deepseek-ai/DeepSeek-V2-Lite": the fields that differ from V2 (its query is not compressed)
DEEPSEEK_V2_LITE = DEEPSEEK_V2 | {
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 64, "num_attention_heads": 16, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "routed_scaling_factor": 1.0, "topk_group": 1, "topk_method": "greedy",
}
# "deepseek-ai/DeepSeek-V3" config.json (DeepSeek-R1 has the same): 3 dense layers, then 256
# routed experts (8 per token) and 1 shared; one multi-token-prediction module; fp8 weights
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# name: (config.json, the transformers class, total and active as counted here)
PUBLISHED = {
    "mixtral-8x7b": (MIXTRAL_8X7B, "MixtralForCausalLM", 46_702_792_704, 12_879_925_248),
    "qwen1.5-moe-a2.7b": (QWEN1_5_MOE, "Qwen2MoeForCausalLM", 14_315_784_192, 2_689_173_504),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "Qwen3MoeForCausalLM", 30_532_122_624, 3_353_032_704),
    "qwen3-235b-a22b": (QWEN3_235B_A22B, "Qwen3MoeForCausalLM", 235_093_634_560, 22_190_763_520),
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE, "DeepseekV2ForCausalLM", 15_706_484_224, 2_661_150_208),
    "deepseek-v2": (DEEPSEEK_V2, "DeepseekV2ForCausalLM", 235_741_434_880, 21_375_800_320),
    "deepseek-v3": (DEEPSEEK_V3, "DeepseekV3ForCausalLM", 671_026_404_352, 37_552_282_624),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_total_equals_transformers_own_model_and_active_is_what_we_derived(name):
    hf, class_name, total, active = PUBLISHED[name]
    counts = expected_parameters(from_hf_config(hf))
    assert (counts["total"], counts["active"]) == (total, active)
    model = hf_model(hf, class_name)
    assert sum(p.numel() for p in model.parameters()) == total, "transformers counts the same total"
    written = model.config.to_dict()  # what this transformers version writes reads the same
    assert expected_parameters(from_hf_config(written)) == counts


# ---- active parameters, derived by hand ---------------------------------------------------------
# One token's path: the embedding and head, every layer's attention and two norms, the final
# norm, and in each MoE layer the router, the k chosen experts and the shared experts.


def test_mixtral_active_by_hand():
    d, L, V, f = 4096, 32, 32000, 14336
    attention = d * d + 2 * d * (8 * 128) + d * d  # W_Q, W_K and W_V of 8 KV heads, W_O
    expert = 3 * d * f  # SwiGLU: gate, up, down
    common = 2 * V * d + L * (attention + d * 8 + 2 * d) + d  # embeddings, head, router, norms, final norm
    assert expected_parameters(from_hf_config(MIXTRAL_8X7B))["total"] == common + L * 8 * expert
    assert expected_parameters(from_hf_config(MIXTRAL_8X7B))["active"] == common + L * 2 * expert
    # "8x7B" is a name, not 8 x 7B = 56B: each expert slot holds 5.64B over the 32 layers, the
    # 8 of them 45.1B, and everything the experts do not hold 1.61B
    assert L * expert == 5_637_144_576 and common == 1_605_636_096


def test_qwen1_5_moe_active_by_hand():
    d, L, V = 2048, 24, 151936
    attention = 4 * d * d + 3 * d  # Q, K, V with biases, O without
    shared = 3 * d * 5632 + d  # the shared expert and its gate (d x 1)
    routed = 4 * 3 * d * 1408  # 4 of 60 experts
    active = 2 * V * d + L * (attention + d * 60 + shared + routed + 2 * d) + d
    assert expected_parameters(from_hf_config(QWEN1_5_MOE))["active"] == active
    assert 4 * 1408 == 5632, "the 4 routed experts a token uses are as wide as the shared one"


def test_qwen3_moe_active_by_hand():
    d, L, V = 2048, 48, 151936
    attention = d * 32 * 128 + 2 * d * 4 * 128 + 32 * 128 * d + 2 * 128  # + the q and k norms (d_k each)
    active = 2 * V * d + L * (attention + d * 128 + 8 * 3 * d * 768 + 2 * d) + d
    counts = expected_parameters(from_hf_config(QWEN3_30B_A3B))
    assert counts["active"] == active and counts["decoder.attn.qk_norm"] == L * 256


def test_deepseek_v3_active_by_hand():
    d, L, V, h = 7168, 61, 129280, 128
    latent_attention = (d * 1536 + 1536 + 1536 * h * (128 + 64)  # query: down, norm, up to 128 + 64 per head
                        + d * (512 + 64) + 512 + 512 * h * (128 + 128)  # key/value latent + rotary key, norm, up
                        + h * 128 * d)  # W_O from 128 value heads of 128
    dense = 3 * d * 18432  # layers 0-2
    moe = d * 256 + (8 + 1) * 3 * d * 2048  # router, 8 routed and 1 shared expert: layers 3-60
    active = 2 * V * d + L * (latent_attention + 2 * d) + 3 * dense + 58 * moe + d
    assert expected_parameters(from_hf_config(DEEPSEEK_V3))["active"] == active
    assert dense == (8 + 1) * 3 * d * 2048, "a dense layer's FFN is exactly as wide as the 9 experts a token uses"


def test_active_is_what_the_flops_per_token_count():
    """flops_per_token counts matrices as a token meets them; for these configs (no biases, an
    untied head) that is 2 FLOPs for every active parameter but the embedding table and norms."""
    for hf in (MIXTRAL_8X7B, QWEN3_30B_A3B, DEEPSEEK_V3):
        cfg = from_hf_config(hf)
        counts = expected_parameters(cfg)
        norms = sum(n for key, n in counts.items() if key.endswith(("norm", "norms")))
        assert flops_per_token(cfg, 4096)["matmul"] == 2 * (counts["active"] - counts["embed.tokens"] - norms)
        assert active_parameters(cfg) == counts["active"]
    assert active_parameters(C.LLAMA2_7B) == expected_parameters(C.LLAMA2_7B)["total"], "dense: active = total"


# ---- the headline figures ------------------------------------------------------------------------

# name: (published total, published active, in billions, and the decimals they are given with;
# a figure is reproduced when ours, rounded or cut to those decimals, gives it: Qwen3-30B-A3B's
# 3.353B active is published as 3.3B).
# Mixtral: Mistral AI, "Mixtral of experts" (2023): "46.7B total parameters but only uses 12.9B
# parameters per token". Qwen: the model cards ("14.3B parameters in total and 2.7B activated";
# "30.5B in total and 3.3B activated"; "235B in total and 22B activated"). DeepSeek-V2 paper:
# "236B total parameters, of which 21B are activated"; V2-Lite "15.7B ... 2.4B"; DeepSeek-V3
# report: "671B total parameters with 37B activated for each token".
HEADLINES = {
    "mixtral-8x7b": (46.7, 12.9, 1), "qwen1.5-moe-a2.7b": (14.3, 2.7, 1), "qwen3-30b-a3b": (30.5, 3.3, 1),
    "qwen3-235b-a22b": (235, 22, 0), "deepseek-v2": (236, 21, 0), "deepseek-v2-lite": (15.7, 2.4, 1),
    "deepseek-v3": (671, 37, 0),
}


@pytest.mark.parametrize("name", HEADLINES)
def test_published_totals_and_active_counts_are_reproduced_or_the_gap_is_stated(name):
    total, active, digits = HEADLINES[name]
    _, _, ours_total, ours_active = PUBLISHED[name]

    def gives(n, published):
        billions = n / 1e9
        return published in (round(billions, digits), math.floor(billions * 10**digits) / 10**digits)

    assert gives(ours_total, total), "every published total is reproduced"
    if name in ("deepseek-v3", "deepseek-v2-lite"):
        # DeepSeek's active figures are below what one token's path holds. V3's README_WEIGHTS.md
        # gives 36.7B "including 0.9B for Embedding and 0.9B for the output Head": 0.85B less
        # than ours; V2-Lite 0.26B less (an open question, deepseek-ai/DeepSeek-V2 issue 73).
        # Leaving out the input embedding table (a token reads one row of it) comes within 0.1B
        # of both, but the README says the embedding is included: the config cannot settle it.
        published = {"deepseek-v3": 36.7e9, "deepseek-v2-lite": 2.4e9}[name]
        gap = ours_active - published
        embedding = from_hf_config(PUBLISHED[name][0]).vocab_size * from_hf_config(PUBLISHED[name][0]).d_model
        assert 0.2e9 < gap < 0.9e9 and abs(ours_active - embedding - published) < 0.1e9
    else:
        assert gives(ours_active, active)


def test_deepseek_v3_multi_token_prediction_module_makes_the_larger_checkpoint():
    """The checkpoint is "685B, which includes 671B of the Main Model weights and 14B of the
    Multi-Token Prediction (MTP) Module weights" (DeepSeek-V3 README). README_WEIGHTS.md: the
    module has "11.5B unique parameters, excluding the shared 0.9B Embedding and 0.9B output
    Head": one more MoE layer (11.51B), plus eh_proj (2d x d, 0.10B) and three norms."""
    cfg = from_hf_config(DEEPSEEK_V3)
    d, V = 7168, 129280
    mtp = mtp_parameters(cfg)
    latent_attention = d * 1536 + 1536 + 1536 * 128 * 192 + d * 576 + 512 + 512 * 128 * 256 + 128 * 128 * d
    layer = latent_attention + d * 256 + (256 + 1) * 3 * d * 2048 + 2 * d
    assert mtp == {"layer": layer, "projection": 2 * d * d, "norms": 3 * d, "total": layer + 2 * d * d + 3 * d}
    assert round(mtp["layer"] / 1e9, 1) == 11.5, "README_WEIGHTS' 11.5B is the module's layer"
    with_shared = mtp["total"] + 2 * V * d  # the module with the embedding and head it uses
    assert round(with_shared / 1e9, 1) == 13.5  # the README rounds it to "14B"
    checkpoint = expected_parameters(cfg)["total"] + with_shared
    assert round(checkpoint / 1e9, 1) == 684.5, "671.0B + 13.5B: the published 685B"
    with pytest.raises(ValueError, match="no multi-token-prediction modules"):
        mtp_parameters(from_hf_config(MIXTRAL_8X7B))


# ---- the KV cache of latent attention --------------------------------------------------------------

def test_latent_attention_caches_the_latent_and_one_rotary_key():
    v3 = from_hf_config(DEEPSEEK_V3)
    per_token_layer = 512 + 64  # d_c + d_h^R values (DeepSeek-V2 paper, Table 1)
    assert per_token_layer == 4.5 * 128, "the paper's (9/2) d_h with d_h = 128"
    assert kv_cache_bytes(v3, 1, 4096, "bf16") == 61 * 4096 * per_token_layer * 2
    mha = 2 * 128 * 128  # keys and values of 128 heads of 128, per token and layer
    assert mha / per_token_layer == pytest.approx(56.89, abs=0.01)
    gqa = 2 * 8 * 128  # Llama-2-70B, Mixtral: 8 key/value heads of 128
    assert per_token_layer == 2 * 2.25 * 128, "the paper: like grouped-query attention with 2.25 groups"
    assert kv_cache_bytes(C.LLAMA2_70B, 1, 4096) / kv_cache_bytes(v3, 1, 4096) == pytest.approx(
        80 * gqa / (61 * per_token_layer))
    assert kv_cache_bytes(from_hf_config(MIXTRAL_8X7B), 1, 4096, "bf16") == 32 * 4096 * gqa * 2


# ---- reading --------------------------------------------------------------------------------------

def test_presets_are_what_the_published_configs_say():
    assert from_hf_config(MIXTRAL_8X7B) == C.MIXTRAL_8X7B
    assert from_hf_config(QWEN3_30B_A3B) == P.QWEN3_30B_A3B
    assert from_hf_config(DEEPSEEK_V3) == P.DEEPSEEK_V3
    assert type(from_hf_config(MIXTRAL_8X7B)) is C.ModelConfig, "a model with no counted-only part: a ModelConfig"
    assert type(P.QWEN3_30B_A3B) is type(P.DEEPSEEK_V3) is P.CountedConfig, "query/key norms, latent attention"


def test_what_each_family_is_read_as():
    m = from_hf_config(MIXTRAL_8X7B)
    assert (m.n_experts, m.experts_per_token, m.expert_dim, m.renormalise_topk) == (8, 2, 14336, True)
    qwen = from_hf_config(QWEN1_5_MOE)
    assert (qwen.n_shared_experts, qwen.shared_dim, qwen.shared_expert_gate, qwen.renormalise_topk) == (1, 5632, True,
                                                                                                       False)
    assert qwen.uses_bias("qkv") and not qwen.uses_bias("out") and qwen.moe_layers == tuple(range(24))
    v2 = from_hf_config(DEEPSEEK_V2)
    assert v2.dense_layers == (0,) and v2.n_shared_experts == 2 and v2.shared_dim == 1536 and not v2.renormalise_topk
    assert v2.latent_attention and (v2.head_dim, v2.rope_head_dim, v2.v_head_dim) == (128, 64, 128)
    assert from_hf_config(DEEPSEEK_V2_LITE).q_lora_rank is None


def test_dense_layers_follow_transformers_rule_for_qwen():
    hf = QWEN1_5_MOE | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg = from_hf_config(hf)
    assert cfg.dense_layers == (0, 2, 3, 4) and cfg.moe_layers == (1, 5)
    model = hf_model(hf, "Qwen2MoeForCausalLM")
    assert sum(p.numel() for p in model.parameters()) == expected_parameters(cfg)["total"]


@pytest.mark.parametrize("hf,match", [
    (DEEPSEEK_V3 | {"attention_bias": True}, "biases on the latent attention"),
    (DEEPSEEK_V3 | {"moe_layer_freq": 2}, "every moe_layer_freq-th layer"),
    (DEEPSEEK_V3 | {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantized"),
    (DEEPSEEK_V3 | {"hidden_act": "gelu"}, "expected 'silu'"),
    (MIXTRAL_8X7B | {"hidden_act": "gelu"}, "unsupported mixtral hidden_act 'gelu'"),
    (MIXTRAL_8X7B | {"num_experts_per_tok": 9}, r"experts_per_token must be an int in \[1, n_experts=8\]"),
    (QWEN3_30B_A3B | {"expert_bias": 1}, r"does not know: \['expert_bias'\]"),
    ({k: v for k, v in QWEN1_5_MOE.items() if k != "moe_intermediate_size"}, "needs the field 'moe_intermediate_size'"),
])
def test_moe_configs_that_cannot_be_counted_exactly_are_refused(hf, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)


# ---- the command line and the calculator --------------------------------------------------------

def test_command_line_shows_total_and_active(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704 (46.70 B) parameters" in out
    assert "mixture of experts: 8 routed experts, 2 per token, in 32 of 32 layers; 12,879,925,248 (12.88 B)" in out
    assert "decoder.ffn.experts.gate" in out and "active per token" in out
    assert f"bf16 {format_bytes(2 * 46_702_792_704)}" in out, "memory: the total"
    assert "through the active parameters" in out
    path.write_text(json.dumps(DEEPSEEK_V3))
    assert main([str(path), "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "a latent of 512 and a rotary key of 64 values per token and layer" in out
    assert "multi-token prediction: 1 module(s)" in out and "11,610,067,968" in out
    assert f"KV cache (bf16, batch 1, 4096 positions): {format_bytes(61 * 4096 * 576 * 2)}" in out


def test_calculator_sizes_memory_by_the_total_and_flops_by_the_active():
    from tutorial_lib.widgets import render_memory_calculator

    cfg = C.MIXTRAL_8X7B
    fig = render_memory_calculator(cfg, name="Mixtral-8x7B", batch=1, seq_len=4096, dtype="bf16")
    ax_mem, ax_flops = fig.axes
    assert ax_mem.patches[0].get_width() == pytest.approx(2 * 46_702_792_704 / GiB)
    assert "all 8 experts" in ax_mem.get_yticklabels()[0].get_text()
    flops = flops_per_token(cfg, 4096)
    assert ax_flops.patches[0].get_height() == pytest.approx(flops["matmul"] / 1e9)
    assert flops["matmul"] < 2 * 13e9, "forward FLOPs follow the 12.9B active parameters, not the 46.7B"
    title = fig._suptitle.get_text()
    assert "46,702,792,704 parameters, 12,879,925,248 active per token (2 of 8 experts)" in title
    assert "active" in ax_flops.get_title()
