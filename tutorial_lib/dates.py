"""The date task of notebook 05 (used again in 06a, 08 and 12): dates written the ways people
write them, mapped to ISO dates.

    "3rd of March 1998", "03/03/98", "March 3, 1998", "Tuesday, 3 March 1998"  ->  "1998-03-03"

A transduction task whose alignment is easy to see: the month name in the source becomes
the two month digits of the target, the day the day digits, and so on. Examples are made on
the fly; nothing is downloaded or stored.

Rules that keep every source string unambiguous (``tests/test_dates.py`` checks that no string
is produced by two different dates):

* Dates lie in 1950-01-01 .. 2049-12-31, exactly one hundred years, so a two-digit year has
  one reading: 50..99 -> 1950..1999 and 00..49 -> 2000..2049.
* The separator says the order of numeric dates: slashes are month first (US, "03/04/98" is
  4 March 1998), dots and dashes are day first ("04.03.1998", "04-03-1998"), and a four-digit
  year at the front is year-month-day ("1998.03.04", "1998/03/04", "19980304").

The held-out dates: a fixed hash of the day number puts about 10 % of the dates of the range
aside. Training batches are drawn from the other dates only, and every source string belongs
to one date, so no held-out source string ever occurs in training. :func:`held_out_examples`
is a fixed list drawn from the held-out dates.

The API (notebook 05 and the comparison of the three families in notebook 06a use it)::

    batch = train_batch(64, generator)            # DateBatch: src, tgt_in, tgt_out, keep flags
    examples = held_out_examples()                # 1,000 fixed DateExamples (source, target, ...)
    batch = make_batch(examples)                  # the same DateBatch for any examples
    SOURCE.encode("3 March 1998"), TARGET.decode(ids)   # the two character tokenizers
    model = EncoderDecoder(model_config())        # a config sized for the task
    loss(model, batch), evaluate(model, examples) # training loss; exact match of greedy answers

Both tokenizers put "<pad>", "<bos>", "<eos>" at ids 0, 1, 2 (PAD, BOS, EOS). Every target
character (digits and "-") is also a source character, so a decoder-only model can read the
source and the target with :data:`SOURCE` alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from datetime import date, timedelta
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .checks import check_count
from .config import ModelConfig
from .data import CharTokenizer, pad_sequences
from .sampling import beam_search, greedy_decode
from .train import label_smoothed_loss
from .transformer import seq2seq_masks

FIRST_DATE = date(1950, 1, 1)
LAST_DATE = date(2049, 12, 31)
HELD_OUT_PERCENT = 10
N_HELD_OUT = 1000
_HELD_OUT_SEED = 2017

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")  # date.weekday()


def ordinal(n: int) -> str:
    """1 -> "1st", 2 -> "2nd", 3 -> "3rd", 11 -> "11th", 22 -> "22nd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# Fields a format is made of: code -> (which part of the date it writes, how).
FIELDS: dict[str, tuple[str, Callable[[date], str]]] = {
    "d": ("day", lambda d: str(d.day)),                          # 3
    "dd": ("day", lambda d: f"{d.day:02d}"),                     # 03
    "do": ("day", lambda d: ordinal(d.day)),                     # 3rd
    "m": ("month", lambda d: str(d.month)),                      # 3
    "mm": ("month", lambda d: f"{d.month:02d}"),                 # 03
    "Month": ("month", lambda d: MONTHS[d.month - 1]),           # March
    "Mon": ("month", lambda d: MONTHS[d.month - 1][:3]),         # Mar
    "MONTH": ("month", lambda d: MONTHS[d.month - 1].upper()),   # MARCH
    "month": ("month", lambda d: MONTHS[d.month - 1].lower()),   # march
    "yy": ("year", lambda d: f"{d.year % 100:02d}"),             # 98
    "yyyy": ("year", lambda d: str(d.year)),                     # 1998
    "Weekday": ("weekday", lambda d: WEEKDAYS[d.weekday()]),     # Tuesday
    "Wkd": ("weekday", lambda d: WEEKDAYS[d.weekday()][:3]),     # Tue
}

# name -> template: {field} codes of FIELDS, the rest is written as it stands.
FORMATS: dict[str, str] = {
    "iso": "{yyyy}-{mm}-{dd}",                              # 1998-03-03
    "us_slash": "{m}/{d}/{yy}",                             # 3/3/98
    "us_slash_padded": "{mm}/{dd}/{yy}",                    # 03/03/98
    "us_slash_long": "{mm}/{dd}/{yyyy}",                    # 03/03/1998
    "eu_dots": "{dd}.{mm}.{yyyy}",                          # 03.03.1998
    "eu_dots_short": "{d}.{m}.{yy}",                        # 3.3.98
    "eu_dashes": "{dd}-{mm}-{yyyy}",                        # 03-03-1998
    "year_dots": "{yyyy}.{mm}.{dd}",                        # 1998.03.03
    "year_slash": "{yyyy}/{mm}/{dd}",                       # 1998/03/03
    "compact": "{yyyy}{mm}{dd}",                            # 19980303
    "day_month": "{d} {Month} {yyyy}",                      # 3 March 1998
    "day_mon": "{d} {Mon} {yyyy}",                          # 3 Mar 1998
    "day_mon_dashes": "{d}-{Mon}-{yy}",                     # 3-Mar-98
    "month_day": "{Month} {d}, {yyyy}",                     # March 3, 1998
    "mon_day": "{Mon} {d}, {yyyy}",                         # Mar 3, 1998
    "month_ordinal": "{Month} {do}, {yyyy}",                # March 3rd, 1998
    "ordinal_of": "{do} of {Month} {yyyy}",                 # 3rd of March 1998
    "the_ordinal_of": "the {do} of {Month}, {yyyy}",        # the 3rd of March, 1998
    "weekday_day_month": "{Weekday}, {d} {Month} {yyyy}",   # Tuesday, 3 March 1998
    "weekday_month_day": "{Weekday}, {Month} {d}, {yyyy}",  # Tuesday, March 3, 1998
    "wkd_day_mon": "{Wkd} {d} {Mon} {yyyy}",                # Tue 3 Mar 1998
    "upper": "{d} {MONTH} {yyyy}",                          # 3 MARCH 1998
    "lower_short_year": "{month} {d} {yy}",                 # march 3 98
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)


def _compile(template: str) -> list[tuple[str, str | None]]:
    """A template as pieces: (literal text, None) or (field code, its date part)."""
    pieces, at = [], 0
    for match in re.finditer(r"\{(\w+)\}", template):
        if match.start() > at:
            pieces.append((template[at : match.start()], None))
        pieces.append((match.group(1), FIELDS[match.group(1)][0]))
        at = match.end()
    if at < len(template):
        pieces.append((template[at:], None))
    return pieces


_COMPILED = {name: _compile(template) for name, template in FORMATS.items()}


def _pieces(d: date, fmt: str) -> list[tuple[str, str | None]]:
    """The written pieces of ``d`` in format ``fmt``: (text, date part, or None for literal text)."""
    if fmt not in FORMATS:
        raise ValueError(f"no date format named {fmt!r}; the formats are {list(FORMATS)}")
    if not FIRST_DATE <= d <= LAST_DATE:
        raise ValueError(f"dates of this task lie in {FIRST_DATE}..{LAST_DATE}, got {d}")
    return [(text, None) if part is None else (FIELDS[text][1](d), part) for text, part in _COMPILED[fmt]]


def format_date(d: date, fmt: str) -> str:
    """Write date ``d`` in the format named ``fmt`` (one of :data:`FORMAT_NAMES`)."""
    return "".join(text for text, _ in _pieces(d, fmt))


def field_spans(d: date, fmt: str) -> dict[str, tuple[int, int]]:
    """Where each part of the date sits in ``format_date(d, fmt)``: part ("year", "month",
    "day", "weekday") -> (start, end) character positions, end exclusive."""
    spans, at = {}, 0
    for text, part in _pieces(d, fmt):
        if part is not None:
            spans[part] = (at, at + len(text))
        at += len(text)
    return spans


# ---- tokenizers ----------------------------------------------------------------------------

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD, BOS, EOS = 0, 1, 2


def _source_characters() -> str:
    # Every format applied to a date in each month and on each weekday covers every character.
    days = [date(2001, month, 10 + month) for month in range(1, 13)]  # 11 Jan .. 22 Dec 2001
    days += [date(2001, 1, day) for day in range(1, 8)]  # 1..7 Jan 2001: Monday .. Sunday
    return "".join(format_date(d, f) for f in FORMAT_NAMES for d in days) + "0123456789"


SOURCE = CharTokenizer.from_text(_source_characters(), SPECIALS)
TARGET = CharTokenizer.from_text("0123456789-", SPECIALS)
TARGET_LEN = len("1998-03-03") + 1  # ten characters and EOS
MAX_SOURCE_LEN = len("Wednesday, September 30, 1998")  # the longest source string (a test checks it)


def encode_source(text: str) -> list[int]:
    """Source string -> ids (no specials)."""
    return SOURCE.encode(text)


def encode_target(text: str) -> list[int]:
    """ISO date string -> ids followed by EOS."""
    return TARGET.encode(text) + [EOS]


def decode_target(ids: Tensor | Sequence[int]) -> str:
    """Target ids -> string, stopping at the first EOS (BOS and PAD are dropped)."""
    ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    if EOS in ids:
        ids = ids[: ids.index(EOS)]
    return TARGET.decode(ids)


# ---- which dates are held out ----------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _mix(n: int) -> int:
    """A fixed 64-bit integer hash (SplitMix64's finaliser), the same on every machine."""
    z = (n + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def is_held_out(d: date) -> bool:
    """True for the ~10 % of dates that training never sees (decided by a hash of the day number)."""
    return _mix(d.toordinal()) % 100 < HELD_OUT_PERCENT


def all_dates() -> list[date]:
    """Every date of the task's range, in order."""
    return [FIRST_DATE + timedelta(days=i) for i in range((LAST_DATE - FIRST_DATE).days + 1)]


_ALL = all_dates()
TRAIN_DATES: tuple[date, ...] = tuple(d for d in _ALL if not is_held_out(d))
HELD_OUT_DATES: tuple[date, ...] = tuple(d for d in _ALL if is_held_out(d))


# ---- examples and batches ----------------------------------------------------------------------


class DateExample(NamedTuple):
    source: str  # e.g. "3rd of March 1998"
    target: str  # "1998-03-03"
    date: date
    format: str  # a name of FORMATS


def make_example(d: date, fmt: str) -> DateExample:
    return DateExample(format_date(d, fmt), d.isoformat(), d, fmt)


class DateBatch(NamedTuple):
    """A padded batch. The decoder reads ``tgt_in`` (BOS, then the target) and learns to predict
    ``tgt_out`` (the target, then EOS): the same sequence shifted by one position."""

    src: Tensor  # (B, S) source ids, PAD after each string
    tgt_in: Tensor  # (B, T) BOS + target ids (PAD after, for targets of unequal length)
    tgt_out: Tensor  # (B, T) target ids + EOS (PAD after; the loss ignores PAD)
    src_keep: Tensor  # (B, S) True at real source characters
    tgt_keep: Tensor  # (B, T) True at real decoder-input positions

    def masks(self) -> tuple[Tensor, Tensor]:
        """(src_mask (B, 1, 1, S), tgt_mask (B, 1, T, T)): source padding; causal AND target padding."""
        return seq2seq_masks(self.src_keep, self.tgt_keep)

    def to(self, device) -> DateBatch:
        return DateBatch(*(t.to(device) for t in self))


def make_batch(examples: Sequence[DateExample], device=None) -> DateBatch:
    """Encode and pad examples into a :class:`DateBatch`."""
    if not examples:
        raise ValueError("make_batch needs at least one example")
    src = pad_sequences([encode_source(e.source) for e in examples], PAD)  # (B, S)
    targets = [encode_target(e.target) for e in examples]  # each ends in EOS
    tgt_in = pad_sequences([[BOS] + t[:-1] for t in targets], PAD)  # (B, T): shifted right
    tgt_out = pad_sequences(targets, PAD)  # (B, T)
    lengths = torch.tensor([len(t) for t in targets])
    tgt_keep = torch.arange(tgt_in.size(1)) < lengths[:, None]  # (B, T)
    return DateBatch(src, tgt_in, tgt_out, src != PAD, tgt_keep).to(device)


def sample_examples(n: int, generator: torch.Generator, *, dates: Sequence[date] = TRAIN_DATES,
                    formats: Sequence[str] = FORMAT_NAMES) -> list[DateExample]:
    """``n`` examples with dates and formats drawn uniformly (with replacement) by ``generator``."""
    check_count("n", n)
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"no date format named {f!r}; the formats are {list(FORMATS)}")
    di = torch.randint(len(dates), (n,), generator=generator).tolist()
    fi = torch.randint(len(formats), (n,), generator=generator).tolist()
    return [make_example(dates[i], formats[j]) for i, j in zip(di, fi)]


def train_batch(batch_size: int, generator: torch.Generator, device=None) -> DateBatch:
    """A fresh batch of training examples: dates that are not held out, in random formats."""
    return make_batch(sample_examples(batch_size, generator), device)


def held_out_examples(n: int = N_HELD_OUT) -> list[DateExample]:
    """The fixed held-out set: ``n`` (at most 1,000) examples on held-out dates, the formats
    taken in turn so each is equally represented. The same list on every call and machine."""
    check_count("n", n, maximum=N_HELD_OUT, bound_name="N_HELD_OUT")
    rng = random.Random(_HELD_OUT_SEED)
    chosen = rng.sample(HELD_OUT_DATES, N_HELD_OUT)
    examples = [make_example(d, FORMAT_NAMES[i % len(FORMAT_NAMES)]) for i, d in enumerate(chosen)]
    return examples[:n]


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of predictions equal to their target, character for character."""
    if len(predictions) != len(targets):
        raise ValueError(f"got {len(predictions)} predictions for {len(targets)} targets")
    if not targets:
        raise ValueError("exact_match needs at least one target")
    return sum(p == t for p, t in zip(predictions, targets)) / len(targets)


# ---- a model for the task: its config, its loss, its answers -------------------------------------


def model_config(**changes) -> ModelConfig:
    """An encoder-decoder config sized for the task (vocabularies from the two tokenizers,
    positions enough for the longest source); ``changes`` replace any field."""
    base = dict(family="encoder-decoder", vocab_size=TARGET.vocab_size, src_vocab_size=SOURCE.vocab_size,
                d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=MAX_SOURCE_LEN + 1, norm_order="pre",
                ffn="relu", positions="sinusoidal", tie_embeddings=True, dropout=0.0)
    return ModelConfig(**(base | changes))


def loss(model: nn.Module, batch: DateBatch, smoothing: float = 0.0) -> Tensor:
    """Label-smoothed cross-entropy of a teacher-forced pass, PAD targets ignored."""
    src_mask, tgt_mask = batch.masks()
    logits = model(batch.src, batch.tgt_in, src_mask=src_mask, tgt_mask=tgt_mask).logits  # (B, T, V)
    return label_smoothed_loss(logits, batch.tgt_out, smoothing, ignore_index=PAD)


@torch.no_grad()
def predict(model: nn.Module, sources: Sequence[str], *, beam_width: int = 1, batch_size: int = 500,
            **beam_options) -> list[str]:
    """The model's ISO date for each source string: greedy decoding (``beam_width=1``) or beam
    search (``beam_options``: length_penalty_alpha, coverage_beta)."""
    if isinstance(sources, str) or not all(isinstance(s, str) for s in sources):
        raise ValueError(f"sources must be a list of strings, e.g. ['3 March 1998'], got {sources!r:.60}")
    check_count("batch_size", batch_size)
    device = next(model.parameters()).device
    answers = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start : start + batch_size]
        src = pad_sequences([encode_source(s) for s in chunk], PAD).to(device)  # (B, S)
        src_mask = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)
        special = dict(max_len=TARGET_LEN, bos_id=BOS, eos_id=EOS, pad_id=PAD)
        if beam_width == 1 and not beam_options:
            ids = greedy_decode(model, src, src_mask, **special).ids  # (B, L)
        else:
            ids = beam_search(model, src, src_mask, beam_width=beam_width, **special, **beam_options).ids[:, 0]
        answers += [decode_target(row) for row in ids.cpu()]
    return answers


def evaluate(model: nn.Module, examples: Sequence[DateExample], **decoding) -> float:
    """Exact match of the model's answers (see :func:`predict`) on ``examples``."""
    return exact_match(predict(model, [e.source for e in examples], **decoding), [e.target for e in examples])


# ---- alignment: does the model read the right part of the source? ------------------------------

# The decoder position that predicts each part of "1998-03-03": position t predicts character t.
TARGET_FIELDS: dict[str, tuple[int, int]] = {"year": (0, 4), "month": (5, 7), "day": (8, 10)}


def field_alignment(cross_weights: Tensor, examples: Sequence[DateExample]) -> Tensor:
    """How much cross-attention each head puts on the matching part of the source.

    ``cross_weights``: (L, B, h, T, S) from a teacher-forced pass over ``make_batch(examples)``.
    Returns (L, h, 3): for the year, month and day (in that order), the attention weight that
    the positions predicting that part of the target put on the source characters of the
    same part, averaged over those positions and the examples. 1 means a head looks only
    there; a head spreading evenly over a source of n characters scores (span length) / n.
    """
    if cross_weights.dim() != 5 or cross_weights.size(1) != len(examples):
        raise ValueError(f"expected cross-attention weights (L, B={len(examples)}, h, T, S), "
                         f"got shape {tuple(cross_weights.shape)}")
    S = cross_weights.size(-1)
    scores = []
    for field, (first, last) in TARGET_FIELDS.items():
        span = torch.zeros(len(examples), S, device=cross_weights.device)  # (B, S)
        for b, e in enumerate(examples):
            start, end = field_spans(e.date, e.format)[field]
            span[b, start:end] = 1.0
        queries = cross_weights[:, :, :, first:last, :]  # (L, B, h, q, S)
        mass = (queries * span[None, :, None, None, :]).sum(dim=-1)  # (L, B, h, q)
        scores.append(mass.mean(dim=(1, 3)))  # (L, h)
    return torch.stack(scores, dim=-1)  # (L, h, 3)
