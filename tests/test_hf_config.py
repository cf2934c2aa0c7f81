"""tutorial_lib.hf_config, the one reader of config.json, and the split it serves: the config a
model is built from (tutorial_lib.config.ModelConfig) against the config that also counts
parts tutorial_lib does not build (tutorial_lib.params.CountedConfig); counting against
loading, with the fields they judge differently in one table (VERDICTS); one name for the
head width. Published configs come from test_params (written out, nothing is downloaded)."""

import dataclasses
import json
import warnings

import pytest
from test_params import GPT2, LLAMA2_7B, PHI3_MINI
from test_params_moe import DEEPSEEK_V3, MIXTRAL_8X7B, QWEN3_30B_A3B

from tutorial_lib import config as C
from tutorial_lib import convert, pretrained
from tutorial_lib import hf_config as H
from tutorial_lib import params as P
from tutorial_lib.config import Derived, ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.params import CountedConfig, counted, expected_parameters
from tutorial_lib.transformer import Encoder

# a tiny Llama-2-shaped config.json: what counting reads it as is also loadable
TINY_LLAMA = LLAMA2_7B | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50}

# ---- one table for the fields that counting and loading judge differently ------------------------


def test_every_verdict_gives_a_reason_for_each_use_and_the_readers_use_the_tables_reasons():
    for name, verdict in H.VERDICTS.items():
        assert verdict.counting and verdict.loading and verdict.counting != verdict.loading, name
    listed = set()
    for model_type, (_, spec) in H._FROM_HF.items():
        for name in set(spec["ignored"]) & set(H.VERDICTS):
            listed.add(name)
            assert spec["ignored"][name] == H.VERDICTS[name].counting, (model_type, name, "a second reason")
    assert listed | set(H._VERDICTS_EVERY_TYPE) | {"rope_parameters"} == set(H.VERDICTS), "a verdict no reader uses"
    assert convert.decoder_config is pretrained.decoder_config is H.decoder_config, "one loading reader"
    assert C.from_hf_config(LLAMA2_7B) == H.from_hf_config(LLAMA2_7B), "the old import reads through hf_config"


@pytest.mark.parametrize("hf,field,value", [
    (TINY_LLAMA, "rope_scaling", {"type": "linear", "factor": 2.0}),
    (TINY_LLAMA, "rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    (TINY_LLAMA, "rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
    (TINY_LLAMA, "rope_interleaved", True),
    (PHI3_MINI, "partial_rotary_factor", 0.5),
    (GPT2, "scale_attn_by_inverse_layer_idx", True),
    (GPT2, "scale_attn_weights", False),
])
def test_what_changes_the_computation_but_no_parameter_is_counted_and_refused_for_loading(hf, field, value):
    changed = hf | {field: value}
    assert expected_parameters(H.from_hf_config(changed)) == expected_parameters(H.from_hf_config(hf))
    H.decoder_config(hf)  # the unchanged config loads
    with pytest.raises(ValueError) as refused:
        H.decoder_config(changed)
    message, verdict = str(refused.value), H.VERDICTS[field]
    assert f"{field}={value!r}" in message and verdict.loading in message and verdict.counting in message


def test_quantized_weights_are_counted_only_as_block_fp8_and_never_loaded():
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3", "activation_scheme": "dynamic"}
    assert expected_parameters(H.from_hf_config(TINY_LLAMA | {"quantization_config": fp8})) == \
        expected_parameters(H.from_hf_config(TINY_LLAMA)), "block fp8 keeps every weight's shape"
    with pytest.raises(ValueError, match="not counted: block-wise fp8"):
        H.from_hf_config(TINY_LLAMA | {"quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(ValueError, match="load_pretrained reads unquantized weights"):
        H.decoder_config(TINY_LLAMA | {"quantization_config": fp8})


def test_a_field_never_seen_is_refused_for_counting_and_a_warning_for_loading():
    unknown = TINY_LLAMA | {"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}}
    with pytest.raises(ValueError, match=r"does not know: \['transformers.js_config'\]"):
        H.from_hf_config(unknown)
    with pytest.warns(UserWarning, match=r"llama config.json has fields tutorial_lib has not seen: "
                                         r"transformers\.js_config\. .*Counting \(from_hf_config\) refuses them"):
        loaded = H.decoder_config(unknown)
    assert loaded == H.decoder_config(TINY_LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known fields, metadata included, load without a word
        H.decoder_config(TINY_LLAMA | {"torch_dtype": "float16", "bos_token_id": 1})
    with pytest.raises(ValueError, match="pruned attention heads"):
        H.decoder_config(TINY_LLAMA | {"pruned_heads": {"0": [1]}})  # what counting refuses, loading refuses too


# ---- the config a model is built from, and the one that counts more ---------------------------------


def test_the_reader_returns_the_counting_config_only_when_the_model_needs_it():
    assert type(H.from_hf_config(LLAMA2_7B)) is type(H.from_hf_config(MIXTRAL_8X7B)) is ModelConfig
    for hf in (QWEN3_30B_A3B, DEEPSEEK_V3):
        assert type(H.from_hf_config(hf)) is CountedConfig
    assert not set(P.COUNTED_FIELDS) & {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(C.PRESETS) < set(P.PRESETS) and {"bert-base", "qwen3-30b-a3b", "deepseek-v3"} <= set(P.PRESETS)
    assert P.load_config("bert-base") is P.BERT_BASE
    with pytest.raises(ValueError, match="tutorial_lib.params.PRESETS adds"):
        C.preset("bert-base")


@pytest.mark.parametrize("build,fields,named", [
    (Encoder, dict(family="encoder", type_vocab_size=2), "type_vocab_size=2 (BERT's token-type table)"),
    (Encoder, dict(family="encoder", embedding_norm=True), "embedding_norm=True"),
    (Encoder, dict(family="encoder", pooler=True), "pooler=True"),
    (DecoderOnlyLM, dict(qk_norm=True), "qk_norm=True"),
    (DecoderOnlyLM, dict(positions="rope", bias=False, kv_lora_rank=8, rope_head_dim=2), "kv_lora_rank=8"),
    (DecoderOnlyLM, dict(mtp_modules=1), "mtp_modules=1"),
])
def test_models_refuse_a_counting_config_naming_the_fields_they_cannot_build(build, fields, named):
    cfg = CountedConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_len=8, **fields)
    with pytest.raises(ValueError, match="cannot be built from this CountedConfig") as refused:
        build(cfg)
    assert named in str(refused.value)
    with pytest.raises(TypeError):
        ModelConfig(**fields)  # the config a model is built from has no field for them
    plain = CountedConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_len=8, family=cfg.family)
    assert build(plain).cfg is plain, "asking for nothing unbuilt, a CountedConfig builds"


# ---- one name for the head width ---------------------------------------------------------------------


def test_head_dim_is_held_resolved_and_replace_carries_a_new_width_through():
    cfg = ModelConfig(d_model=64, n_heads=4)
    assert cfg.head_dim == 16 and isinstance(cfg.head_dim, Derived)
    assert "head_dim=16" in repr(cfg)
    assert dataclasses.replace(cfg, d_model=128).head_dim == 32
    assert dataclasses.replace(cfg, n_heads=8).head_dim == 8
    assert dataclasses.replace(C.GPT_TINY, d_model=256).head_dim == 64
    explicit = ModelConfig(d_model=64, n_heads=4, head_dim=32)
    assert dataclasses.replace(explicit, d_model=128).head_dim == 32, "a head width given is kept"
    assert type(explicit.head_dim) is int
    assert cfg == ModelConfig(d_model=64, n_heads=4, head_dim=16) and hash(cfg) == hash(
        ModelConfig(d_model=64, n_heads=4, head_dim=16)), "the same model, whichever way it was said"
    with pytest.raises(ValueError, match=r"d_model \(66\) must be divisible by n_heads \(4\)"):
        dataclasses.replace(cfg, d_model=66)
    model = DecoderOnlyLM(dataclasses.replace(C.GPT_TINY, d_model=64, vocab_size=20))
    assert model.blocks[0].attn.head_dim == 16


def test_to_dict_writes_what_was_given_so_a_round_trip_keeps_replace_working():
    for cfg in (C.GPT_TINY, C.T5_SMALL, P.DEEPSEEK_V3, P.QWEN3_30B_A3B):
        values = cfg.to_dict()
        back = type(cfg).from_dict(json.loads(json.dumps(values)))
        assert back == cfg and values == back.to_dict()
    assert C.GPT_TINY.to_dict()["head_dim"] is None and C.T5_SMALL.to_dict()["head_dim"] == 64
    back = ModelConfig.from_dict(json.loads(json.dumps(C.GPT_TINY.to_dict())))
    assert dataclasses.replace(back, d_model=256).head_dim == 64


def test_the_value_width_has_one_name_too():
    qwen = P.QWEN3_30B_A3B
    assert qwen.v_head_dim == qwen.head_dim == 128 and isinstance(qwen.v_head_dim, Derived)
    assert dataclasses.replace(qwen, head_dim=64).v_head_dim == 64
    assert P.DEEPSEEK_V3.v_head_dim == 128 and type(P.DEEPSEEK_V3.v_head_dim) is int
    assert dataclasses.replace(counted(C.GPT_TINY), d_model=256).head_dim == 64
    assert counted(C.GPT_TINY).v_head_dim == 32 and counted(C.GPT_TINY).to_dict()["v_head_dim"] is None
    with pytest.raises(ValueError, match="give kv_lora_rank as well"):
        CountedConfig(v_head_dim=8)
