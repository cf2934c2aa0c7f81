"""tutorial_lib.pretrained on tiny random checkpoints that `transformers` makes and saves here
(save_pretrained, whole and sharded): identical logits, identical greedy continuations with
the KV cache, a bf16 load, and clear errors for broken folders. Nothing is downloaded."""

import json

import pytest
import torch

from tutorial_lib import bpe, pretrained, tokenizer_files
from tutorial_lib.convert import from_hf_model
from tutorial_lib.hf_config import VERDICTS, decoder_config, from_hf_config
from tutorial_lib.sampling import generate

transformers = pytest.importorskip("transformers")

VOCAB = 101
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=96, initializer_range=0.2)


def family_config(name):
    """A tiny config of each family; initializer_range 0.2 spreads the logits of a random model,
    so that greedy decoding is not decided by rounding-level differences."""
    return {
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=96, n_embd=48, n_layer=2, n_head=4,
                                                initializer_range=0.2),
        "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
        "llama-tied": lambda: transformers.LlamaConfig(**LLAMA_LIKE, tie_word_embeddings=True),
        "mistral": lambda: transformers.MistralConfig(**LLAMA_LIKE, sliding_window=64),
        "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE, tie_word_embeddings=True),
        "gemma": lambda: transformers.GemmaConfig(**LLAMA_LIKE, head_dim=16),
        "phi3": lambda: transformers.Phi3Config(**LLAMA_LIKE, pad_token_id=0),
    }[name]()


FAMILIES = ["gpt2", "llama", "llama-tied", "mistral", "qwen2", "gemma", "phi3"]


def save_tiny(name, folder, shard=None, seed=0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(family_config(name)).eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ours does
    hf.save_pretrained(folder, max_shard_size=shard) if shard else hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_loads_with_identical_logits_and_greedy_continuations(name, tmp_path):
    hf = save_tiny(name, tmp_path, shard="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file(), "the checkpoint should be sharded"
    loaded = pretrained.load_pretrained(tmp_path)
    assert loaded.tokenizer is None and not loaded.model.training
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    prompt = ids[:, :6]
    ours = generate(loaded.model, prompt, 32, use_cache=True)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(ours, theirs), f"{name}: greedy continuations differ"


def test_whole_and_sharded_checkpoints_give_the_same_weights(tmp_path):
    save_tiny("qwen2", tmp_path / "whole")
    save_tiny("qwen2", tmp_path / "sharded", shard="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    whole = pretrained.load_pretrained(tmp_path / "whole").model.state_dict()
    sharded = pretrained.load_pretrained(tmp_path / "sharded").model.state_dict()
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[k], sharded[k]) for k in whole), "the shards hold the same tensors"
    assert "blocks.0.attn.qkv.bias" in whole and "blocks.0.attn.out.bias" not in whole, "Qwen2: QKV biases only"


def test_a_bf16_load_holds_the_weights_rounded_to_bf16_and_close_logits(tmp_path):
    hf = save_tiny("llama", tmp_path)
    fp32 = pretrained.load_pretrained(tmp_path).model
    bf16 = pretrained.load_pretrained(tmp_path, dtype="bf16").model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.rotary.inv_freq.dtype == torch.float32, "RoPE's frequencies stay float32"
    for (name, a), b in zip(fp32.named_parameters(), bf16.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), f"{name} is not the fp32 weight rounded to bf16"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact, rounded = hf(ids).logits, bf16(ids).logits.float()
    error = (exact - rounded).abs().max().item()
    assert error < 0.05 * exact.abs().max().item(), f"bf16 logits off by {error}"


def test_tied_tables_stay_one_tensor_and_memory_holds_one_copy(tmp_path):
    save_tiny("gpt2", tmp_path)
    model = pretrained.load_pretrained(tmp_path).model
    assert model.head.weight is model.embed.tokens.weight
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    n_hf = sum(p.numel() for p in hf_model.parameters())
    assert sum(p.numel() for p in model.parameters()) == n_hf, "same parameter count as transformers'"


def test_a_missing_shard_is_named(tmp_path):
    save_tiny("llama", tmp_path, shard="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(ValueError, match=f"shard {shards[1].name} is missing.*model.layers"):
        pretrained.load_pretrained(tmp_path)


def test_missing_and_extra_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file(tensors | {"model.layers.0.mlp.extra.weight": torch.zeros(3)}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.mlp\.extra\.weight"):
        pretrained.load_pretrained(tmp_path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        pretrained.load_pretrained(tmp_path)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("gpt2", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(48, 100)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight .* does not fit blocks\.1\.ffn\.up"):
        pretrained.load_pretrained(tmp_path)


def test_the_folders_tokenizer_comes_back(tmp_path):
    trained = bpe.train_bpe("the cat sat on the mat; the dog sat on the log. " * 20, 280)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=trained.vocab_size, n_positions=32, n_embd=16,
                                                         n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer_files.save_gpt2_files(trained, tmp_path)
    loaded = pretrained.load_pretrained(tmp_path)
    text = "the dog sat on the cat<|endoftext|>"
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(text) == trained.encode(text)
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size < 280, "the short text ran out of pairs"


def test_a_tokenizer_this_package_does_not_read_is_a_warning_and_none(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    save_tiny("llama", tmp_path)
    sentencepiece_bpe = tokenizers.Tokenizer(models.BPE({"<unk>": 0, "▁a": 1, "▁": 2, "a": 3}, [("▁", "a")],
                                                        unk_token="<unk>", byte_fallback=True))
    sentencepiece_bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece_bpe.save(str(tmp_path / "tokenizer.json"))
    with pytest.warns(UserWarning, match="tokenizer is not one tutorial_lib reads.*SentencePiece"):
        loaded = pretrained.load_pretrained(tmp_path)
    assert loaded.tokenizer is None and loaded.config.vocab_size == VOCAB, "the model still loads"


def test_the_header_reader_agrees_with_safetensors(tmp_path):
    from safetensors import safe_open

    save_tiny("phi3", tmp_path)
    header = pretrained.read_safetensors_header(tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert sorted(header) == sorted(f.keys())
        for name in f.keys():
            assert list(f.get_slice(name).get_shape()) == header[name]["shape"], name


def test_a_hub_id_offline_is_a_clear_error_without_touching_the_network(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not pretrained.hub_reachable()
    with pytest.raises(ConnectionError, match="not reachable"):
        pretrained.load_pretrained("tutorial-lib-tests/no-such-model")


def test_configs_that_change_the_computation_are_refused():
    base = family_config("llama").to_dict()
    with pytest.raises(ValueError, match="rope_scaling"):
        decoder_config(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope_interleaved"):
        decoder_config(base | {"rope_interleaved": True})
    with pytest.raises(ValueError, match="'bert' is an encoder model, not a decoder-only one; .* maps .*gpt2"):
        decoder_config(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64).to_dict())
    mixtral = transformers.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2).to_dict()
    with pytest.raises(ValueError, match="'mixtral' is a mixture of experts, whose expert weights this loader "
                                         "has no map for; load_pretrained maps .*llama"):
        decoder_config(mixtral)
    mistral = family_config("mistral").to_dict()
    assert decoder_config(mistral).max_len == 64, "an active sliding window of 64 becomes the context limit"
    qwen = family_config("qwen2").to_dict() | {"sliding_window": 32, "use_sliding_window": False}
    assert decoder_config(qwen).max_len == 96, "an unused sliding window changes nothing"


def edit_config(folder, **changes):
    """config.json of a saved checkpoint with fields added or replaced (``None`` removes one)."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    path.write_text(json.dumps(config), encoding="utf-8")
    return config


def test_a_metadata_field_never_seen_loads_with_a_warning_but_is_refused_for_counting(tmp_path):
    hf = save_tiny("llama", tmp_path)
    js_config = {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}  # as SmolLM2's config.json carries
    config = edit_config(tmp_path, **{"transformers.js_config": js_config})
    with pytest.warns(UserWarning, match=r"has not seen: transformers\.js_config\. They are taken as metadata"):
        loaded = pretrained.load_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"does not know: \['transformers.js_config'\]"):
        from_hf_config(config)  # counting stays strict: it cannot check a count against weights
    edit_config(tmp_path, **{"transformers.js_config": None, "rope_interleaved": True})
    with pytest.raises(ValueError, match="rope_interleaved"):
        pretrained.load_pretrained(tmp_path)  # a field that changes the computation is refused, not warned about


def test_linear_rope_scaling_is_counted_but_refused_for_loading_with_the_reason_of_the_one_table(tmp_path):
    from tutorial_lib.params import expected_parameters

    save_tiny("llama", tmp_path)
    config = edit_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    plain = {key: value for key, value in config.items() if key != "rope_scaling"}
    assert expected_parameters(from_hf_config(config)) == expected_parameters(from_hf_config(plain)), \
        "counting: RoPE scaling changes no parameter"
    verdict = VERDICTS["rope_scaling"]
    for load in (lambda: decoder_config(config), lambda: pretrained.load_pretrained(tmp_path)):
        with pytest.raises(ValueError) as refused:
            load()
        message = str(refused.value)
        assert "rope_scaling={'type': 'linear', 'factor': 2.0}" in message, message
        assert verdict.loading in message and verdict.counting in message, "both reasons, from the one table"


def test_bad_sources_and_dtypes_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        pretrained.load_pretrained(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="no config.json"):
        pretrained.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(family_config("gpt2").to_dict()))
    with pytest.raises(ValueError, match="neither model.safetensors"):
        pretrained.load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a Hub model id"):
        pretrained.load_pretrained("./a/b/c/nothing")


def test_the_in_memory_copy_uses_the_same_map():
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(family_config("phi3")).eval()
    ours = from_hf_model(hf)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
