"""Text data that needs no download: a character tokenizer, the built-in corpus, train and
validation splits, random language-model batches, evaluation windows, and padded batches of
sequences."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


@dataclass(frozen=True)
class CharTokenizer:
    """One id per character. ``specials`` (e.g. "<pad>", "<bos>", "<eos>") come first, with ids
    0, 1, 2, ...; then the characters in sorted order."""

    chars: tuple[str, ...]
    specials: tuple[str, ...] = ()

    @classmethod
    def from_text(cls, text: str | Iterable[str], specials: Sequence[str] = ()) -> CharTokenizer:
        chars = sorted(set("".join(text) if not isinstance(text, str) else text))
        return cls(tuple(chars), tuple(specials))

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
        try:
            return [self._index[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: Iterable[int] | Tensor, *, skip_specials: bool = True) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
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
    if ids.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(ids.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    cut = int(len(ids) * (1 - val_fraction))
    if cut == 0 or cut == len(ids):
        raise ValueError(f"{len(ids)} tokens with val_fraction={val_fraction} leave one of the parts empty")
    return ids[:cut], ids[cut:]


def lm_batch(stream: Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None,
             device=None) -> tuple[Tensor, Tensor]:
    """Random windows of a token stream: inputs (B, T) and the next tokens (B, T)."""
    if stream.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(stream.shape)}")
    if batch_size < 1 or block_size < 1:
        raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size} and {block_size}")
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
    if stream.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(stream.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = (len(stream) - 1) // block_size
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"the stream ({len(stream)} tokens) must be longer than block_size ({block_size})")
    x = stream[: n * block_size].view(n, block_size)  # (N, T)
    y = stream[1 : n * block_size + 1].view(n, block_size)  # (N, T): shifted by one
    return x, y


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> Tensor:
    """Right-pad lists of ids to one length: (B, L) long tensor."""
    if not seqs:
        raise ValueError("no sequences to pad")
    longest = max(len(s) for s in seqs)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a sequence of {longest} ids does not fit in length {length}")
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out
