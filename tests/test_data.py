"""Character tokenizer, the built-in corpus, the train/validation split and language-model batches."""

import pytest
import torch

from tutorial_lib.data import (
    CharTokenizer,
    builtin_corpus,
    lm_batch,
    lm_windows,
    load_corpus,
    pad_sequences,
    train_val_split,
)

SPECIALS = ("<pad>", "<bos>", "<eos>")


@pytest.fixture(scope="module")
def corpus():
    return builtin_corpus()


# ---- tokenizer ----------------------------------------------------------------------------------

def test_round_trip_and_ids_in_sorted_character_order():
    text = "hello, world\nHELLO!"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == tuple(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.encode("\n !") == [0, 1, 2]  # "\n" < " " < "!" in code-point order


def test_round_trip_of_the_whole_corpus(corpus):
    tok = CharTokenizer.from_text(corpus)
    ids = tok.encode(corpus)
    assert len(ids) == len(corpus) and max(ids) == tok.vocab_size - 1
    assert tok.decode(ids) == corpus


def test_unknown_character_is_a_clear_error():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="character 'z' is not in the tokenizer's vocabulary"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="outside the vocabulary of 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="integer ids >= 0"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="flat sequence"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))


def test_specials_come_first_and_are_skipped_on_request():
    tok = CharTokenizer.from_text("ba", SPECIALS)
    assert tok.vocab_size == 5
    assert [tok.special_id(s) for s in SPECIALS] == [0, 1, 2]
    assert tok.encode("ab") == [3, 4]
    ids = [1, 3, 4, 2, 0, 0]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_specials=False) == "<bos>ab<eos><pad><pad>"
    with pytest.raises(ValueError, match="'<unk>' is not a special token"):
        tok.special_id("<unk>")


def test_bad_vocabularies_are_refused():
    with pytest.raises(ValueError, match="distinct single characters"):
        CharTokenizer(("a", "a"))
    with pytest.raises(ValueError, match="distinct single characters"):
        CharTokenizer(("ab",))
    with pytest.raises(ValueError, match="specials must be distinct"):
        CharTokenizer(("a",), ("<pad>", "<pad>"))


# ---- corpus -------------------------------------------------------------------------------------

def test_builtin_corpus_is_about_half_a_megabyte_of_english_and_needs_no_download(corpus):
    assert 300_000 < len(corpus) < 1_000_000, f"{len(corpus)} characters"
    assert corpus == builtin_corpus(), "the same text every call"
    assert corpus == load_corpus()
    for word in ("The ", "statement", "function", "return"):
        assert word in corpus
    letters = sum(c.isalpha() for c in corpus)
    assert letters > 0.6 * len(corpus), "mostly English prose"
    assert len(set(corpus)) < 150, "a small character vocabulary"


def test_load_corpus_reads_any_utf8_file(tmp_path):
    text = "Ünïcode text, line after line.\n" * 100
    path = tmp_path / "mine.txt"
    path.write_text(text, encoding="utf-8")
    assert load_corpus(path) == text
    assert load_corpus(str(path)) == text


def test_load_corpus_refuses_missing_and_tiny_files(tmp_path):
    with pytest.raises(ValueError, match="no text file at"):
        load_corpus(tmp_path / "missing.txt")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    with pytest.raises(ValueError, match="holds only 9 characters"):
        load_corpus(tiny)


# ---- split and batches ------------------------------------------------------------------------

def test_split_is_contiguous_disjoint_and_covers_the_stream():
    ids = torch.arange(1000)
    train, val = train_val_split(ids, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert torch.equal(torch.cat([train, val]), ids), "train then validation, nothing lost or repeated"
    assert torch.equal(train, torch.arange(900)) and torch.equal(val, torch.arange(900, 1000))


def test_split_refuses_bad_arguments():
    with pytest.raises(ValueError, match="1-D token stream"):
        train_val_split(torch.zeros(2, 5))
    for bad in (0.0, 1.0, -0.2):
        with pytest.raises(ValueError, match="val_fraction must lie in"):
            train_val_split(torch.arange(10), bad)
    with pytest.raises(ValueError, match="leave one of the parts empty"):
        train_val_split(torch.arange(2), 0.6)  # 0.8 training tokens round down to none


def test_lm_batch_targets_are_the_inputs_shifted_by_one():
    stream = torch.arange(500) * 7 % 101  # every window is recognisable by its first value
    x, y = lm_batch(stream, 16, 32, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]), "y[t] is the token after x[t]"
    starts = [int((stream == row[0]).nonzero()[0]) for row in x]
    for row_x, row_y, s in zip(x, y, starts):
        assert torch.equal(row_x, stream[s:s + 32]) and torch.equal(row_y, stream[s + 1:s + 33])


def test_lm_batch_is_reproducible_reaches_the_end_and_never_runs_past_it():
    stream = torch.arange(40)
    x1, _ = lm_batch(stream, 8, 10, generator=torch.Generator().manual_seed(3))
    x2, _ = lm_batch(stream, 8, 10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2)
    _, y = lm_batch(stream, 4000, 10, generator=torch.Generator().manual_seed(0))
    assert int(y.max()) == 39, "the last token is a target of some window"
    assert int(y[:, 0].min()) == 1


def test_lm_batch_refuses_streams_too_short_and_bad_sizes():
    with pytest.raises(ValueError, match="must be longer than block_size"):
        lm_batch(torch.arange(10), 2, 10)
    with pytest.raises(ValueError, match="1-D token stream"):
        lm_batch(torch.zeros(2, 50, dtype=torch.long), 2, 10)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int \(an int >= 1\), got 0"):
        lm_batch(torch.arange(50), 0, 10)


def test_pad_sequences_right_pads_to_the_longest_or_a_given_length():
    out = pad_sequences([[5, 6, 7], [8]], pad_id=0)
    assert out.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert pad_sequences([[1]], pad_id=9, length=3).tolist() == [[1, 9, 9]]
    with pytest.raises(ValueError, match="does not fit in length 2"):
        pad_sequences([[1, 2, 3]], pad_id=0, length=2)


def test_lm_windows_cover_the_stream_once_without_overlap():
    stream = torch.arange(105)
    x, y = lm_windows(stream, 10)
    assert x.shape == y.shape == (10, 10)
    assert torch.equal(x.flatten(), torch.arange(100)), "consecutive, no overlap"
    assert torch.equal(y, x + 1), "each target is the next token"
    x3, _ = lm_windows(stream, 10, max_windows=3)
    assert torch.equal(x3, x[:3])
    with pytest.raises(ValueError, match="must be longer than block_size"):
        lm_windows(torch.arange(10), 10)
