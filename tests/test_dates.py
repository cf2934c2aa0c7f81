"""The date task: every format reads back to its date with Python's own parser, no string
belongs to two dates, the held-out dates never reach training, and batches hold the right ids
in the right places."""

import re
from datetime import date, datetime

import pytest
import torch

from tutorial_lib import dates as D

# An independent reading of every format: datetime.strptime patterns. Ordinal suffixes are
# checked against the table below and removed first; %y is strptime's two-digit year.
PATTERNS = {
    "iso": "%Y-%m-%d", "us_slash": "%m/%d/%y", "us_slash_padded": "%m/%d/%y",
    "us_slash_long": "%m/%d/%Y", "eu_dots": "%d.%m.%Y", "eu_dots_short": "%d.%m.%y",
    "eu_dashes": "%d-%m-%Y", "year_dots": "%Y.%m.%d", "year_slash": "%Y/%m/%d", "compact": "%Y%m%d",
    "day_month": "%d %B %Y", "day_mon": "%d %b %Y", "day_mon_dashes": "%d-%b-%y",
    "month_day": "%B %d, %Y", "mon_day": "%b %d, %Y", "month_ordinal": "%B %d, %Y",
    "ordinal_of": "%d of %B %Y", "the_ordinal_of": "the %d of %B, %Y",
    "weekday_day_month": "%A, %d %B %Y", "weekday_month_day": "%A, %B %d, %Y",
    "wkd_day_mon": "%a %d %b %Y", "upper": "%d %B %Y", "lower_short_year": "%B %d %y",
}
SUFFIXES = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}  # else "th"
ORDINAL = re.compile(r"\b(\d{1,2})(st|nd|rd|th)\b")


def parse_independently(text: str, fmt: str) -> date:
    def strip_suffix(match):
        day, suffix = int(match.group(1)), match.group(2)
        assert suffix == SUFFIXES.get(day, "th"), f"{text!r}: wrong ordinal suffix for {day}"
        return str(day)

    pattern = PATTERNS[fmt]
    parsed = datetime.strptime(ORDINAL.sub(strip_suffix, text), pattern)
    if "%A" in pattern or "%a" in pattern:  # strptime reads the weekday but does not check it
        weekday = text.split(",")[0].split(" ")[0]
        assert weekday == parsed.strftime("%A" if "%A" in pattern else "%a"), f"{text!r}: wrong weekday"
    year = parsed.year
    if "%y" in pattern:  # the task's reading: the year of 1950..2049 with these last two digits
        year = 1950 + (year % 100 - 50) % 100
    return parsed.date().replace(year=year)


EDGE_DATES = [D.FIRST_DATE, D.LAST_DATE, date(1999, 12, 31), date(2000, 1, 1), date(2000, 2, 29),
              date(1996, 2, 29), date(1998, 3, 3), date(2011, 11, 11), date(2012, 12, 12),
              date(2021, 5, 22), date(1963, 8, 23), date(1970, 1, 31), date(2049, 1, 1)]


def test_every_format_has_an_independent_parse_pattern():
    assert set(PATTERNS) == set(D.FORMAT_NAMES)
    assert len(D.FORMAT_NAMES) >= 20


@pytest.mark.parametrize("fmt", D.FORMAT_NAMES)
def test_every_format_parses_back_to_the_same_date(fmt):
    rng = torch.Generator().manual_seed(5)
    sample = [D.FIRST_DATE + (D.LAST_DATE - D.FIRST_DATE) * (i / 400) for i in range(401)]
    every = D.all_dates()
    sample += [every[i] for i in torch.randint(len(every), (300,), generator=rng).tolist()]
    for d in EDGE_DATES + sample:
        text = D.format_date(d, fmt)
        assert parse_independently(text, fmt) == d, f"{fmt}: {text!r} does not read back as {d}"


@pytest.mark.parametrize("fmt", D.FORMAT_NAMES)
def test_field_spans_point_at_the_year_month_day_and_weekday(fmt):
    for d in EDGE_DATES:
        text, spans = D.format_date(d, fmt), D.field_spans(d, fmt)
        assert {"year", "month", "day"} <= set(spans) <= {"year", "month", "day", "weekday"}
        part = {name: text[a:b] for name, (a, b) in spans.items()}
        assert int(re.match(r"\d+", part["day"]).group()) == d.day
        month = part["month"]
        assert (int(month) if month.isdigit() else datetime.strptime(month, "%B" if len(month) > 3 else "%b").month
                ) == d.month
        assert int(part["year"]) == (d.year if len(part["year"]) == 4 else d.year % 100)
        if "weekday" in part:
            assert d.strftime("%A").startswith(part["weekday"])
        covered = sorted(spans.values())
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), "spans do not overlap"


def test_the_formats_look_the_way_people_write_dates():
    d = date(1998, 3, 3)
    assert D.format_date(d, "ordinal_of") == "3rd of March 1998"
    assert D.format_date(d, "us_slash_padded") == "03/03/98"
    assert D.format_date(d, "month_day") == "March 3, 1998"
    assert D.format_date(d, "year_dots") == "1998.03.03"
    assert D.format_date(d, "weekday_day_month") == "Tuesday, 3 March 1998"
    assert [D.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st"]


def test_a_two_digit_year_is_the_years_last_two_digits_on_both_sides_of_2000():
    assert D.format_date(date(2021, 5, 2), "us_slash") == "5/2/21"
    assert D.format_date(date(1951, 5, 2), "us_slash") == "5/2/51"
    assert D.format_date(date(2000, 5, 2), "us_slash") == "5/2/00"


@pytest.fixture(scope="module")
def every_string():
    """Every source string of the task's range (all dates x all formats) -> its dates."""
    readings: dict[str, set] = {}
    for d in D.all_dates():
        for fmt in D.FORMAT_NAMES:
            readings.setdefault(D.format_date(d, fmt), set()).add(d)
    return readings


def test_no_source_string_belongs_to_two_dates(every_string):
    ambiguous = {text: ds for text, ds in every_string.items() if len(ds) > 1}
    assert not ambiguous, f"{len(ambiguous)} strings have two readings, e.g. {next(iter(ambiguous.items()))}"
    assert len(D.all_dates()) == 36525  # 100 years, 25 of them leap years


def test_every_source_string_fits_the_source_vocabulary_and_max_length(every_string):
    longest = max(every_string, key=len)
    assert len(longest) == D.MAX_SOURCE_LEN, longest
    alphabet = set("".join(every_string))
    assert alphabet == set(D.SOURCE.chars)
    assert set("0123456789-") == set(D.TARGET.chars) <= alphabet
    assert D.SOURCE.specials == D.TARGET.specials == ("<pad>", "<bos>", "<eos>")
    assert (D.PAD, D.BOS, D.EOS) == (0, 1, 2)


def test_held_out_dates_and_training_dates_split_the_range(every_string):
    train, held = set(D.TRAIN_DATES), set(D.HELD_OUT_DATES)
    assert not train & held
    assert train | held == set(D.all_dates())
    assert 0.08 < len(held) / 36525 < 0.12
    # No held-out source string can be written from a training date: it has one reading, held out.
    for example in D.held_out_examples():
        assert every_string[example.source] == {example.date} and example.date in held


def test_the_held_out_set_is_fixed_balanced_and_distinct():
    examples = D.held_out_examples()
    assert len(examples) == 1000 and examples == D.held_out_examples()
    assert D.held_out_examples(10) == examples[:10]
    assert len({e.source for e in examples}) == 1000
    counts = {f: sum(e.format == f for e in examples) for f in D.FORMAT_NAMES}
    assert min(counts.values()) >= 1000 // len(D.FORMAT_NAMES)
    for e in examples[:50]:
        assert e.target == e.date.isoformat() and e.source == D.format_date(e.date, e.format)
    # pinned, so that a change of the list (or of Python's random) is noticed
    assert examples[0][:2] == ("1973-08-08", "1973-08-08") and examples[1][:2] == ("8/17/01", "2001-08-17")


def test_training_batches_never_hold_a_held_out_date():
    held_sources = {e.source for e in D.held_out_examples()}
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        examples = D.sample_examples(500, generator)
        assert not any(D.is_held_out(e.date) for e in examples)
        assert not held_sources & {e.source for e in examples}
    formats = {e.format for e in D.sample_examples(2000, generator)}
    assert formats == set(D.FORMAT_NAMES)


def test_a_batch_holds_bos_eos_and_pad_in_the_right_places():
    examples = [D.make_example(date(1998, 3, 3), "ordinal_of"), D.make_example(date(2001, 8, 17), "us_slash")]
    batch = D.make_batch(examples)
    src_1 = D.SOURCE.encode("8/17/01")
    assert batch.src.shape == (2, len("3rd of March 1998"))
    assert batch.src[0].tolist() == D.SOURCE.encode("3rd of March 1998")
    assert batch.src[1].tolist() == src_1 + [D.PAD] * (17 - len(src_1))
    assert batch.src_keep.tolist() == [[True] * 17, [True] * 7 + [False] * 10]
    target = D.TARGET.encode("1998-03-03")
    assert batch.tgt_in[0].tolist() == [D.BOS] + target
    assert batch.tgt_out[0].tolist() == target + [D.EOS]
    assert torch.equal(batch.tgt_in[:, 1:], batch.tgt_out[:, :-1]), "tgt_in is tgt_out shifted right"
    assert [D.decode_target(row) for row in batch.tgt_out] == ["1998-03-03", "2001-08-17"]
    assert batch.tgt_keep.all()
    src_mask, tgt_mask = batch.masks()
    assert src_mask.shape == (2, 1, 1, 17) and torch.equal(src_mask[:, 0, 0], batch.src_keep)
    assert tgt_mask.shape == (2, 1, 11, 11) and torch.equal(tgt_mask[0, 0], torch.ones(11, 11).tril().bool())


def test_targets_of_unequal_length_are_padded_after_eos():
    short = D.DateExample("3 Mar 1998", "1998-03", date(1998, 3, 3), "day_mon")
    full = D.make_example(date(1998, 3, 3), "day_mon")
    batch = D.make_batch([short, full])
    assert batch.tgt_out[0].tolist() == D.TARGET.encode("1998-03") + [D.EOS] + [D.PAD] * 3
    assert batch.tgt_in[0].tolist() == [D.BOS] + D.TARGET.encode("1998-03") + [D.PAD] * 3
    assert batch.tgt_keep[0].tolist() == [True] * 8 + [False] * 3
    _, tgt_mask = batch.masks()
    assert not tgt_mask[0, 0, 9, 8] and tgt_mask[0, 0, 7, 7] and not tgt_mask[0, 0, 3, 4]


def test_train_batches_are_reproducible_and_read_back_to_their_targets():
    a = D.train_batch(64, torch.Generator().manual_seed(3))
    b = D.train_batch(64, torch.Generator().manual_seed(3))
    c = D.train_batch(64, torch.Generator().manual_seed(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.src[:, :5], c.src[:, :5])
    assert a.tgt_out.shape == (64, D.TARGET_LEN) and (a.tgt_out[:, -1] == D.EOS).all()
    assert (a.tgt_in[:, 0] == D.BOS).all()
    for src, tgt in zip(a.src, a.tgt_out):
        text = D.SOURCE.decode(src)
        target = date.fromisoformat(D.decode_target(tgt))
        readings = [f for f in D.FORMAT_NAMES if D.format_date(target, f) == text]
        assert readings and parse_independently(text, readings[0]) == target


def test_field_alignment_measures_attention_on_the_matching_source_part():
    examples = [D.make_example(date(1998, 3, 3), "ordinal_of"), D.make_example(date(2001, 8, 17), "us_slash")]
    batch = D.make_batch(examples)
    S, T = batch.src.size(1), batch.tgt_in.size(1)
    weights = torch.zeros(2, 2, 3, T, S)  # (L, B, h, T, S)
    for b, e in enumerate(examples):
        spans = D.field_spans(e.date, e.format)
        for field, (first, last) in D.TARGET_FIELDS.items():
            start, end = spans[field]
            weights[1, b, 2, first:last, start:end] = 1.0 / (end - start)  # layer 1, head 2: aligned
        weights[0, b, 0, :, : len(e.source)] = 1.0 / len(e.source)  # layer 0, head 0: uniform
    scores = D.field_alignment(weights, examples)
    assert scores.shape == (2, 3, 3)
    torch.testing.assert_close(scores[1, 2], torch.ones(3))
    # uniform: month "March" is 5 of 17 characters, "8" is 1 of 7; years 4/17 and 2/7; days 3/17 and 2/7
    expected = torch.tensor([(4 / 17 + 2 / 7) / 2, (5 / 17 + 1 / 7) / 2, (3 / 17 + 2 / 7) / 2])
    torch.testing.assert_close(scores[0, 0], expected)
    assert scores[0, 1].abs().max() == 0
    with pytest.raises(ValueError, match="expected cross-attention weights"):
        D.field_alignment(weights[:, :1], examples)


def test_decoding_and_exact_match():
    ids = D.TARGET.encode("2001-08-17") + [D.EOS, D.PAD, 5]
    assert D.decode_target(ids) == "2001-08-17"
    assert D.decode_target(torch.tensor(D.TARGET.encode("1999"))) == "1999"
    assert D.exact_match(["1998-03-03", "1998-03-04"], ["1998-03-03", "1998-03-03"]) == 0.5


@pytest.mark.parametrize("bad, message", [
    (lambda: D.format_date(date(1998, 3, 3), "klingon"), "no date format named 'klingon'"),
    (lambda: D.format_date(date(1949, 12, 31), "iso"), r"1950-01-01\.\.2049-12-31"),
    (lambda: D.held_out_examples(0), r"n must be an int in \[1, N_HELD_OUT=1000\], got 0"),
    (lambda: D.make_batch([]), "at least one example"),
    (lambda: D.sample_examples(4, torch.Generator(), formats=["iso", "nope"]), "no date format named 'nope'"),
    (lambda: D.exact_match(["a"], []), "1 predictions for 0 targets"),
    (lambda: D.encode_source("3 März 1998"), "not in the tokenizer's vocabulary"),
])
def test_bad_input_raises_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


# ---- the model helpers: config, loss, answers ---------------------------------------------------


def test_model_config_fits_the_task_and_takes_changes():
    cfg = D.model_config(d_model=32)
    assert (cfg.vocab_size, cfg.source_vocab_size) == (D.TARGET.vocab_size, D.SOURCE.vocab_size)
    assert cfg.max_len > D.MAX_SOURCE_LEN and cfg.max_len >= D.TARGET_LEN
    assert cfg.d_model == 32 and cfg.family == "encoder-decoder"


def test_loss_is_label_smoothed_cross_entropy_without_padding():
    from tutorial_lib.transformer import EncoderDecoder

    torch.manual_seed(0)
    model = EncoderDecoder(D.model_config(d_model=32)).eval()
    short = D.DateExample("3 Mar 1998", "1998-03", date(1998, 3, 3), "day_mon")
    batch = D.make_batch([short, D.make_example(date(2001, 8, 17), "us_slash")])
    src_mask, tgt_mask = batch.masks()
    logits = model(batch.src, batch.tgt_in, src_mask=src_mask, tgt_mask=tgt_mask).logits
    for smoothing in (0.0, 0.1):
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(),
                                                     ignore_index=D.PAD, label_smoothing=smoothing)
        torch.testing.assert_close(D.loss(model, batch, smoothing), expected)


def test_predict_and_evaluate_use_the_library_decoders():
    from tutorial_lib.sampling import beam_search, greedy_decode
    from tutorial_lib.transformer import EncoderDecoder

    torch.manual_seed(1)
    model = EncoderDecoder(D.model_config(d_model=32, init_std=0.5)).eval()
    examples = D.held_out_examples(7)
    batch = D.make_batch(examples)
    src_mask = batch.masks()[0]
    special = dict(max_len=D.TARGET_LEN, bos_id=D.BOS, eos_id=D.EOS, pad_id=D.PAD)
    greedy = [D.decode_target(r) for r in greedy_decode(model, batch.src, src_mask, **special).ids]
    beam = [D.decode_target(r[0]) for r in beam_search(model, batch.src, src_mask, beam_width=3, **special).ids]
    sources = [e.source for e in examples]
    assert D.predict(model, sources, batch_size=3) == greedy
    assert D.predict(model, sources, beam_width=3) == beam
    assert D.evaluate(model, examples) == D.exact_match(greedy, [e.target for e in examples])
