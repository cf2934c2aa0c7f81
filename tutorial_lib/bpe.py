"""Byte-level byte-pair encoding (BPE), the tokenizer of GPT-2, GPT-4, Llama 3 and Qwen2: the
algorithm. Its file formats (GPT-2's files, ``tokenizer.json``, tiktoken's rank files, GGUF
metadata) live in :mod:`tutorial_lib.tokenizer_files`; chat templates in :mod:`tutorial_lib.chat`.

Text becomes ids in three steps:

1. **Pre-tokenisation.** A regular expression cuts the text into *pieces*: words with their
   leading space, runs of digits, runs of punctuation, runs of whitespace. No token ever
   crosses a piece's border, so " dog" and " dog." share the token for " dog".
2. **Bytes.** Each piece becomes its UTF-8 bytes; the 256 byte values are the first tokens,
   so any string can be encoded and nothing is ever "unknown".
3. **Merges.** Adjacent tokens of a piece are merged pairwise, best pair first, until no
   pair of the piece can be merged. Which pair is best is said in one of two ways:

   * a **merge list** (GPT-2's ``merges.txt``, a Hugging Face ``tokenizer.json``, and
     :func:`train_bpe` here): the pair whose merge was learned earliest goes first;
   * a **rank table** (tiktoken's ``*.tiktoken`` files, OpenAI's own format): every token
     has a rank (its id); the pair whose concatenation has the lowest rank goes first, and a
     piece that is itself a token is taken whole.

Ties (the same best pair twice in a piece) go to the leftmost. Decoding joins the tokens'
bytes and decodes them as UTF-8, replacing invalid sequences by U+FFFD as GPT-2 does.

Training (:func:`train_bpe`) starts from the 256 bytes and repeatedly merges the most
frequent adjacent pair of the training text's pieces. The special tokens (documents joined
with ``<|endoftext|>``) are cut out of the training text first, so no merge reaches into or
across them. **Tie-break rule:** among pairs of equal count, the pair whose (left id, right id)
is smallest wins, where the 256 byte tokens have the ids of GPT-2's byte order
(:func:`byte_order`: the printable bytes ``!`` .. ``~``, ``¡`` .. ``¬``, ``®`` .. ``ÿ`` first,
then the rest) and each merged token the next id. This is the rule of Hugging Face's
``tokenizers`` BPE trainer, so both learn the same merges.
"""

from __future__ import annotations

import heapq
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import regex

from .chat import render_chat
from .checks import check_count, check_int

# ---- pre-tokenisation patterns ------------------------------------------------------------------
# GPT-2's (Radford et al., 2019; openai/gpt-2 src/encoder.py): contractions, letters, numbers and
# other symbols each with an optional leading space; a run of spaces keeps its last space for
# the word that follows it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# cl100k_base (GPT-3.5/GPT-4) and o200k_base (GPT-4o), as published in tiktoken
# (tiktoken_ext/openai_public.py): numbers in groups of at most three digits, case-insensitive
# contractions, a newline kept apart from the spaces before a word; o200k also splits
# CamelCase words.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Hugging Face's Digits pre-tokenizer: every digit a piece (individual_digits), or every run of them
DIGIT_PATTERN, DIGITS_PATTERN = r"\p{N}", r"\p{N}+"

ENDOFTEXT = "<|endoftext|>"

_CACHE_LIMIT = 200_000  # pieces remembered by one tokenizer before its cache starts afresh


# ---- GPT-2's byte order -------------------------------------------------------------------------


def printable_bytes() -> list[int]:
    """The 188 bytes that GPT-2 counts as printable: ``!`` .. ``~``, ``¡`` .. ``¬``, ``®`` .. ``ÿ``."""
    return [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def byte_order() -> list[int]:
    """The 256 byte values in GPT-2's order: the printable ones first, then the rest. GPT-2's
    ids 0-255, cl100k_base's ranks 0-255 and the byte ids of :func:`train_bpe` follow it."""
    printable = printable_bytes()
    seen = set(printable)
    return printable + [b for b in range(256) if b not in seen]


# ---- pre-tokenisation ---------------------------------------------------------------------------


def _split_keeping_gaps(pattern: regex.Pattern, text: str) -> list[str]:
    """The pattern's matches, and the text between them as pieces of their own (so nothing is lost)."""
    pieces = pattern.findall(text)
    if sum(map(len, pieces)) == len(text):
        return pieces  # the usual case: the pattern covers every character
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            pieces.append(text[start:match.start()])
        if match.end() > match.start():
            pieces.append(match.group())
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


# Where a text can be cut without changing its pieces, whatever follows (encode_iterable). For the
# patterns below, at a position b where
#   (a) a character that is not whitespace is followed by a space (" "), or
#   (b) a character that is not whitespace is followed by one "\n" and then a letter or a digit,
# no piece spans b (no alternative holds a non-space followed by a space, or a "\n" followed by a
# letter or digit), and the pieces before b do not depend on what comes after b: the alternatives
# that reach b stop there whether the text goes on with the space (or the letter) or ends, and
# the look-aheads that see b, (?!\S) and cl100k's $, decide the same piece either way ("\n" alone).
# A longer run of whitespace is not a place to cut: GPT-2's pattern gives "\n\n" one piece at the
# end of a text but two before a word. Whitespace is what the patterns call whitespace, regex's \s.
_CUT_SAFE_PATTERNS = frozenset({GPT2_PATTERN, CL100K_PATTERN, O200K_PATTERN, DIGIT_PATTERN, DIGITS_PATTERN})
_CUT = regex.compile(r"(?<=\S)(?= )|(?<=\S\n)(?=[\p{L}\p{N}])")
# Unicode normalization can be cut before an ASCII character: no normal form joins one to the
# character before it, or moves a combining mark across it.
_ASCII = regex.compile(r"[\x00-\x7f]")


class Merge(NamedTuple):
    """One merge learned by :func:`learn_merges`: the pair of tokens (as bytes) and how often
    the pair occurred in the training pieces when it was merged."""

    pair: tuple[bytes, bytes]
    count: int


class BPETokenizer:
    """A byte-level BPE tokenizer: ``encode(text) -> ids`` and ``decode(ids) -> text``.

    vocab: token bytes -> id. It should hold all 256 single bytes; a vocabulary that lacks some
    (SmolLM2's has no token for 21 of them) loads, and such a byte is encoded as Hugging Face's
    ``tokenizers`` and llama.cpp encode it: dropped (``unknown_id=None``: the bytes on either
    side of it become neighbours), or as the id ``unknown_id``, one per byte (``fuse_unknown``:
    one for a run of them). merges: the merge list,
    in the order learned (each merged token must be in ``vocab``); ``None`` for a rank table,
    where a pair's rank is the id of its concatenation. patterns: the pre-tokenisation
    regular expressions, applied one after the other, each cutting every piece further (text
    between matches stays a piece of its own). special_tokens: strings (such as
    ``<|endoftext|>``) that map to one id and are never split; text becomes one of them only
    where the caller names it (``encode(text, allowed_special=...)``), so a user who types
    ``<|im_end|>`` types text, not the end of a turn. whole_pieces: look a whole
    piece up in the vocabulary before merging (tiktoken does; so does Llama 3's tokenizer.json
    with ``ignore_merges``); default: True for a rank table, False for a merge list.
    normalization: a Unicode normal form applied to ordinary text first ("NFC" for Qwen2).
    prefix_space: add a space before text that does not start with one (GPT-2's
    ``add_prefix_space`` option; decode then returns the space too). bos_id, eos_id: the ids
    that begin and end a document (or a turn); add_bos: whether the model expects ``bos_id``
    before a prompt (:meth:`apply_chat_template` adds it then; :meth:`encode` never does).
    chat_template: the Jinja template of a chat model (:meth:`apply_chat_template`).

    Pieces already seen are remembered (a word cache), so a long text with a few thousand
    distinct words costs a few thousand merge loops. A tokenizer comes from a model's files
    through :mod:`tutorial_lib.tokenizer_files` (``load_tokenizer(folder)``), or from
    :func:`train_bpe`.
    """

    def __init__(self, vocab: dict[bytes, int], *, merges: Sequence[tuple[bytes, bytes]] | None = None,
                 patterns: str | Sequence[str] = GPT2_PATTERN, special_tokens: dict[str, int] | None = None,
                 whole_pieces: bool | None = None, normalization: str | None = None,
                 prefix_space: bool = False, name: str = "bpe", unknown_id: int | None = None,
                 fuse_unknown: bool = False, bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        if not isinstance(vocab, dict) or not vocab:
            raise ValueError("vocab must be a non-empty dict of token bytes -> id")
        # bytes with no token of their own: dropped, or unknown_id (see the class docstring)
        self.missing_bytes = frozenset(b for b in range(256) if bytes([b]) not in vocab)
        for token, i in vocab.items():
            if not isinstance(token, bytes):
                raise ValueError(f"vocab must map token bytes to ids, got the key {token!r} of type "
                                 f"{type(token).__name__}")
            check_count(f"vocab[{token!r}]", i, 0, why="a token id")
        if normalization not in (None, "NFC", "NFD", "NFKC", "NFKD"):
            raise ValueError(f"normalization must be None, 'NFC', 'NFD', 'NFKC' or 'NFKD', got {normalization!r}")
        self.name = name
        self.vocab = dict(vocab)
        self.special_tokens = dict(special_tokens or {})
        self.patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        self._compiled = [regex.compile(p) for p in self.patterns]
        if any(c.groups for c in self._compiled):
            raise ValueError("pre-tokenisation patterns must not hold capturing groups; write (?:...) instead")
        self.normalization = normalization
        self.prefix_space = prefix_space
        self.merges = None if merges is None else [tuple(m) for m in merges]
        self.whole_pieces = self.merges is None if whole_pieces is None else whole_pieces
        self._merge_rank: dict[tuple[bytes, bytes], int] | None = None
        if self.merges is not None:
            self._merge_rank = {}
            for rank, (left, right) in enumerate(self.merges):
                if left + right not in self.vocab:
                    raise ValueError(f"merge {rank} ({left!r}, {right!r}) makes {left + right!r}, "
                                     "which is not in the vocab")
                self._merge_rank.setdefault((left, right), rank)  # a repeated merge keeps its first rank
        self._bytes_of: dict[int, bytes] = {i: t for t, i in self.vocab.items()}
        for text, i in self.special_tokens.items():
            if not isinstance(text, str) or not text:
                raise ValueError(f"special_tokens must map non-empty strings to ids, got the key {text!r}")
            check_count(f"special_tokens[{text!r}]", i, 0, why="a token id")
            if i in self._bytes_of and self._bytes_of[i] != text.encode("utf-8"):
                raise ValueError(f"special token {text!r} has id {i}, which the vocab gives to "
                                 f"{self._bytes_of[i]!r}")
            self._bytes_of[i] = text.encode("utf-8")
        self._special_id = {i: t for t, i in self.special_tokens.items()}
        for what, i in (("unknown_id", unknown_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            known = check_int(what, i, why="an id of this tokenizer", optional=True) in self._bytes_of
            if i is not None and not known:
                raise ValueError(f"{what} must be an id of this tokenizer or None, got {i!r}")
        self.unknown_id, self.fuse_unknown = unknown_id, bool(fuse_unknown)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a Jinja template string or None, "
                             f"got {type(chat_template).__name__}")
        self.chat_template = chat_template
        # longest first, so that a special token that contains another one wins
        alternatives = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = regex.compile("|".join(map(regex.escape, alternatives))) if alternatives else None
        self._cache: dict[str, tuple[int, ...]] = {}

    # ---- sizes and lookups ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """One more than the largest id (ids in between may be unused, as in cl100k_base)."""
        return max(self._bytes_of) + 1

    def token_bytes(self, i: int) -> bytes:
        self._check_id(i)
        return self._bytes_of[i]

    def special_id(self, token: str) -> int:
        if token not in self.special_tokens:
            raise ValueError(f"{token!r} is not a special token of this tokenizer; "
                             f"it has {sorted(self.special_tokens)}")
        return self.special_tokens[token]

    def clear_cache(self) -> None:
        """Forget the pieces seen so far (for timing a cold start)."""
        self._cache.clear()

    def __repr__(self) -> str:
        kind = "rank table" if self.merges is None else f"{len(self.merges)} merges"
        return f"BPETokenizer({self.name!r}, vocab_size={self.vocab_size}, {kind}, {len(self.special_tokens)} special)"

    # ---- encoding ---------------------------------------------------------------------------
    def pieces(self, text: str) -> list[str]:
        """Pre-tokenisation of ordinary text (no special tokens): the pieces BPE merges within."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if self.normalization is not None:
            text = unicodedata.normalize(self.normalization, text)
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text
        return self._split(text)

    def _split(self, text: str) -> list[str]:
        """The patterns alone, one after the other, on text already normalized."""
        pieces = [text] if text else []
        for pattern in self._compiled:
            pieces = [p for piece in pieces for p in _split_keeping_gaps(pattern, piece)]
        return pieces

    def encode(self, text: str, *, allowed_special: Iterable[str] | str = ()) -> list[int]:
        """Text -> ids. Special tokens' texts are ordinary text (``<|endoftext|>`` becomes the
        tokens for ``<``, ``|``, ...) unless named in ``allowed_special``: those become their ids
        (``"all"`` names every one). tiktoken's rule: text from a user never turns into a control
        token unless the program asked for that token."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        allowed = self._allowed_special(allowed_special)
        if not allowed:
            return self._encode_ordinary(text)
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            if match.group() not in allowed:
                continue
            ids += self._encode_ordinary(text[start:match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        return ids + self._encode_ordinary(text[start:])

    def encode_iterable(self, lines: Iterable[str], *,
                        allowed_special: Iterable[str] | str = ()) -> Iterator[int]:
        """The ids of ``"".join(lines)``, exactly those of :meth:`encode` on the whole text, yielded
        as the lines come: a large file (``open(path)`` yields its lines) is encoded piece by piece
        without holding it. ``allowed_special`` as in :meth:`encode`.

        The lines are cut where no piece can cross, whatever text follows: before a space that
        follows a character that is not whitespace, and after a single "\\n" that such a character
        precedes and a letter or digit follows. Between two such places the text waits, so what is
        held is the text since the last one (and a special token's length, or the text since the
        last ASCII character under a Unicode normalization). A place that merely looks like a piece's
        border is not enough: a run of spaces or line breaks, a special token or a normalized
        character can go on in the next line. These places hold for the patterns of this module
        (GPT-2's, cl100k's, o200k's, Hugging Face's Digits: the reasoning is at ``_CUT``, and the
        tests cut random texts at random places); a tokenizer with any other pattern is refused.
        """
        if isinstance(lines, (str, bytes)) or not isinstance(lines, Iterable):
            raise ValueError(f"lines must be an iterable of strings (a file opened in text mode, a list), got "
                             f"{type(lines).__name__}; for one string use encode(text)")
        allowed = self._allowed_special(allowed_special)
        unknown = [p for p in self.patterns if p not in _CUT_SAFE_PATTERNS]
        if unknown or not self.patterns:
            what = f"the pattern {unknown[0]!r:.80}" if unknown else "no pre-tokenisation pattern (one piece)"
            raise ValueError(f"{self.name} has {what}; encode_iterable cuts text only where pieces are known not "
                             "to cross, which is shown for GPT2_PATTERN, CL100K_PATTERN, O200K_PATTERN and the "
                             "Digits patterns. Use encode on the whole text")
        return self._encode_stream(lines, allowed)

    def _encode_stream(self, lines: Iterable[str], allowed: frozenset[str]) -> Iterator[int]:
        ordinary = _OrdinaryText(self)
        longest = max(map(len, self.special_tokens), default=1)  # encode looks for all of them
        pending = ""  # text in which a special token may still begin
        for k, line in enumerate(lines):
            if not isinstance(line, str):
                raise ValueError(f"lines must hold strings, got {type(line).__name__} at line {k}"
                                 + (" (open the file in text mode)" if isinstance(line, bytes) else ""))
            if not allowed:
                yield from ordinary.add(line)
                continue
            pending += line
            # a special token that starts before `limit` lies whole in `pending`, so it is the one
            # that encode finds there (the longest first), and where none starts before `limit`,
            # none will: the text up to `limit` is settled
            limit = len(pending) - longest + 1
            start = 0
            for match in self._special_re.finditer(pending):
                if match.start() >= limit:
                    break
                yield from self._special_or_text(ordinary, pending[start:match.start()], match.group(), allowed)
                start = match.end()
            keep = max(start, limit)
            yield from ordinary.add(pending[start:keep])
            pending = pending[keep:]
        if pending:
            start = 0
            for match in self._special_re.finditer(pending):
                yield from self._special_or_text(ordinary, pending[start:match.start()], match.group(), allowed)
                start = match.end()
            yield from ordinary.add(pending[start:])
        yield from ordinary.end()

    def _special_or_text(self, ordinary: _OrdinaryText, before: str, special: str,
                         allowed: frozenset[str]) -> Iterator[int]:
        """The text before a special token's match, then the match: its id when allowed (which
        ends the ordinary text, as in encode), otherwise more text."""
        if special in allowed:
            yield from ordinary.add(before)
            yield from ordinary.end()
            yield self.special_tokens[special]
        else:
            yield from ordinary.add(before + special)

    def _allowed_special(self, allowed_special) -> frozenset[str]:
        if allowed_special == "all":
            return frozenset(self.special_tokens)
        if isinstance(allowed_special, str) or not isinstance(allowed_special, Iterable):
            raise ValueError(f"allowed_special must be 'all' or a collection of special tokens, "
                             f"got {allowed_special!r}")
        allowed = frozenset(allowed_special)
        unknown = sorted(allowed - set(self.special_tokens))
        if unknown:
            raise ValueError(f"allowed_special names {unknown}, which are not special tokens of this tokenizer; "
                             f"it has {sorted(self.special_tokens)}")
        return allowed

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._encode_pieces(self.pieces(text))

    def _encode_pieces(self, pieces: Iterable[str]) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for piece in pieces:
            cached = cache.get(piece)
            if cached is None:
                try:
                    data = piece.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise ValueError(f"text holds {piece[err.start]!r} (a lone surrogate), which has no UTF-8 "
                                     "encoding; only valid Unicode text can be encoded") from None
                cached = tuple(self.merge_piece(data))
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[piece] = cached
            ids += cached
        return ids

    def merge_piece(self, data: bytes) -> list[int]:
        """The ids of one piece's bytes after merging: the best pair first (lowest merge
        rank, or lowest rank of the concatenation for a rank table), the leftmost of equals."""
        vocab = self.vocab
        if self.missing_bytes and not self.missing_bytes.isdisjoint(data):
            return self._merge_with_missing(data)
        if len(data) == 1 or (self.whole_pieces and data in vocab):
            return [vocab[data]]
        return self._merge_parts([data[i:i + 1] for i in range(len(data))])

    def _merge_with_missing(self, data: bytes) -> list[int]:
        """A piece holding bytes that have no token. Dropped (unknown_id None): the other bytes
        merge as if they were neighbours, as in ``tokenizers``. Otherwise each becomes
        unknown_id (a run of them one, with fuse_unknown), and no merge crosses it."""
        if self.unknown_id is None:
            known = [data[i:i + 1] for i in range(len(data)) if data[i] not in self.missing_bytes]
            return self._merge_parts(known) if known else []
        ids: list[int] = []
        run: list[bytes] = []
        for i in range(len(data)):
            if data[i] in self.missing_bytes:
                if run:
                    ids += self._merge_parts(run)
                    run = []
                if not (self.fuse_unknown and ids and ids[-1] == self.unknown_id):
                    ids.append(self.unknown_id)
            else:
                run.append(data[i:i + 1])
        return ids + (self._merge_parts(run) if run else [])

    def _merge_parts(self, parts: list[bytes]) -> list[int]:
        """Merge a list of tokens (as bytes), best pair first: their ids."""
        vocab = self.vocab
        if len(parts) == 1:
            return [vocab[parts[0]]]
        if self._merge_rank is not None:
            merge_rank = self._merge_rank
            rank_of = lambda a, b: merge_rank.get((a, b))  # noqa: E731
        else:
            rank_of = lambda a, b: vocab.get(a + b)  # noqa: E731
        missing = float("inf")
        ranks = [rank_of(a, b) for a, b in zip(parts, parts[1:])]
        ranks = [missing if r is None else r for r in ranks]
        while ranks:
            best = min(ranks)
            if best == missing:
                break
            i = ranks.index(best)  # the leftmost of equals
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            del ranks[i]
            # only the pairs next to the merged token changed
            if i > 0:
                r = rank_of(parts[i - 1], parts[i])
                ranks[i - 1] = missing if r is None else r
            if i < len(ranks):
                r = rank_of(parts[i], parts[i + 1])
                ranks[i] = missing if r is None else r
        return [vocab[p] for p in parts]

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """The ids of a conversation laid out by the model's chat template.

        messages: ``[{"role": "user", "content": "..."}, ...]``. The template (Jinja, from the
        model's files) is rendered to text as ``transformers`` renders it; then the special
        tokens the *template* wrote (``<|im_start|>``, ``<|im_end|>``) become their ids, and
        everything inside a message's content is ordinary text, special-looking or not.
        ``add_generation_prompt`` ends with the opening of the assistant's turn.
        """
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template (a base model, or files without one)")
        text, spans = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                  bos_token=self._special_id.get(self.bos_id, ""),
                                  eos_token=self._special_id.get(self.eos_id, ""))
        ids, start = [], 0
        for match in (self._special_re.finditer(text) if self._special_re is not None else ()):
            if any(a < match.end() and match.start() < b for a, b in spans):
                continue  # inside a message: text
            ids += self._encode_ordinary(text[start:match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids += self._encode_ordinary(text[start:])
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    # ---- decoding ---------------------------------------------------------------------------
    def _check_id(self, i) -> None:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise ValueError(f"ids must be ints, got {i!r}")
        if i not in self._bytes_of:
            raise ValueError(f"id {i} is not a token of this tokenizer (vocab_size {self.vocab_size})")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        parts = []
        for i in ids:
            self._check_id(i)
            parts.append(self._bytes_of[int(i)])
        return b"".join(parts)

    def decode(self, ids: Iterable[int], *, errors: str = "replace") -> str:
        """Ids -> text. Invalid UTF-8 (a cut multi-byte character) becomes U+FFFD, as in GPT-2."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)


def _last_start(pattern: regex.Pattern, text: str, pos: int) -> int:
    """Where the last match of ``pattern`` at or after ``pos`` starts; 0 when there is none
    (cutting at 0 would cut nothing off)."""
    last = 0
    for match in pattern.finditer(text, max(pos, 0)):
        last = match.start()
    return last


class _OrdinaryText:
    """The ordinary text between two allowed special tokens, arriving in parts
    (:meth:`BPETokenizer.encode_iterable`): its ids are those of the whole stretch, because it
    is normalized only up to an ASCII character and split only at a cut of ``_CUT``."""

    def __init__(self, tokenizer: BPETokenizer):
        self.tokenizer = tokenizer
        self.raw = ""  # not normalized yet: the next character may still join its end
        self.text = ""  # normalized, not split yet: its last piece may still go on
        self.started = False  # whether this stretch has had text (a prefix space goes before the first)

    def add(self, part: str) -> Iterator[int]:
        normalization = self.tokenizer.normalization
        if normalization is not None and part:
            self.raw += part
            cut = _last_start(_ASCII, self.raw, len(self.raw) - len(part))
            if not cut:
                return
            part, self.raw = unicodedata.normalize(normalization, self.raw[:cut]), self.raw[cut:]
        yield from self._split_off(part, final=False)

    def end(self) -> Iterator[int]:
        """The stretch is over (a special token, or the end of the lines): the rest, all of it."""
        normalization, rest = self.tokenizer.normalization, self.raw
        if normalization is not None and rest:
            rest = unicodedata.normalize(normalization, rest)
        self.raw = ""
        yield from self._split_off(rest, final=True)
        self.started = False

    def _split_off(self, part: str, *, final: bool) -> Iterator[int]:
        tokenizer = self.tokenizer
        if part and not self.started:
            self.started = True
            if tokenizer.prefix_space and not part.startswith(" "):
                part = " " + part
        new = len(self.text)  # a cut is new where the character after it is
        self.text += part
        cut = len(self.text) if final else _last_start(_CUT, self.text, new)
        if not cut:
            return
        done, self.text = self.text[:cut], self.text[cut:]
        yield from tokenizer._encode_pieces(tokenizer._split(done))


# ---- training -----------------------------------------------------------------------------------------


def count_pieces(text: str, pattern: str = GPT2_PATTERN, *, special_tokens: Sequence[str] = ()) -> Counter:
    """How often each piece (as bytes) occurs in ``text`` after pre-tokenisation. The texts of
    ``special_tokens`` are cut out first: documents joined with ``<|endoftext|>`` give the pieces
    of each document, and none of ``<|``, ``endoftext``, ``|>``."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if isinstance(special_tokens, str) or not all(isinstance(t, str) and t for t in special_tokens):
        raise ValueError(f"special_tokens must be a list of non-empty strings, got {special_tokens!r:.80}")
    compiled = regex.compile(pattern)
    parts = [text]
    if special_tokens:  # longest first, as encoding finds them
        alternatives = sorted(special_tokens, key=len, reverse=True)
        parts = regex.split("|".join(map(regex.escape, alternatives)), text)
    return Counter(piece.encode("utf-8") for part in parts for piece in _split_keeping_gaps(compiled, part))


def _pairs(word: list[int]) -> Counter:
    return Counter(zip(word, word[1:]))


def merge_pair(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """A new list: ``ids`` with every occurrence of ``pair`` replaced by ``new_id``, left to
    right, without overlaps: (a, a) in [a, a, a] gives [new, a]. ``ids`` is left unchanged."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"ids must be a list of ints, got {type(ids).__name__}")
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise ValueError(f"pair must be two ids (left, right), got {pair!r}")
    return _merge_pair(ids, pair, new_id)


def _merge_pair(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """merge_pair without the checks, for the trainer's inner loop."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def learn_merges(piece_counts: dict[bytes, int], n_merges: int) -> list[Merge]:
    """Up to ``n_merges`` merges learned from piece counts: each time the most frequent
    adjacent pair (counted over all pieces, weighted by their counts; overlapping pairs such as
    the two (a, a) in "aaa" both count) is merged everywhere. Ties go to the smallest
    (left id, right id) in the order of the module docstring. Stops early when no pair is left."""
    check_count("n_merges", n_merges, 0)
    if not isinstance(piece_counts, Mapping):
        raise ValueError(f"piece_counts must be a dict of piece (bytes) -> count, got {type(piece_counts).__name__}")
    for piece, n in piece_counts.items():
        if not isinstance(piece, bytes) or not piece:
            hint = f" (encode it: {piece!r}.encode())" if isinstance(piece, str) else ""
            raise ValueError(f"piece_counts keys must be non-empty bytes, got {piece!r}{hint}")
        check_count(f"piece_counts[{piece!r}]", n, why="how often the piece occurs")
    token_of = [bytes([b]) for b in byte_order()]  # id -> token bytes
    id_of = {t: i for i, t in enumerate(token_of)}
    words = [[id_of[piece[j:j + 1]] for j in range(len(piece))] for piece in piece_counts]
    counts = list(piece_counts.values())
    pair_counts: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}  # pair -> the words that hold it
    for w, word in enumerate(words):
        for pair, n in _pairs(word).items():
            pair_counts[pair] += n * counts[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-n, pair) for pair, n in pair_counts.items()]  # most frequent first, then smallest ids
    heapq.heapify(heap)
    merges: list[Merge] = []
    while len(merges) < n_merges and heap:
        negative, pair = heapq.heappop(heap)
        current = pair_counts.get(pair, 0)
        if -negative != current:  # a stale entry: the count went down since it was pushed
            if current > 0:
                heapq.heappush(heap, (-current, pair))
            continue
        new_token = token_of[pair[0]] + token_of[pair[1]]
        new_id = id_of.get(new_token)
        if new_id is None:
            new_id = id_of[new_token] = len(token_of)
            token_of.append(new_token)
        merges.append(Merge((token_of[pair[0]], token_of[pair[1]]), current))
        grown = set()
        for w in where.pop(pair):
            before = _pairs(words[w])
            words[w] = _merge_pair(words[w], pair, new_id)
            after = _pairs(words[w])
            for p in before.keys() | after.keys():
                change = (after.get(p, 0) - before.get(p, 0)) * counts[w]
                if change:
                    pair_counts[p] += change
                    if change > 0:
                        grown.add(p)
                if p in after and p != pair:
                    where.setdefault(p, set()).add(w)
        del pair_counts[pair]
        for p in grown:
            heapq.heappush(heap, (-pair_counts[p], p))
    return merges


def train_bpe(text: str, vocab_size: int, *, pattern: str = GPT2_PATTERN,
              special_tokens: Sequence[str] = (ENDOFTEXT,)) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``text`` with ``vocab_size`` tokens in all: the 256
    bytes (ids 0-255 in GPT-2's byte order), ``vocab_size - 256 - len(special_tokens)`` merges
    (ids 256, 257, ... in the order learned), then the special tokens. Fewer merges when the
    text runs out of pairs. The special tokens' texts in ``text`` separate documents: they are
    cut out before counting (:func:`count_pieces`), so no merge learns from them or across them,
    and training on documents joined with ``<|endoftext|>`` learns what the documents hold."""
    n_special = len(special_tokens)
    check_count("vocab_size", vocab_size, 256 + n_special, why=f"256 byte tokens + {n_special} special tokens")
    if len(set(special_tokens)) != n_special:
        raise ValueError(f"special_tokens must be distinct, got {special_tokens}")
    merges = learn_merges(count_pieces(text, pattern, special_tokens=special_tokens), vocab_size - 256 - n_special)
    vocab = {bytes([b]): i for i, b in enumerate(byte_order())}
    for merge in merges:
        vocab.setdefault(merge.pair[0] + merge.pair[1], len(vocab))
    specials = {token: len(vocab) + k for k, token in enumerate(special_tokens)}
    return BPETokenizer(vocab, merges=[m.pair for m in merges], patterns=pattern, special_tokens=specials,
                        name=f"trained-{vocab_size}")
