"""tutorial_lib.bpe and its file formats (tutorial_lib.tokenizer_files) against independent
tokenizers: tiktoken with OpenAI's cl100k_base and o200k_base rank files (shipped by
bpe-openai), and Hugging Face `tokenizers` (trained here, saved to tokenizer.json). Nothing is
downloaded."""

import json
import os
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tutorial_lib import bpe, tokenizer_files
from tutorial_lib.data import builtin_corpus

STRESS = (
    "Hello, World! HELLO world... I'm, you're, we'VE, DON'T, they'll, she'd, it's\n"
    "Café naïve résumé façade Ångström — e\u0301 (combining) ß ﬁ\n"
    "你好，世界！这是一个测试。日本語のテキストとカタカナ ー 한국어 텍스트입니다\n"
    "Россия и Україна · مرحبا بالعالم · नमस्ते दुनिया · สวัสดีชาวโลก\n"
    "Emoji: 😀👍🏽🇺🇸 👨‍👩‍👧‍👦 ❤️ and 🫠\n"
    "Numbers 1 12 123 1234 12345 123456 3.14159 1,000,000 ٣٤٥ Ⅻ ²³\n"
    "    four spaces   three  two\ttab\t\ttabs\r\nCRLF\n\n\nthree newlines \n \n"
    "non\u00a0breaking\u2009thin\u200bzero\u2028line\u2029para\x00nul\x1bescape\x7f\n"
    "def foo(x):\n    return x ** 2  # comment\n\n\n    \n"
    "CamelCaseWords HTTPServer getHTTPResponseCode iPhone McDonald's\n"
    "trailing spaces   "
)


@pytest.fixture(scope="module")
def corpus():
    return builtin_corpus()


def tiktoken_reference(name):
    """tiktoken's own encoding (its pattern, special tokens and loader), given only the rank file."""
    pytest.importorskip("tiktoken")
    return tokenizer_files.tiktoken_encoding(name)


@pytest.fixture(scope="module", params=["cl100k_base", "o200k_base"])
def openai_pair(request):
    pytest.importorskip("bpe_openai")
    return tokenizer_files.openai_encoding(request.param), tiktoken_reference(request.param)


def test_our_copies_of_the_patterns_and_special_tokens_are_tiktokens(openai_pair, monkeypatch):
    ours, reference = openai_pair
    pattern, specials, _ = tokenizer_files.OPENAI_ENCODINGS[ours.name]
    assert reference._pat_str == pattern, f"{ours.name}: our pattern differs from tiktoken's"
    assert reference._special_tokens == specials == ours.special_tokens, ours.name
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/nonexistent-cache")
    tokenizer_files.tiktoken_encoding(ours.name)
    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/nonexistent-cache", "the caller's cache setting is restored"


def test_openai_encodings_give_tiktokens_ids_on_the_corpus_and_a_unicode_stress_text(openai_pair, corpus):
    ours, reference = openai_pair
    for text in (corpus, STRESS):
        ids = ours.encode(text)
        assert ids == reference.encode_ordinary(text), f"{ours.name}: ids differ from tiktoken's"
        assert ours.decode(ids) == text, f"{ours.name}: the round trip changed the text"
    assert ours.vocab_size == reference.n_vocab, (ours.vocab_size, reference.n_vocab)


def test_special_tokens_are_ids_when_allowed_and_text_otherwise(openai_pair):
    ours, reference = openai_pair
    text = "one<|endoftext|>two <|endofprompt|>"
    assert ours.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all"), \
        "named as allowed, every special token is its id, as in tiktoken"
    assert ours.encode(text) == reference.encode_ordinary(text), "by default a special token's text is text"
    named = ours.encode(text, allowed_special={"<|endoftext|>"})
    assert named == reference.encode(text, allowed_special={"<|endoftext|>"}, disallowed_special=()), \
        "only the named special token becomes an id"
    assert named.count(ours.special_id("<|endoftext|>")) == 1, "the one <|endoftext|> of the text"
    assert ours.special_id("<|endofprompt|>") not in named, "only the special token named becomes an id"
    with pytest.raises(ValueError, match="not special tokens of this tokenizer"):
        ours.encode(text, allowed_special={"<|im_end|>"})


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_round_trips_and_matches_tiktoken(text):
    pytest.importorskip("bpe_openai")
    ours, reference = _cl100k()
    ids = ours.encode(text)
    assert ours.decode(ids) == text, f"round trip of {text!r}"
    assert ids == reference.encode_ordinary(text), f"ids of {text!r} differ from tiktoken's"


_CL100K = {}


def _cl100k():
    if not _CL100K:
        _CL100K["pair"] = (tokenizer_files.openai_encoding("cl100k_base"), tiktoken_reference("cl100k_base"))
    return _CL100K["pair"]


def test_decoding_a_cut_multibyte_character_gives_the_replacement_character():
    pytest.importorskip("bpe_openai")
    ours, reference = _cl100k()
    ids = [ours.vocab[bytes([b])] for b in "é😀".encode()[:-1]]  # the emoji's last byte cut off
    assert ours.decode(ids) == reference.decode(ids) == "é\ufffd", ours.decode(ids)
    assert ours.decode_bytes(ids) == "é😀".encode()[:-1]


# ---- Hugging Face tokenizers: training and tokenizer.json --------------------------------------


def hf_trained(text, vocab_size, specials=()):
    """tokenizers' BPE trainer on ``text`` (a string, or a list of documents trained on one by one)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(specials), show_progress=False)
    tok.train_from_iterator([text] if isinstance(text, str) else text, trainer)
    return tok


@pytest.fixture(scope="module")
def trained_pair(corpus, tmp_path_factory):
    """Ours and tokenizers', both trained on the built-in corpus to 1,000 tokens, no special tokens."""
    theirs = hf_trained(corpus, 1000)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    theirs.save(str(path))
    return bpe.train_bpe(corpus, 1000, special_tokens=()), theirs, path


def test_our_trainer_learns_the_same_merges_as_tokenizers_on_the_corpus(trained_pair):
    ours, _, path = trained_pair
    loaded = tokenizer_files.from_tokenizer_json(path)
    assert len(ours.merges) == 1000 - 256 and len(loaded.merges) == len(ours.merges)
    first_difference = next((i for i, (a, b) in enumerate(zip(ours.merges, loaded.merges)) if a != b), None)
    assert first_difference is None, f"merge {first_difference}: ours {ours.merges[first_difference]}, " \
                                     f"tokenizers' {loaded.merges[first_difference]}"
    assert ours.vocab == loaded.vocab, "same merges in the same order must give the same ids"


def test_a_tokenizers_tokenizer_json_loads_with_identical_ids(trained_pair, corpus):
    ours, theirs, path = trained_pair
    loaded = tokenizer_files.from_tokenizer_json(path)
    for text in (corpus[:50_000], STRESS):
        expected = theirs.encode(text).ids
        assert loaded.encode(text) == expected, "tokenizer.json loaded into ours encodes differently"
        assert ours.encode(text) == expected, "our trained tokenizer encodes differently from tokenizers'"
        assert loaded.decode(expected) == theirs.decode(expected) == text


def test_special_tokens_given_to_both_trainers_change_nothing_but_their_ids(corpus):
    ours = bpe.train_bpe(corpus[:100_000], 400, special_tokens=("<|endoftext|>",))
    theirs = hf_trained(corpus[:100_000], 400, specials=("<|endoftext|>",))
    shift = theirs.token_to_id("!")  # tokenizers puts the special tokens first, ours puts them last
    assert shift == 1 and ours.special_id("<|endoftext|>") == 399
    text = "end<|endoftext|>start " + corpus[:2000]
    ours_ids = ours.encode(text, allowed_special="all")  # tokenizers always splits on added tokens
    theirs_ids = theirs.encode(text).ids
    mapped = [0 if i == 399 else i + shift for i in ours_ids]
    assert mapped == theirs_ids, "with the special token first, every other id moves by one"


def tokenizer_json_variant(trained_pair, tmp_path, pre_tokenizer, normalizer=None, ignore_merges=False):
    from tokenizers import Tokenizer, models

    _, theirs, path = trained_pair
    spec = json.loads(path.read_text())
    vocab, merges = spec["model"]["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                             for m in spec["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    out = tmp_path / "variant.json"
    tok.save(str(out))
    return tok, tokenizer_files.from_tokenizer_json(out)


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.mark.parametrize("variant", ["qwen2 split + NFC", "smollm2 digits", "llama3 ignore_merges", "prefix space"])
def test_tokenizer_json_pipelines_of_real_models_give_identical_ids(variant, trained_pair, corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    kwargs = {
        "qwen2 split + NFC": dict(pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated"), byte_level]),
            normalizer=normalizers.NFC()),
        "smollm2 digits": dict(pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
        "llama3 ignore_merges": dict(pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
            byte_level]), ignore_merges=True),
        "prefix space": dict(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True)),
    }[variant]
    theirs, ours = tokenizer_json_variant(trained_pair, tmp_path, **kwargs)
    text = STRESS + "<|im_start|>user\nHi 2024<|im_end|>" + corpus[:20_000]
    assert ours.encode(text, allowed_special="all") == theirs.encode(text, add_special_tokens=False).ids, variant


def test_saved_gpt2_files_load_into_tokenizers_and_back_with_identical_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    ours = bpe.train_bpe(STRESS * 20, 400)
    vocab_path, merges_path = tokenizer_files.save_gpt2_files(ours, tmp_path)
    theirs = tokenizers.Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    theirs.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    back = tokenizer_files.from_gpt2_files(vocab_path, merges_path)
    assert back.encode(STRESS) == ours.encode(STRESS) == theirs.encode(STRESS).ids
    assert back.special_id("<|endoftext|>") == ours.special_id("<|endoftext|>") == 399


def test_other_kinds_of_tokenizer_json_are_refused_by_name(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    unigram = tokenizers.Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], 0))
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    sentencepiece_bpe = tokenizers.Tokenizer(models.BPE({"<unk>": 0, "▁a": 1, "▁": 2, "a": 3}, [("▁", "a")],
                                                        unk_token="<unk>", byte_fallback=True))
    sentencepiece_bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    for tok, kind in ((unigram, "Unigram"), (wordpiece, "WordPiece"), (sentencepiece_bpe, "SentencePiece")):
        path = tmp_path / f"{kind}.json"
        tok.save(str(path))
        with pytest.raises(ValueError, match=kind):
            tokenizer_files.from_tokenizer_json(path)


# ---- our trainer and encoder on small, hand-checked cases ----------------------------------------


def test_learn_merges_takes_the_most_frequent_pair_and_breaks_ties_by_the_smallest_ids():
    counts = {b"hug": 10, b"pug": 5, b"pun": 12, b"bun": 4, b"hugs": 5}
    merges = bpe.learn_merges(counts, 3)
    # ug: 10 + 5 + 5 = 20; then un: 12 + 4 = 16; then h+ug: 15
    assert merges == [bpe.Merge((b"u", b"g"), 20), bpe.Merge((b"u", b"n"), 16), bpe.Merge((b"h", b"ug"), 15)]
    # a tie: ab and cd both occur 3 times; b"a" has the smaller id in GPT-2's byte order
    assert bpe.learn_merges({b"cd": 3, b"ab": 3}, 1)[0].pair == (b"a", b"b")
    # overlapping pairs both count: "aaa" holds (a, a) twice
    assert bpe.learn_merges({b"aaa": 1, b"bc": 1}, 1)[0] == bpe.Merge((b"a", b"a"), 2)
    assert bpe.learn_merges({b"ab": 1}, 5) == [bpe.Merge((b"a", b"b"), 1)], "stops when no pair is left"


def test_merge_pair_is_left_to_right_without_overlaps():
    ids = [5, 5, 5]
    assert bpe.merge_pair(ids, (5, 5), 7) == [7, 5] and ids == [5, 5, 5], "a new list; the input is unchanged"
    assert bpe.merge_pair([5, 5, 5, 5], (5, 5), 7) == [7, 7]
    assert bpe.merge_pair([1, 2, 3, 1, 2], (1, 2), 9) == [9, 3, 9]


def test_encoding_applies_the_earliest_merge_first_and_a_rank_table_takes_whole_pieces():
    vocab = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"abc": 258}
    with_merges = bpe.BPETokenizer(vocab, merges=[(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")])
    assert with_merges.encode("abc") == [258], "bc is merged first, then a + bc"
    assert with_merges.encode("ab") == [257]
    only_ab = bpe.BPETokenizer(vocab, merges=[(b"b", b"c"), (b"a", b"b")])
    assert only_ab.encode("abc") == [ord("a"), 256], "after b+c, a+bc is not a merge of this list"
    ranks = bpe.BPETokenizer(vocab)  # rank table: a whole piece in the vocab is one token
    assert ranks.encode("abc") == [258] and ranks.encode("abcab") == [258, 257]


def test_train_bpe_gives_the_vocabulary_size_asked_for_and_round_trips(corpus):
    tok = bpe.train_bpe(corpus[:30_000], 300)
    assert tok.vocab_size == 300 and len(tok.merges) == 300 - 256 - 1
    assert [tok.vocab[bytes([b])] for b in bpe.byte_order()] == list(range(256))
    assert len(tok.encode(corpus[:30_000])) < 30_000 * 0.8, "44 merges should compress the text they came from"
    assert tok.decode(tok.encode(STRESS)) == STRESS
    assert tok.encode("<|endoftext|>", allowed_special="all") == [299], "the special token is the last id"
    assert 299 not in tok.encode("<|endoftext|>"), "unnamed, a special token's text is text"


def test_the_word_cache_returns_what_merging_returns(corpus):
    tok = bpe.train_bpe(corpus[:30_000], 400)
    first = tok.encode(corpus[:10_000])
    assert len(tok._cache) > 100
    tok.clear_cache()
    assert not tok._cache and tok.encode(corpus[:10_000]) == first


def test_byte_symbols_are_gpt2s():
    symbols = tokenizer_files.byte_symbols()
    assert symbols[ord(" ")] == "Ġ" and symbols[ord("\n")] == "Ċ" and symbols[ord("a")] == "a"
    assert len(set(symbols)) == 256
    assert tokenizer_files.symbols_to_bytes("Ġhello") == b" hello"
    assert tokenizer_files.bytes_to_symbols(b" hi\n") == "ĠhiĊ"


def test_bad_input_is_a_clear_value_error(tmp_path):
    tok = bpe.train_bpe("abc abc abd", 260, special_tokens=())
    with pytest.raises(ValueError, match="must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(ValueError, match="not a token"):
        tok.decode([10_000])
    with pytest.raises(ValueError, match="ints"):
        tok.decode([1.5])
    with pytest.raises(ValueError, match="vocab_size"):
        bpe.train_bpe("abc", 200)
    with pytest.raises(ValueError, match=r"pair must be two ids .*\(1,\)"):
        bpe.merge_pair([1, 2], (1,), 9)
    with pytest.raises(ValueError, match="ids must be a list of ints, got str"):
        bpe.merge_pair("12", (1, 2), 9)
    with pytest.raises(ValueError, match=r"piece_counts keys must be non-empty bytes, got 'ab' \(encode it"):
        bpe.learn_merges({"ab": 3}, 1)
    with pytest.raises(ValueError, match=r"piece_counts\[b'ab'\] must be a positive int \(an int >= 1; how often"):
        bpe.learn_merges({b"ab": 0}, 1)
    with pytest.raises(ValueError, match="unknown_id must be an id of this tokenizer"):
        bpe.BPETokenizer({b"a": 0}, unknown_id=5)
    with pytest.raises(ValueError, match="not byte-level"):
        tokenizer_files.symbols_to_bytes("▁a")
    with pytest.raises(ValueError, match="capturing groups"):
        bpe.BPETokenizer(tok.vocab, patterns=r"(\w+)")
    with pytest.raises(ValueError, match="cl100k_base"):
        tokenizer_files.openai_encoding("p50k_base")
    (tmp_path / "bad.tiktoken").write_text("not-base64!! x\n")
    with pytest.raises(ValueError, match="line 1"):
        tokenizer_files.load_tiktoken_ranks(tmp_path / "bad.tiktoken")


# ---- training on documents joined by a special token -------------------------------------------


def test_training_on_documents_joined_by_a_special_token_learns_from_the_documents_alone(corpus, tmp_path):
    docs = [corpus[i:i + 2500] for i in range(0, 50_000, 2500)]
    joined = "<|endoftext|>".join(docs)
    ours = bpe.train_bpe(joined, 400)
    one_by_one = sum((bpe.count_pieces(doc) for doc in docs), Counter())
    assert ours.merges == [m.pair for m in bpe.learn_merges(one_by_one, 400 - 256 - 1)], (
        "documents joined with <|endoftext|> must teach what the documents teach one by one")
    # tokenizers' trainer, given the documents one by one, is the reference: given the joined text
    # it does not cut out its special tokens (it learns merges of "<|" and "endoftext")
    theirs = hf_trained(docs, 400, specials=("<|endoftext|>",))
    theirs.save(str(tmp_path / "tokenizer.json"))
    assert ours.merges == tokenizer_files.from_tokenizer_json(tmp_path / "tokenizer.json").merges


def test_no_merge_holds_a_byte_of_the_special_token_that_joins_the_documents():
    docs = ["the cat sat on the mat", "a dog ran to the log", "the end of it"] * 40  # no x, _, <, | or >
    for special in ("<|endoftext|>", "<|im_end|>"):
        tok = bpe.train_bpe(special.join(docs), 300, special_tokens=(special,))
        learned = [a + b for a, b in tok.merges]
        assert learned and not [t for t in learned if set(t) & set(b"x_<|>")], f"{special}: merges {learned}"
        one_by_one = sum((bpe.count_pieces(doc) for doc in docs), Counter())
        assert tok.merges == [m.pair for m in bpe.learn_merges(one_by_one, len(tok.merges))]
    ids = tok.encode("the end<|im_end|>", allowed_special="all")
    assert ids[-1] == tok.special_id("<|im_end|>") and tok.decode(ids) == "the end<|im_end|>"
    with pytest.raises(ValueError, match="special_tokens must be a list of non-empty strings"):
        bpe.count_pieces("a b", special_tokens="<|endoftext|>")


# ---- encode_iterable: a large text piece by piece, the ids of encode ----------------------------

# Atoms of the texts hypothesis builds: every kind of character the patterns treat apart, runs of
# whitespace that a line end may cut, combining marks that normalization joins to the letter
# before them, and special tokens: two that hold a line end, two that begin with another.
ATOMS = [" ", "  ", "\n", "\n\n", "\r\n", "\t", "\u00a0", "\u3000", "\x1c", "a", "Z", "word", "é", "e\u0301",
         "\u0301", "ﬁ", "東京", "😀", "1", "2024", "٣", "'s", "'", "s", ".", "!", "/", "(", "-", "_", "!\n", " \n",
         "\n/", "\n ",
         "<|endoftext|>", "<|endoftext|>\n", "<|im_end|>", "\n<|im_end|>", "<|", "|>", "<|im_"]
SPECIALS = ("<|endoftext|>", "<|endoftext|>\n", "<|im_end|>", "\n<|im_end|>")
_STREAMING = {}


def streaming_tokenizer(name):
    """A tokenizer for each pattern encode_iterable knows and each path around them. Most use
    cl100k_base's rank table, whose 100,000 tokens (runs of spaces and line breaks among them)
    turn a piece cut in the wrong place into other ids; one uses a merge list."""
    if name not in _STREAMING:
        if name == "gpt2 merges":
            _STREAMING[name] = bpe.train_bpe(builtin_corpus()[:30_000], 400, special_tokens=SPECIALS)
        elif name in ("cl100k_base", "o200k_base"):
            pytest.importorskip("bpe_openai")
            _STREAMING[name] = tokenizer_files.openai_encoding(name)
        else:
            ranks = streaming_tokenizer("cl100k_base").vocab
            options = {
                "gpt2": dict(patterns=bpe.GPT2_PATTERN),
                "smollm2 (digits, then gpt2)": dict(patterns=(bpe.DIGIT_PATTERN, bpe.GPT2_PATTERN)),
                "digit runs, nfc, prefix space": dict(patterns=(bpe.DIGITS_PATTERN, bpe.GPT2_PATTERN),
                                                      normalization="NFC", prefix_space=True),
                "nfkc": dict(patterns=bpe.GPT2_PATTERN, normalization="NFKC"),
                "cl100k": dict(patterns=bpe.CL100K_PATTERN),
                "o200k": dict(patterns=bpe.O200K_PATTERN),
            }[name]
            specials = {token: 100_300 + k for k, token in enumerate(SPECIALS)}
            _STREAMING[name] = bpe.BPETokenizer(ranks, special_tokens=specials, name=name, **options)
    return _STREAMING[name]


STREAMING_NAMES = ["gpt2 merges", "gpt2", "smollm2 (digits, then gpt2)", "digit runs, nfc, prefix space", "nfkc",
                   "cl100k", "o200k", "cl100k_base", "o200k_base"]


def split_at(text, cuts):
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", STREAMING_NAMES)
@settings(max_examples=300, deadline=None)
@given(atoms=st.lists(st.sampled_from(ATOMS), max_size=40), cuts=st.lists(st.integers(0, 200), max_size=12),
       allowed=st.sampled_from([(), "all", ("<|im_end|>",), ("\n<|im_end|>", "<|endoftext|>"), ("<|endoftext|>\n",)]))
def test_encode_iterable_gives_encodes_ids_for_any_split_of_the_text(name, atoms, cuts, allowed):
    tok = streaming_tokenizer(name)
    if allowed not in ((), "all") and not set(allowed) <= set(tok.special_tokens):
        allowed = "all"
    text = "".join(atoms)
    lines = split_at(text, cuts)
    assert list(tok.encode_iterable(lines, allowed_special=allowed)) == tok.encode(text, allowed_special=allowed), (
        f"{name}: {lines!r}")


@pytest.mark.parametrize("name", ["gpt2 merges", "smollm2 (digits, then gpt2)", "cl100k_base"])
def test_encode_iterable_on_the_corpus_gives_encodes_ids_and_holds_only_a_tail(name, corpus):
    tok = streaming_tokenizer(name)
    expected = tok.encode(corpus)
    rng = random.Random(0)
    chunks = split_at(corpus, [rng.randrange(len(corpus)) for _ in range(3000)])
    assert list(tok.encode_iterable(chunks)) == expected, "chunks cut at random"
    read, written, most_held = 0, 0, 0

    def lines():  # counts the bytes handed over
        nonlocal read
        for line in corpus.splitlines(keepends=True):
            read += len(line.encode())
            yield line

    ids = []
    for i in tok.encode_iterable(lines()):
        ids.append(i)
        written += len(tok.token_bytes(i))
        most_held = max(most_held, read - written)
    assert ids == expected, "the corpus line by line"
    longest_line = max(len(line.encode()) for line in corpus.splitlines())
    assert most_held <= longest_line + 200, (
        f"held up to {most_held} bytes of a {len(corpus):,}-character text: more than a line and a tail")


def test_encode_iterable_refuses_what_it_cannot_cut_exactly_and_checks_its_arguments():
    tok = streaming_tokenizer("gpt2 merges")
    other = bpe.BPETokenizer(tok.vocab, merges=tok.merges, patterns=r"\w+|\W+")
    with pytest.raises(ValueError, match="encode_iterable cuts text only where"):
        other.encode_iterable(["a b"])
    with pytest.raises(ValueError, match="one piece"):
        bpe.BPETokenizer(tok.vocab, merges=tok.merges, patterns=()).encode_iterable(["a b"])
    with pytest.raises(ValueError, match="for one string use encode"):
        tok.encode_iterable("a b")
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode_iterable(["a"], allowed_special={"<|nope|>"})  # at the call, not at the first id
    with pytest.raises(ValueError, match="open the file in text mode"):
        list(tok.encode_iterable([b"a b\n"]))
    with pytest.raises(ValueError, match="lone surrogate"):
        list(tok.encode_iterable(["a \ud800 b"]))
