"""The GGUF file format, read from scratch, and the dequantization of its block types.

GGUF is the single-file format of llama.cpp (and of Ollama and LM Studio, which run on it).
One file holds everything a model needs, in this order (all numbers little-endian):

1. **Header.** The magic bytes ``GGUF``, the format version (uint32; 3 today, 2 has the same
   layout), the number of tensors (uint64) and the number of metadata entries (uint64).
2. **Metadata.** Key-value pairs: a key (a string: uint64 length, then UTF-8 bytes), a value
   type (uint32) and the value. Values are integers, floats, booleans, strings, or arrays of
   one of those (element type, uint64 count, elements). The architecture, its shape
   (``llama.block_count``, ``llama.embedding_length``, ...), the tokenizer (every token,
   every merge) and the chat template all live here.
3. **Tensor infos.** For each tensor: its name, its number of dimensions, the dimensions,
   its type (F32, Q4_1, ...) and where its bytes start, counted from the data section.
   **The dimensions are stored fastest-varying first**, the reverse of PyTorch's order: a
   weight that PyTorch holds as (out, in) = (1536, 576) is stored as [576, 1536]. This module
   reverses them, so every shape it reports is PyTorch's (and the shape that the ``gguf``
   package's dequantizer returns).
4. **Padding** to ``general.alignment`` bytes (32 when the metadata does not say), then the
   **data section**: each tensor's bytes, each again aligned.

Quantized types store a row in *blocks* of 32 values. Each block carries its own scale, so
one outlier only coarsens its own 32 neighbours:

* ``Q8_0``: a float16 scale d, then 32 signed bytes q; value = d * q (34 bytes, 8.5 bits a value).
* ``Q4_0``: d, then 16 bytes of 4-bit q in 0..15; value = d * (q - 8) (18 bytes, 4.5 bits).
* ``Q4_1``: d and a float16 minimum m, then 16 bytes of q; value = d * q + m (20 bytes, 5 bits).

In both 4-bit types byte j of a block holds element j in its low nibble and element j + 16
in its high nibble (not elements 2j and 2j + 1).

The file is memory-mapped, never read whole: :meth:`GGUFFile.tensor` dequantizes one tensor
at a time from the mapped bytes, so filling a model holds the file (in the page cache), the
model, and one tensor in float32.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
BLOCK = 32  # values per block of every quantized type read here

# metadata value types: id -> (name, struct format or None for the variable-length ones)
_VALUE_TYPES = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"), 4: ("uint32", "<I"),
    5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"), 8: ("string", None), 9: ("array", None),
    10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d"),
}


class TensorType(NamedTuple):
    name: str
    block_values: int  # values per block (1 for the plain float types)
    block_bytes: int  # bytes per block


# ggml's type ids (ggml.h) for the types read here; other ids are named for the error message
TENSOR_TYPES = {
    0: TensorType("F32", 1, 4), 1: TensorType("F16", 1, 2), 30: TensorType("BF16", 1, 2),
    8: TensorType("Q8_0", BLOCK, 2 + BLOCK), 2: TensorType("Q4_0", BLOCK, 2 + BLOCK // 2),
    3: TensorType("Q4_1", BLOCK, 4 + BLOCK // 2),
}
_OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
                15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
                34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
SUPPORTED = tuple(t.name for t in TENSOR_TYPES.values())


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # PyTorch's order (slowest first): the stored dimensions reversed
    type_id: int
    offset: int  # from the start of the data section
    nbytes: int | None  # None for a type this module cannot read

    @property
    def type_name(self) -> str:
        if self.type_id in TENSOR_TYPES:
            return TENSOR_TYPES[self.type_id].name
        return _OTHER_TYPES.get(self.type_id, f"unknown type {self.type_id}")


class _Cursor:
    """Reads little-endian values from a buffer, naming the file when it runs out."""

    def __init__(self, data, where: str):
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"{self.where} is truncated: it ends at byte {len(self.data):,} while reading "
                             f"{n:,} bytes at byte {self.pos:,}")
        out = memoryview(self.data)[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.scalar("<Q")))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.where}: a string at byte {self.pos - len(raw):,} is not UTF-8") from None

    def value(self, type_id: int):
        if type_id not in _VALUE_TYPES:
            raise ValueError(f"{self.where}: unknown metadata value type {type_id} at byte {self.pos - 4:,}")
        name, fmt = _VALUE_TYPES[type_id]
        if fmt is not None:
            return self.scalar(fmt)
        if name == "string":
            return self.string()
        element, count = self.scalar("<I"), self.scalar("<Q")
        if element in _VALUE_TYPES and _VALUE_TYPES[element][1] is not None:  # numbers: one unpack for all
            fmt = _VALUE_TYPES[element][1]
            size = struct.calcsize(fmt)
            return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * size)))
        return [self.value(element) for _ in range(count)]


class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> Python value), ``tensors`` (name ->
    :class:`TensorInfo`), and :meth:`tensor` to dequantize one tensor to float32.

    Made by :func:`read`. The file stays memory-mapped until :meth:`close` (or the end of a
    ``with`` block); tensors already returned stay valid after it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = self.path.name
        try:
            with self.path.open("rb") as f:
                size = f.seek(0, 2)
                if size == 0:
                    raise ValueError(f"{where} is empty, not a GGUF file")
                # copy-on-write: torch gets a writable buffer, and the file is never written
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as err:
            raise ValueError(f"cannot read {self.path}: {err}") from err
        cursor = _Cursor(self._map, where)
        magic = bytes(cursor.take(4)) if size >= 4 else bytes(self._map[:size])
        if magic != MAGIC:
            raise ValueError(f"{where} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
        self.version = cursor.scalar("<I")
        if self.version not in VERSIONS:
            raise ValueError(f"{where} is GGUF version {self.version}; this reader knows versions "
                             f"{', '.join(map(str, VERSIONS))}")
        n_tensors, n_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_keys):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{where}: general.alignment must be a power of two, got {self.alignment}")
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]  # fastest-varying first
            type_id, offset = cursor.scalar("<I"), cursor.scalar("<Q")
            shape = tuple(reversed(dims))  # PyTorch's order
            self.tensors[name] = TensorInfo(name, shape, type_id, offset, _nbytes(name, shape, type_id, where))
        self.data_start = -(-cursor.pos // self.alignment) * self.alignment  # rounded up
        for info in self.tensors.values():
            end = self.data_start + info.offset + (info.nbytes or 0)
            if end > size:
                raise ValueError(f"{where} is truncated: tensor {info.name} needs bytes up to {end:,}, "
                                 f"but the file has {size:,}")

    # ---- access ---------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ValueError(f"{self.path.name} has no tensor {name!r}; it has {len(self.tensors)}, "
                             f"e.g. {', '.join(list(self.tensors)[:4])}")
        return self.tensors[name]

    def check_supported(self, name: str) -> TensorInfo:
        """The tensor's info; a ValueError when its type is not one this module dequantizes."""
        info = self.info(name)
        if info.type_id not in TENSOR_TYPES:
            raise ValueError(f"{self.path.name}: tensor {name} is stored as {info.type_name}, which "
                             f"tutorial_lib.gguf does not dequantize; supported: {', '.join(SUPPORTED)}")
        return info

    def raw(self, name: str) -> Tensor:
        """The tensor's bytes as stored, a uint8 tensor of shape (*shape[:-1], bytes per row),
        read from the mapped file (no copy). For block types a row is its blocks, in order."""
        info = self.check_supported(name)
        kind = TENSOR_TYPES[info.type_id]
        start = self.data_start + info.offset
        data = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=start)
        row_bytes = info.shape[-1] // kind.block_values * kind.block_bytes if info.shape else kind.block_bytes
        return data.view(*info.shape[:-1], row_bytes)

    def tensor(self, name: str) -> Tensor:
        """The tensor as stored in the file (no permutation), dequantized to float32, in
        PyTorch's order of dimensions."""
        info = self.check_supported(name)
        return dequantize(self.raw(name), TENSOR_TYPES[info.type_id].name).reshape(info.shape)

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        arch = self.metadata.get("general.architecture", "?")
        return f"GGUFFile({self.path.name!r}, version {self.version}, {arch}, {len(self.tensors)} tensors)"


def _nbytes(name: str, shape: tuple[int, ...], type_id: int, where: str) -> int | None:
    if type_id not in TENSOR_TYPES:
        return None
    kind = TENSOR_TYPES[type_id]
    if any(d <= 0 for d in shape):
        raise ValueError(f"{where}: tensor {name} has shape {shape}; every dimension must be positive")
    if shape[-1] % kind.block_values:
        raise ValueError(f"{where}: tensor {name} ({kind.name}) has rows of {shape[-1]} values, not a multiple "
                         f"of its block of {kind.block_values}")
    n = 1
    for d in shape:
        n *= d
    return n // kind.block_values * kind.block_bytes


def read(path: str | Path) -> GGUFFile:
    """Open a GGUF file: header, metadata and tensor infos are parsed now, tensors when asked."""
    return GGUFFile(path)


# ---- dequantization ---------------------------------------------------------------------------------


def _halves(blocks: Tensor, start: int) -> Tensor:
    """The float16 stored at bytes start, start + 1 of every block, as float32: (..., n_blocks, 1)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: Tensor) -> Tensor:
    """(..., 16) bytes -> (..., 32) values 0..15: the low nibbles are elements 0..15, the high
    nibbles elements 16..31."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def dequantize(data: Tensor, kind: str) -> Tensor:
    """Stored bytes (uint8, (..., bytes per row)) of type ``kind`` -> float32 values (..., row).

    Written as ggml's reference dequantizer computes it, in float32: Q8_0 d * q, Q4_0
    d * (q - 8), Q4_1 d * q + m (a product, then a sum: two roundings, as in ``gguf``'s numpy).
    """
    if not isinstance(data, Tensor) or data.dtype != torch.uint8:
        raise ValueError(f"data must be a uint8 tensor of stored bytes, got "
                         f"{data.dtype if isinstance(data, Tensor) else type(data).__name__}")
    by_name = {t.name: t for t in TENSOR_TYPES.values()}
    if kind not in by_name:
        raise ValueError(f"kind must be one of {', '.join(SUPPORTED)}, got {kind!r}")
    block_bytes = by_name[kind].block_bytes
    if data.dim() == 0 or data.size(-1) % block_bytes:
        raise ValueError(f"a {kind} row is a whole number of {block_bytes}-byte blocks; got rows of "
                         f"{data.size(-1) if data.dim() else 0} bytes")
    lead = data.shape[:-1]
    if kind in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        # a copy even for F32: the result must not be a view of the (mapped) file
        return data.contiguous().view(dtype).to(torch.float32, copy=True)
    blocks = data.reshape(*lead, -1, block_bytes)  # (..., n_blocks, block bytes)
    d = _halves(blocks, 0)
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # (..., n_blocks, 32)
        values = d * q
    elif kind == "Q4_0":
        values = d * (_nibbles(blocks[..., 2:]).float() - 8.0)
    else:  # Q4_1
        values = d * _nibbles(blocks[..., 4:]).float() + _halves(blocks, 2)
    return values.reshape(*lead, -1)


# ---- writing ---------------------------------------------------------------------------------------


def save(path, model, tokenizer, kind: str = "F32", *, embedding_kind: str | None = None,
         name: str | None = None) -> Path:
    """Write a LLaMA-flavour :class:`~tutorial_lib.gpt.DecoderOnlyLM` and its byte-level BPE
    tokenizer to the GGUF file ``path`` and return its path. kind: "F32", "F16", "Q8_0", "Q4_0"
    or "Q4_1" for the blocks' matrices (norms stay F32); embedding_kind: the token table's and
    head's type (default: kind, but Q8_0 for the 4-bit kinds); name: ``general.name``.

    The inverse of :func:`read` and :func:`tutorial_lib.pretrained.load_pretrained`. The writer is
    :mod:`tutorial_lib.gguf_write` (its docstring says what is stored, in which types, and which
    of llama.cpp's expectations are met); it is imported when called, because it imports this
    module, the model and the weight maps.
    """
    from .gguf_write import save as write

    return write(path, model, tokenizer, kind, embedding_kind=embedding_kind, name=name)
