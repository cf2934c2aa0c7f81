"""Text data that needs no download: a character tokenizer, the built-in corpus, train and
validation splits, random language-model batches, evaluation windows, and padded batches of
sequences."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .checks import check_count, check_int, check_number


@dataclass(frozen=True)
class CharTokenizer:
    """One id per character. ``specials`` (e.g. "<pad>", "<bos>", "<eos>") come first, with ids
    0, 1, 2, ...; then the characters in sorted order."""

    chars: tuple[str, ...]
    specials: tuple[str, ...] = ()

    @classmethod
    def from_text(cls, text: str | Iterable[str], specials: Sequence[str] = ()) -> CharTokenizer:
        if not isinstance(text, str):
            text = list(text) if isinstance(text, Iterable) else text
            if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
                raise ValueError(f"text must be a string or strings, got {type(text).__name__}")
            text = "".join(text)
        if not text:
            raise ValueError("text is empty: a character tokenizer needs at least one character")
        if isinstance(specials, str):
            raise ValueError(f"specials must be a sequence of strings, e.g. ('<pad>',), got the string {specials!r}")
        return cls(tuple(sorted(set(text))), tuple(specials))

    def __post_init__(self) -> None:
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise ValueError("chars must be distinct single characters")
        if len(set(self.specials)) != len(self.specials):
            raise ValueError(f"specials must be distinct, got {self.specials}")
        object.__setattr__(self, "_index", {c: i + len(self.specials) for i, c in enumerate(self.chars)})

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.chars)

    def special_id(self, token: str) -> int:
        if token not in self.specials:
            raise ValueError(f"{token!r} is not a special token of this tokenizer; specials: {self.specials}")
        return self.specials.index(token)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a string, got {type(text).__name__}")
        try:
            return [self._index[c] for c in text]
        except KeyError as err:
            where = text.index(err.args[0])
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary (first at "
                             f"text[{where}]; the tokenizer knows {len(self.chars)} characters)") from None

    def decode(self, ids: Iterable[int] | Tensor, *, skip_specials: bool = True) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        if not isinstance(ids, Iterable) or isinstance(ids, str):
            raise ValueError(f"decode takes a flat sequence of integer ids, got {ids!r}")
        n = len(self.specials)
        out = []
        for i in ids:
            if isinstance(i, bool) or not hasattr(i, "__index__") or i < 0:
                raise ValueError(f"decode takes a flat sequence of integer ids >= 0, got {i!r}")
            if i < n:
                if not skip_specials:
                    out.append(self.specials[i])
            elif i < self.vocab_size:
                out.append(self.chars[i - n])
            else:
                raise ValueError(f"id {i} is outside the vocabulary of {self.vocab_size}")
        return "".join(out)


def _check_stream(name: str, stream) -> None:
    if not isinstance(stream, Tensor) or stream.dim() != 1 or stream.dtype.is_floating_point:
        got = f"{stream.dtype} {tuple(stream.shape)}" if isinstance(stream, Tensor) else type(stream).__name__
        raise ValueError(f"{name} must be a 1-D token stream (an integer tensor, e.g. torch.tensor(tok.encode(text))), "
                         f"got {got}")


def builtin_corpus() -> str:
    """About half a megabyte of English that ships with every Python: the documentation topics
    of ``pydoc_data.topics`` (the text ``help("if")`` prints), in sorted topic order.

    Its exact size and character set depend on the Python version.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def load_corpus(path: str | Path | None = None) -> str:
    """The built-in corpus, or the text of any UTF-8 file you name."""
    if path is None:
        return builtin_corpus()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no text file at {str(path)!r}")
    text = path.read_text(encoding="utf-8")
    if len(text) < 1000:
        raise ValueError(f"{path.name} holds only {len(text)} characters; a language model needs more")
    return text


def train_val_split(ids: Tensor, val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """Split a 1-D token stream: the first part for training, the last ``val_fraction`` for
    validation (contiguous, so no validation text leaks into training windows)."""
    _check_stream("ids", ids)
    check_number("val_fraction", val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
    cut = int(len(ids) * (1 - val_fraction))
    if cut == 0 or cut == len(ids):
        raise ValueError(f"{len(ids)} tokens with val_fraction={val_fraction} leave one of the parts empty")
    return ids[:cut], ids[cut:]


def lm_batch(stream: Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None,
             device=None) -> tuple[Tensor, Tensor]:
    """Random windows of a token stream: inputs (B, T) and the next tokens (B, T)."""
    _check_stream("stream", stream)
    check_count("batch_size", batch_size)
    check_count("block_size", block_size)
    if len(stream) <= block_size:
        raise ValueError(f"the stream ({len(stream)} tokens) must be longer than block_size ({block_size})")
    starts = torch.randint(0, len(stream) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = stream[starts[:, None] + offsets]  # (B, T)
    y = stream[starts[:, None] + offsets + 1]  # (B, T): each position's next token
    return x.to(device), y.to(device)


def lm_windows(stream: Tensor, block_size: int, max_windows: int | None = None) -> tuple[Tensor, Tensor]:
    """Consecutive, non-overlapping windows of a token stream, for evaluation: inputs (N, T) and
    the next tokens (N, T). Every token after the first is a target exactly once, up to the last
    whole window; ``max_windows`` keeps only the first N windows."""
    _check_stream("stream", stream)
    check_count("block_size", block_size)
    n = (len(stream) - 1) // block_size
    if max_windows is not None:
        n = min(n, check_count("max_windows", max_windows))
    if n < 1:
        raise ValueError(f"the stream ({len(stream)} tokens) must be longer than block_size ({block_size})")
    x = stream[: n * block_size].view(n, block_size)  # (N, T)
    y = stream[1 : n * block_size + 1].view(n, block_size)  # (N, T): shifted by one
    return x, y


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> Tensor:
    """Right-pad lists of ids to one length: (B, L) long tensor."""
    if isinstance(seqs, (str, Tensor)) or not seqs:
        raise ValueError(f"pad_sequences takes a non-empty list of id lists, got {type(seqs).__name__} {seqs!r:.60}")
    check_int("pad_id", pad_id, why="the token id to pad with")
    for i, s in enumerate(seqs):
        ids_tensor = isinstance(s, Tensor) and s.dim() == 1 and not (s.dtype.is_floating_point or s.dtype == torch.bool)
        if not ids_tensor and (isinstance(s, (str, Tensor)) or not isinstance(s, Iterable)
                               or not all(isinstance(t, int) and not isinstance(t, bool) for t in s)):
            raise ValueError(f"seqs[{i}] must be a list of int ids, got {s!r:.60}")
    longest = max(len(s) for s in seqs)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a sequence of {longest} ids does not fit in length {length}")
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out
