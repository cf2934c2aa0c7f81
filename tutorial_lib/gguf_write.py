"""Writing a course model and its tokenizer to a GGUF file: the inverse of reading one.

:mod:`tutorial_lib.gguf` reads the format and :func:`tutorial_lib.pretrained.load_pretrained`
turns a file into a :class:`~tutorial_lib.gpt.DecoderOnlyLM`. This module goes the other way,
with ``struct`` and nothing else: :func:`save` writes the header, the metadata, the tensor
infos and the aligned data section that the module docstring of :mod:`tutorial_lib.gguf`
describes, so that the file loads in ``load_pretrained``, in ``transformers``
(``from_pretrained(folder, gguf_file=name)``) and in the ``gguf`` package's reader.

**What goes in.** A LLaMA-flavour model (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases, pre-norm blocks with a final norm, tied or untied head) is llama.cpp's architecture
``llama``. Its shape becomes the ``llama.*`` keys that :func:`tutorial_lib.pretrained.gguf_config`
reads back, its weights get llama.cpp's tensor names from the same table the loader uses
(:func:`tutorial_lib.convert.gguf_tensor_map`), and the rows of the query and key projections
are put into the interleaved RoPE order that llama.cpp's converter writes
(:func:`tutorial_lib.positions.half_split_to_interleaved`; the loader undoes it). A tied model
stores no ``output.weight``: readers take the token table for the head. The tokenizer, a
byte-level BPE with a merge list, becomes ``tokenizer.ggml.*``: every token in GPT-2's byte
symbols (special tokens as their text, with token type 3, "control"), the merges as
"left right", the BOS/EOS ids, ``add_bos_token``, the pre-tokenizer's llama.cpp name and the
chat template. :func:`tutorial_lib.tokenizer_files.tokenizer_from_gguf` reads exactly these.

**Tensor types** (``kind``): "F32" and "F16" store every matrix as it is (rounded to float16
for F16); "Q8_0", "Q4_0" and "Q4_1" store the attention and feed-forward matrices in ggml's
blocks of 32 values (:func:`tutorial_lib.quant.quantize`). The norm weights (1-D) stay F32 in
every kind, as llama.cpp's converter keeps them. The token table and the output head (one
matrix when tied) get Q8_0 under the two 4-bit kinds: ``llama-quantize`` keeps the output
matrix (the token table, when tied) at a higher type than the rest (Q6_K, or Q8_0 when its rows
are not a multiple of 256, as in the bundled SmolLM2 file); Q8_0 is the highest block type
written here, and an untied token table gets it too, for one rule. ``embedding_kind`` chooses
another. A matrix whose rows are not a multiple of 32 values cannot be cut into blocks: that is
a ValueError naming the tensor (llama.cpp's converter falls back to F16 there; here the caller
decides, e.g. with kind="F16").

**What llama.cpp expects, and what is checked here.** llama.cpp is not installed, so its loader
never ran on these files; the tests read them with the ``gguf`` package (llama.cpp's own Python
reader), transformers and load_pretrained. Written as llama.cpp's loader reads them: ``general.architecture`` "llama"
first; ``general.alignment`` (uint32, 32) with every tensor's offset aligned to it;
``general.file_type`` (llama.cpp's ftype number) and ``general.quantization_version`` 2;
``llama.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
``attention.head_count``, ``attention.head_count_kv``, ``rope.dimension_count``, ``vocab_size``
as uint32 and ``rope.freq_base``, ``attention.layer_norm_rms_epsilon`` as float32 (llama.cpp
refuses a key stored with another type); ``attention.key_length``/``value_length`` when the head
width is not d_model / n_heads; ``tokenizer.ggml.model`` "gpt2" with ``tokens``, ``merges``,
``token_type`` (int32), the ids as uint32 and ``add_bos_token`` as a bool; the tensor names and
shapes of llama.cpp's LLaMA graph. What cannot be checked without llama.cpp: that its version
knows the pre-tokenizer name (``"gpt-2"`` for GPT-2's pattern, ``"smollm"`` for each digit
apart, then GPT-2's: both are in llama.cpp's list, but an older build refuses a name it does
not know); that it tokenizes as tutorial_lib does; that it finds a chat template it supports;
and which BOS it uses for a tokenizer without one (llama.cpp then assumes id 11 for BPE).

The float32 keys round ``norm_eps`` and ``rope_base``: a config read back holds
``float32(norm_eps)`` (1e-5 comes back as 9.99999974738e-06), which changes no weight.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from .bpe import BPETokenizer
from .config import ModelConfig
from .convert import check_map_covers, gguf_tensor_map, target_slice
from .gguf import _VALUE_TYPES, DEFAULT_ALIGNMENT, MAGIC, TENSOR_TYPES
from .gpt import DecoderOnlyLM
from .positions import half_split_to_interleaved
from .tokenizer_files import GGUF_PRE_TOKENIZERS, bytes_to_symbols

VERSION = 3
ALIGNMENT = DEFAULT_ALIGNMENT  # written into general.alignment as well
KINDS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1")
# llama.cpp's llama_ftype (general.file_type): what most of the file's matrices are
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION: the block layouts of today
_EMBEDDING_KIND = {"F32": "F32", "F16": "F16", "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_1": "Q8_0"}
_TYPE_ID = {t.name: type_id for type_id, t in TENSOR_TYPES.items()}
_VALUE_TYPE_ID = {name: type_id for type_id, (name, _) in _VALUE_TYPES.items()}
_F16_OVERFLOW = 65520.0  # float16 rounds |x| from here on to inf (65504 is its largest value)
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3  # tokenizer.ggml.token_type
_PRE_NAMES = {patterns: name for name, patterns in GGUF_PRE_TOKENIZERS.items()}


class Value(NamedTuple):
    """A metadata value with its GGUF type: a scalar type ("uint32", "float32", "string",
    "bool", ...), or "array" with the type of its elements in ``element``."""

    type: str
    value: object
    element: str | None = None


class TensorPlan(NamedTuple):
    """One tensor of the file: llama.cpp's name, its shape (PyTorch's order), its type, and
    where its values are: the model's parameter (or the rows of the fused [Q; K; V] matrix),
    read only when the tensor is written; ``rope_heads`` as in TensorMap (Q and K)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    source: Tensor
    rope_heads: int = 0

    def values(self) -> Tensor:
        """The values as stored, in float32 on the CPU: Q and K rows in llama.cpp's interleaved
        RoPE order (the loader's interleaved_to_half_split undoes it)."""
        values = self.source.detach().to("cpu", torch.float32)
        if self.rope_heads:
            values = half_split_to_interleaved(values, self.rope_heads)
        return values.contiguous()


# ---- what is refused ------------------------------------------------------------------------------


def check_llama_flavour(cfg: ModelConfig) -> None:
    """A ValueError listing what makes ``cfg`` something other than llama.cpp's ``llama``
    architecture: the GPT flavour's LayerNorm, learned positions, biases and GELU, a post-norm
    stack, a mixture of experts, scaled embeddings (Gemma)."""
    problems = []
    for field, wanted in (("norm", "rmsnorm"), ("ffn", "swiglu"), ("positions", "rope"), ("norm_order", "pre")):
        if getattr(cfg, field) != wanted:
            problems.append(f"{field}={getattr(cfg, field)!r} (llama: {wanted!r})")
    biased = [part for part in ("qkv", "out", "ffn", "norm") if cfg.uses_bias(part)]
    if biased:
        problems.append(f"biases on {', '.join(biased)} (llama has none)")
    if not cfg.has_final_norm:
        problems.append("no final norm (llama has output_norm)")
    if cfg.scale_embeddings:
        problems.append("scale_embeddings=True (Gemma's sqrt(d_model); llama does not scale)")
    if cfg.n_experts:
        problems.append(f"n_experts={cfg.n_experts} (a mixture of experts, not the dense llama graph)")
    if problems:
        raise ValueError("a GGUF file of architecture 'llama' holds the LLaMA flavour (RMSNorm, SwiGLU, RoPE, "
                         f"no biases, pre-norm); this model has {'; '.join(problems)}")


def _token_table(tokenizer: BPETokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types), one entry per id 0 .. V-1, as tokenizer_from_gguf reads them."""
    if not isinstance(tokenizer, BPETokenizer):
        raise ValueError(f"tokenizer must be a byte-level BPE tokenizer (tutorial_lib.bpe.BPETokenizer), "
                         f"got {type(tokenizer).__name__}")
    what = tokenizer.name
    if tokenizer.merges is None:
        raise ValueError(f"{what} is a rank table (tiktoken's format) without a merge list; GGUF's 'gpt2' "
                         "tokenizer stores merges")
    unsupported = [f"{option}={getattr(tokenizer, option)!r}" for option, default in
                   (("normalization", None), ("prefix_space", False), ("whole_pieces", False))
                   if getattr(tokenizer, option) != default]
    if tokenizer.unknown_id is not None and tokenizer.missing_bytes:
        unsupported.append(f"unknown_id={tokenizer.unknown_id} for {len(tokenizer.missing_bytes)} missing bytes")
    if tokenizer.patterns not in _PRE_NAMES:
        unsupported.append(f"the pre-tokenisation patterns {tokenizer.patterns!r:.100}")
    if unsupported:
        raise ValueError(f"{what} cannot be written as a GGUF tokenizer that tutorial_lib reads back the same: "
                         f"{'; '.join(unsupported)}. Written: merge lists with the pre-tokenizers "
                         f"{sorted(GGUF_PRE_TOKENIZERS)}, no normalization, no prefix space")
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"the model has vocab_size {vocab_size}, but {what} has {tokenizer.vocab_size} ids; "
                         "a GGUF file holds one token per row of the token table")
    tokens: list[str | None] = [None] * vocab_size
    types = [_TOKEN_NORMAL] * vocab_size
    for token, i in tokenizer.vocab.items():
        tokens[i] = bytes_to_symbols(token)
    for text, i in tokenizer.special_tokens.items():  # a special token's text, not its bytes in symbols
        tokens[i], types[i] = text, _TOKEN_CONTROL
    unused = [i for i, token in enumerate(tokens) if token is None]
    if unused:
        raise ValueError(f"{what} has no token for {len(unused)} ids below its vocab_size, e.g. {unused[:5]}; "
                         "a GGUF token list has one token for every id")
    return tokens, types


# ---- metadata -------------------------------------------------------------------------------------


def model_metadata(cfg: ModelConfig, kind: str, name: str) -> dict[str, Value]:
    """``general.*`` and ``llama.*``: what gguf_config, transformers and llama.cpp read."""
    u32 = lambda v: Value("uint32", int(v))  # noqa: E731
    f32 = lambda v: Value("float32", float(v))  # noqa: E731
    meta = {
        "general.architecture": Value("string", "llama"),
        "general.name": Value("string", name),
        "general.alignment": u32(ALIGNMENT),
        "general.file_type": u32(FILE_TYPES[kind]),
        "general.quantization_version": u32(QUANTIZATION_VERSION),
        "llama.context_length": u32(cfg.max_len),
        "llama.embedding_length": u32(cfg.d_model),
        "llama.block_count": u32(cfg.n_layers),
        "llama.feed_forward_length": u32(cfg.ffn_dim),
        "llama.attention.head_count": u32(cfg.n_heads),
        "llama.attention.head_count_kv": u32(cfg.kv_heads),
        "llama.rope.dimension_count": u32(cfg.head_dim),  # every dimension of a head is rotated
        "llama.rope.freq_base": f32(cfg.rope_base),
        "llama.attention.layer_norm_rms_epsilon": f32(cfg.norm_eps),
        "llama.vocab_size": u32(cfg.vocab_size),
    }
    if cfg.head_dim * cfg.n_heads != cfg.d_model:  # readers take d_model / n_heads when these are absent
        meta["llama.attention.key_length"] = meta["llama.attention.value_length"] = u32(cfg.head_dim)
    return meta


def tokenizer_metadata(tokenizer: BPETokenizer, vocab_size: int) -> dict[str, Value]:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template``: what tokenizer_from_gguf reads."""
    tokens, types = _token_table(tokenizer, vocab_size)
    merges = [f"{bytes_to_symbols(left)} {bytes_to_symbols(right)}" for left, right in tokenizer.merges]
    meta = {
        "tokenizer.ggml.model": Value("string", "gpt2"),  # llama.cpp's name for byte-level BPE
        "tokenizer.ggml.pre": Value("string", _PRE_NAMES[tokenizer.patterns]),
        "tokenizer.ggml.tokens": Value("array", tokens, "string"),
        "tokenizer.ggml.token_type": Value("array", types, "int32"),
        "tokenizer.ggml.merges": Value("array", merges, "string"),
    }
    if tokenizer.bos_id is not None:
        meta["tokenizer.ggml.bos_token_id"] = Value("uint32", tokenizer.bos_id)
    if tokenizer.eos_id is not None:
        meta["tokenizer.ggml.eos_token_id"] = Value("uint32", tokenizer.eos_id)
    meta["tokenizer.ggml.add_bos_token"] = Value("bool", tokenizer.add_bos)
    if tokenizer.chat_template is not None:
        meta["tokenizer.chat_template"] = Value("string", tokenizer.chat_template)
    return meta


# ---- tensors --------------------------------------------------------------------------------------


def tensor_plan(model: DecoderOnlyLM, kind: str = "F32", embedding_kind: str | None = None) -> list[TensorPlan]:
    """Every tensor of the file in llama.cpp's order (token table, blocks, final norm, head),
    with its name, shape and type; no values are read yet."""
    _check_kind("kind", kind)
    embedding_kind = _EMBEDDING_KIND[kind] if embedding_kind is None else _check_kind("embedding_kind",
                                                                                     embedding_kind)
    cfg = model.cfg
    maps = gguf_tensor_map(cfg)
    check_map_covers(model, maps)
    params = dict(model.named_parameters())
    plans = []
    for m in maps:
        source = target_slice(params, m)
        if source.dim() == 1:
            chosen = "F32"  # norm weights: tiny, and every reader expects them in F32
        elif m.source in ("token_embd.weight", "output.weight"):
            chosen = embedding_kind
        else:
            chosen = kind
        if chosen in BLOCK_KINDS and source.shape[-1] % TENSOR_TYPES[_TYPE_ID[chosen]].block_values:
            raise ValueError(f"{m.source} has rows of {source.shape[-1]} values, not a multiple of the "
                             f"{chosen} block of 32; choose widths that are, or kind='F16'")
        plans.append(TensorPlan(m.source, tuple(source.shape), chosen, source, m.rope_heads))

    def order(plan: TensorPlan) -> tuple[int, int]:
        parts = plan.name.split(".")
        rank = {"token_embd": 0, "blk": 1, "output_norm": 2, "output": 3}[parts[0]]
        return rank, int(parts[1]) if parts[0] == "blk" else 0

    return sorted(plans, key=order)  # stable: a block keeps the map's order


def _check_kind(what: str, kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"{what} must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def _nbytes(plan: TensorPlan) -> int:
    t = TENSOR_TYPES[_TYPE_ID[plan.kind]]
    return math.prod(plan.shape) // t.block_values * t.block_bytes


def encode_tensor(plan: TensorPlan) -> bytes:
    """The tensor's bytes as stored: float32 or float16 values, or the quantized blocks of
    :func:`tutorial_lib.quant.quantize`, row after row."""
    values = plan.values()
    if plan.kind == "F32":
        data = values
    elif plan.kind == "F16":
        low, high = torch.aminmax(values)  # one pass, no |x| copy
        largest = max(-low.item(), high.item())
        if largest >= _F16_OVERFLOW:
            raise ValueError(f"{plan.name} has values beyond float16's range (largest |x| {largest:.4g}, "
                             f"float16 ends at 65504); write it as F32")
        data = values.half()
    else:
        from .quant import quantize  # only the block kinds need it

        data = torch.as_tensor(quantize(values, plan.kind))
        if data.dtype != torch.uint8 or data.numel() != _nbytes(plan):
            raise ValueError(f"quantize({plan.name}, {plan.kind}) gave {data.numel()} values of {data.dtype}, "
                             f"expected {_nbytes(plan)} bytes")
    return data.contiguous().view(torch.uint8).numpy().tobytes()


# ---- the bytes of the file ------------------------------------------------------------------------


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw  # uint64 length, then the UTF-8 bytes, no terminator


def _scalar(type_name: str, value) -> bytes:
    if type_name == "string":
        return _string(value)
    fmt = _VALUE_TYPES[_VALUE_TYPE_ID[type_name]][1]
    return struct.pack(fmt, value)


def encode_value(v: Value) -> bytes:
    """The value's type id (uint32), then the value; an array: element type, count (uint64),
    elements."""
    if v.type != "array":
        return struct.pack("<I", _VALUE_TYPE_ID[v.type]) + _scalar(v.type, v.value)
    head = struct.pack("<IIQ", _VALUE_TYPE_ID["array"], _VALUE_TYPE_ID[v.element], len(v.value))
    if v.element == "string":
        return head + b"".join(_string(s) for s in v.value)
    fmt = _VALUE_TYPES[_VALUE_TYPE_ID[v.element]][1]
    return head + struct.pack(f"<{len(v.value)}{fmt[1]}", *v.value)  # numbers: one pack for all


def _padding(position: int) -> bytes:
    return b"\0" * (-position % ALIGNMENT)


def header_bytes(metadata: dict[str, Value], plans: list[TensorPlan]) -> bytes:
    """Magic, version, counts, metadata and tensor infos, padded to the alignment: everything
    before the data section. Offsets count from the data section, each a multiple of ALIGNMENT."""
    out = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(plans), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + encode_value(value)
    offset = 0
    for plan in plans:
        dims = plan.shape[::-1]  # fastest-varying first: GGUF's order, the reverse of PyTorch's
        out += _string(plan.name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        out += struct.pack("<IQ", _TYPE_ID[plan.kind], offset)
        offset += _nbytes(plan)
        offset += -offset % ALIGNMENT
    return bytes(out + _padding(len(out)))


def save(path: str | Path, model: DecoderOnlyLM, tokenizer: BPETokenizer, kind: str = "F32", *,
         embedding_kind: str | None = None, name: str | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` to the GGUF (version 3) file ``path`` and return its path.

    kind: the type of the blocks' matrices, "F32", "F16", "Q8_0", "Q4_0" or "Q4_1"; norms stay
    F32, and the token table (and head) get ``embedding_kind`` (default: as ``kind``, but Q8_0
    for the 4-bit kinds; see the module docstring). name: ``general.name`` (default: the
    file's stem). Everything is checked before the first byte is written; the file is written
    to a temporary name in the same folder and renamed at the end, so a failed save leaves no
    half file. One tensor is encoded at a time.
    """
    if not isinstance(model, DecoderOnlyLM):
        raise ValueError(f"model must be a tutorial_lib.gpt.DecoderOnlyLM, got {type(model).__name__}")
    path = Path(path)
    if path.suffix != ".gguf":
        raise ValueError(f"path must end in .gguf (load_pretrained knows a GGUF file by it), got {str(path)!r}")
    _check_kind("kind", kind)
    check_llama_flavour(model.cfg)
    if sys.byteorder != "little":
        raise ValueError("GGUF is little-endian; this writer encodes tensors in the machine's byte order")
    metadata = model_metadata(model.cfg, kind, path.stem if name is None else name)
    metadata |= tokenizer_metadata(tokenizer, model.cfg.vocab_size)
    plans = tensor_plan(model, kind, embedding_kind)
    header = header_bytes(metadata, plans)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for plan in plans:
                data = encode_tensor(plan)
                f.write(data)
                f.write(_padding(len(data)))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
